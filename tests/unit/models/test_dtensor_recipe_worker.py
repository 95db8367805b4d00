"""A recipe written for NeMo-RL's DTensor backend trains on megatron-core with its meaning: the
mapped section (config/dtensor_recipes.py) builds a policy worker whose optimizer steps at the
learning rate torch's own schedulers give each step (with weight decay on, so the worker's path
that decays every parameter, as torch's AdamW does, runs too)."""

from __future__ import annotations

import math

import pytest
import torch
from support import worker_ranks

LR, WARMUP = 3.0e-3, 2
SCHEDULER = [
    {
        "name": "torch.optim.lr_scheduler.LinearLR",
        "kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": WARMUP},
    },
    {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 9}},
    {"milestones": [WARMUP]},
]


def _recipe() -> dict:
    policy = worker_ranks.section()
    policy["megatron_cfg"]["enabled"] = False
    policy["dtensor_cfg"] = {
        "enabled": True,
        "tensor_parallel_size": 1,
        "context_parallel_size": 1,
        "sequence_parallel": False,
        "activation_checkpointing": False,
        "cpu_offload": False,
    }
    policy["optimizer"] = {
        "name": "torch.optim.AdamW",
        "kwargs": {"lr": LR, "weight_decay": 0.01, "betas": [0.9, 0.98], "eps": 1e-6},
    }
    policy["scheduler"] = SCHEDULER
    policy["max_grad_norm"] = 1.0
    return {"sft": {"max_num_steps": 4}, "policy": policy}


def _torch_lrs(steps: int) -> list[float]:
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.AdamW([param], lr=LR)
    schedulers = [
        getattr(torch.optim.lr_scheduler, e["name"].rpartition(".")[2])(optimizer, **e["kwargs"])
        for e in SCHEDULER[:2]
    ]
    sequential = torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, [WARMUP])
    lrs = []
    for _ in range(steps):
        optimizer.step()
        sequential.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_a_dtensor_recipe_trains_at_torchs_learning_rates(tmp_path):
    (result,) = worker_ranks.run_ranks(
        worker_ranks.dtensor_recipe_steps, 1, tmp_path, recipe=_recipe(), steps=4
    )
    steps = result["steps"]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [s["lr"] for s in steps] == pytest.approx(_torch_lrs(4), rel=1e-9)
