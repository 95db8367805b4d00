"""``policy.megatron_cfg.freeze_moe_router`` (NeMo-RL's): the decoder's MoE router weights do
not train; everything else does (one CPU worker, the tiny MoE preset)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import worker_ranks
from support.worker_ranks import run_ranks


def _weights_before_and_after_a_step(rank, world, port, out, policy):
    worker = worker_ranks.make_worker(rank, world, port, policy)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    worker_ranks.train_step(worker, 1)
    changed = {
        name: bool((param.detach() != before[name]).any())
        for name, param in worker.model.named_parameters()
    }
    return {"changed": changed}


@pytest.mark.parametrize("freeze", [True, False])
def test_frozen_routers_keep_their_weights(tmp_path: Path, freeze: bool):
    policy = {**worker_ranks.section(freeze_moe_router=freeze), "model_name": "tiny-moe"}
    (result,) = run_ranks(_weights_before_and_after_a_step, 1, tmp_path, policy=policy)
    changed = result["changed"]
    routers = [n for n in changed if n.endswith("mlp.router.weight")]
    assert len(routers) == 2
    assert all(changed[n] != freeze for n in routers)
    others = [n for n in changed if n not in routers]
    assert np.mean([changed[n] for n in others]) > 0.9


def test_validate_accepts_freeze_moe_router_on_an_moe_model():
    from nemo_rl_offload.preflight import load_and_check

    root = Path(__file__).resolve().parents[3]
    report = load_and_check(
        str(root / "examples" / "configs" / "tiny" / "grpo.yaml"),
        ["++policy.model_name=tiny-moe", "++policy.megatron_cfg.freeze_moe_router=true"],
    )
    assert not [e for e in report.errors if "freeze_moe_router" in e], report.errors
