"""A policy worker's close() frees its model within the process, MoE layers included (their
token dispatcher keeps an autograd graph that Python's garbage collector cannot free alone)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_close_frees_the_model(megatron_cpu, moe_globals_restored, model):
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    section = {
        "model_name": model,
        "precision": "float32",
        "max_total_sequence_length": 64,
        "megatron_cfg": {
            "enabled": True,
            "optimizer": {"optimizer": "adam", "lr": 1e-3, "use_distributed_optimizer": False},
        },
    }
    worker = PolicyWorker(
        settings=resolve_policy(section), rank=0, world_size=1, seed=1, on_gpu=False
    )
    worker.setup(*worker.node_address())  # joins the fixture's process group
    ids = np.random.default_rng(0).integers(0, 300, (2, 32))
    worker.train(
        [{"input_ids": ids, "labels": ids, "loss_mask": np.ones((2, 32), np.float32)}],
        {"name": "nll"},
    )
    model_ref = weakref.ref(worker._unwrapped())
    worker.close()
    gc.collect()
    assert model_ref() is None
    assert worker.model is None and worker.optimizer is None


def test_a_deeper_moe_model_trains_after_another_in_the_same_process(
    megatron_cpu, moe_globals_restored
):
    """Megatron's MoE metrics tracker is process-wide and sized by the first model that
    records: a second, deeper MoE model in the process must still train (tests and benchmarks
    build several models in one process)."""
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    ids = np.random.default_rng(0).integers(0, 300, (2, 32))
    batch = [{"input_ids": ids, "labels": ids, "loss_mask": np.ones((2, 32), np.float32)}]
    for layers in (2, 4):
        section = {
            "model_name": "tiny-moe",
            "precision": "float32",
            "max_total_sequence_length": 64,
            "megatron_cfg": {
                "enabled": True,
                "model_overrides": {"num_layers": layers},
                "optimizer": {"optimizer": "adam", "lr": 1e-3, "use_distributed_optimizer": False},
            },
        }
        worker = PolicyWorker(
            settings=resolve_policy(section), rank=0, world_size=1, seed=1, on_gpu=False
        )
        worker.setup(*worker.node_address())
        assert np.isfinite(worker.train(batch, {"name": "nll"})["loss"])
        worker.close()
