"""initialize_megatron_parallel: refuses without torch.distributed; sets sizes and seeds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from nemo_rl_offload.models.parallel import initialize_megatron_parallel  # noqa: E402


def test_requires_torch_distributed_first():
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group first"):
        initialize_megatron_parallel({}, seed=0, on_gpu=False)


def test_parallel_state_and_cpu_rng(megatron_cpu):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from nemo_rl_offload.models.cpu_compat import CpuRngTracker, cpu_execution_enabled

    assert parallel_state.model_parallel_is_initialized()
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    assert parallel_state.get_expert_model_parallel_world_size() == 1
    assert cpu_execution_enabled()
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, CpuRngTracker)
    # Megatron's three streams were registered (data-parallel, model-parallel, expert).
    assert set(tracker.get_states()) >= {"model-parallel-rng", "expert-parallel-rng"}


def test_reinitialising_seeds_the_cpu_generator(megatron_cpu):
    from nemo_rl_offload.models.parallel import destroy_megatron_parallel

    destroy_megatron_parallel()
    cfg = {"tensor_model_parallel_size": None, "expert_tensor_parallel_size": None}
    initialize_megatron_parallel(cfg, seed=99, on_gpu=False)
    drawn = torch.rand(3)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(99)))
