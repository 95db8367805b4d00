"""The offload runtime's 100-step RL suite at data parallel 2, on two GPUs of one host.

Each rank (a process of its own, one GPU each) trains an offloading and a plain worker side by
side on its own tokens, as the one-GPU suite does (tests/functional/test_offload_runtime_gpu.py,
whose checks apply here per rank): after every step, each rank's gradients, reduced over the
data-parallel group by Megatron, are bitwise those of the plain model on the same shard, and
each rank's offload telemetry (activation peaks flat per shape, pinned memory within the pool's
slack of its largest plan) passes the one-GPU checks. The ranks see different tokens, so their
losses differ while their reduced gradients must agree across ranks too.

Run on a host with two GPUs (docs/gpu.md):
    NEMO_RL_OFFLOAD_RESULTS=DIR python3 -m pytest -m gpu -q \
        tests/functional/test_offload_runtime_dp_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from support.gpu_results import write_results
from support.offload_suite import BUDGET_GIB, STEPS, check_records, data_parallel_rank
from support.worker_ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs",
    ),
]

WORLD = 2


@pytest.mark.parametrize("kind", ["dense"])
def test_hundred_rl_steps_at_data_parallel_two(kind, tmp_path):
    ranks = run_ranks(data_parallel_rank, WORLD, tmp_path, kind=kind, steps=STEPS)
    write_results(
        f"offload_runtime_{kind}_dp{WORLD}",
        {"budget_gib": BUDGET_GIB, "ranks": ranks},
    )
    assert sorted(r["dp_rank"] for r in ranks) == list(range(WORLD))
    assert all(r["dp_size"] == WORLD for r in ranks)
    for rank in ranks:
        check_records(kind, rank["offload_modules"], rank["steps"], rank["summary"])
    # The ranks trained on different tokens (their losses differ) and ended each step with
    # the same reduced gradients: the reduction ran, on both models alike.
    first, second = (r["steps"] for r in ranks)
    assert any(a["loss"] != b["loss"] for a, b in zip(first, second, strict=True))
    assert [a["grad_digest"] for a in first] == [b["grad_digest"] for b in second]
