"""The offload runtime through RL-shaped training on a GPU: the issue's acceptance suite.

Two policy workers live in one process, built from the same seed: one with fine-grained
offloading, one without. Each of the 100 steps trains both on the same micro-batches, with
forward-only passes (log-probabilities, a reference pass, generation) on the offloading one in
between, 3 micro-batch counts and 8 sequence lengths (7 length buckets) in a shuffled order. After
every step the gradients of the two are compared, and the offloading worker's memory is checked:

- no error; gradients bitwise equal at every step, the first included (deterministic mode);
- every step's activation peak (peak during forward-backward minus what was resident at the
  start of the step: the other model's memory does not blur it) within 5% of its shape's
  steady value (the median over the shape's later steps; 64 MiB on small shapes, for the
  caching allocator's block slack), and below the plain model's for that step;
  the first step of a shape, which records the plan and offloads even the groups replayed
  steps keep on the GPU, may only be lower;
- pinned host memory (the shared pool and torch's caching host allocator) under the budget,
  within the pool's slack (1.25x) of the largest plan's need after every step however many
  shapes came (issue 19), and, dense, unchanged by any step whose shape was seen before;
- MoE: expert_fc1 and moe_act offload bytes (through the local grouped expert MLP); the same
  with Megatron's own hook code instead of the runtime's lean hooks (``moe_megatron_hooks``).

A shorter run with the default (flash) attention, whose backward is not deterministic, checks
that the gradient difference stays within the spread of two plain passes. Results go to
$NEMO_RL_OFFLOAD_RESULTS (a directory) when set.

Run on a GPU machine (docs/gpu.md):
    python3 -m pytest -m gpu -q tests/functional/test_offload_runtime_gpu.py
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import numpy as np
import pytest
import torch
from support.gpu_results import write_results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 100
COUNTS = (1, 2, 4)  # micro-batches per step
LENGTHS = (250, 380, 500, 760, 1000, 1200, 1500, 2000)  # 1200 and 1500 share bucket 1536
ROWS = 2  # sequences per micro-batch
MAX_LENGTH = 2048
BUDGET_GIB = 48.0
# Allocated peaks count the caching allocator's blocks, which may exceed their requests (a
# cached block is handed out whole when the rest would be under 1 MiB), by an amount that
# depends on what the allocator holds cached by then: on the MoE model's short shapes it moves
# the peak of one plan, with the same offloaded bytes, over a process by more than 5% of those
# small peaks (benchmarks/results/2026-11-25_h100_offload_runtime_moe_allocator_drift.json).
ALLOCATOR_SLACK_GIB = 0.0625
MODELS = {
    "dense": ("llama-1b", ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]),
    "moe": ("moe-1b", ["core_attn", "attn_proj", "expert_fc1", "moe_act"]),
    # The five with the dense MLP's offload points (models.mlp_offload).
    "dense_mlp": (
        "llama-1b",
        ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
        + ["mlp_fc1", "mlp_act", "mlp_fc2"],
    ),
}
DENSE = ("dense", "dense_mlp")
# The MoE model again with Megatron's own hook code (the runtime's lean hooks off), which
# failed this suite twice before the offload layer was owned (issue 19 part 4).
MEGATRON_HOOKS = "moe_megatron_hooks"


def _section(model: str, modules: list[str], *, offload: bool, deterministic: bool, lr: float):
    return {
        "model_name": model,
        "precision": "bfloat16",
        "max_total_sequence_length": MAX_LENGTH,
        "megatron_cfg": {
            "enabled": True,
            "fine_grained_activation_offloading": offload,
            "offload_modules": modules if offload else None,
            "offload_host_memory_budget_gib": BUDGET_GIB,
            # 1 MiB elements: MoE expert inputs at 250 tokens x top-2 are 1 M, so lower it.
            "min_offloaded_tensor_size": 65536,
            "model_overrides": {"deterministic_mode": deterministic, "moe_grouped_gemm": True}
            if model == "moe-1b"
            else {"deterministic_mode": deterministic},
            "optimizer": {
                "optimizer": "adam",
                "lr": lr,
                "min_lr": lr,
                "clip_grad": 0.0,
                "use_distributed_optimizer": False,
            },
        },
    }


def _worker(section: dict[str, Any]):
    from nemo_rl_offload.models.policy_worker import PolicyWorker

    worker = PolicyWorker(
        section=section, where="policy", rank=0, world_size=1, seed=1234, on_gpu=True
    )
    address, port = worker.node_address()
    worker.setup(address, port)
    return worker


def _release(*workers) -> None:
    """Free both models before the next test builds its own (PolicyWorker.close also breaks
    the MoE dispatcher's reference cycle that would keep a MoE model alive)."""
    for worker in workers:
        worker.close()


def _schedule(seed: int, steps: int) -> list[tuple[int, int]]:
    """Every (count, length) pair about equally often, shuffled; the first step included."""
    shapes = [(count, length) for count in COUNTS for length in LENGTHS]
    order = (shapes * (steps // len(shapes) + 1))[:steps]
    np.random.default_rng(seed).shuffle(order)
    return order


def _step_batch(count: int, length: int, vocab: int, rng: np.random.Generator) -> list[dict]:
    """``count`` micro-batches whose longest sequence has ``length`` tokens; the others are
    shorter (padding within a step is the runtime's job)."""
    batches = []
    for index in range(count):
        n = length - 7 * index
        ids = rng.integers(0, vocab, (ROWS, n))
        mask = np.ones((ROWS, n), np.float32)
        mask[:, : n // 4] = 0.0  # a prompt that does not count
        batches.append({"input_ids": ids, "labels": ids, "loss_mask": mask})
    return batches


def _as_padded_by_the_runtime(batch: list[dict]) -> list[dict]:
    """The micro-batches as the offloading worker's runtime pads them (to the step's length
    bucket): the plain model gets the same padded inputs, so the two compute the same thing."""
    from nemo_rl_offload.offload.runtime import (
        bucket_for,
        pad_microbatches,
        sequence_length_buckets,
    )

    longest = max(mb["input_ids"].shape[1] for mb in batch)
    return pad_microbatches(batch, bucket_for(longest, sequence_length_buckets(MAX_LENGTH)))


def _grads(worker) -> list[torch.Tensor]:
    return [p.main_grad for p in worker._unwrapped().parameters()]


def _max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def vocab() -> int:
    from nemo_rl_offload.config.model_presets import architecture_for

    return architecture_for("llama-1b").vocab_size


@pytest.mark.parametrize("kind", ["dense", "moe", MEGATRON_HOOKS, "dense_mlp"])
def test_hundred_rl_steps_bitwise_bounded_and_flat(kind, vocab):
    model, modules = MODELS["moe" if kind == MEGATRON_HOOKS else kind]
    fgo = _worker(_section(model, modules, offload=True, deterministic=True, lr=1e-5))
    if kind == MEGATRON_HOOKS:  # every plan's choices, before the first step records one
        fgo.runtime.choices = dataclasses.replace(fgo.runtime.choices, lean_hooks=False)
    plain = _worker(_section(model, modules, offload=False, deterministic=True, lr=1e-5))
    try:
        params = zip(fgo._unwrapped().parameters(), plain._unwrapped().parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in params), "same seed, same initial weights"
        rng = np.random.default_rng(7)
        records, seen = [], set()
        for step, (count, length) in enumerate(_schedule(11, STEPS), start=1):
            batch = _step_batch(count, length, vocab, rng)
            fgo.token_logprobs(batch[:1])  # GRPO's old-logprob pass
            if step % 10 == 0:
                fgo.generate([[1, 2, 3, 4]], {"max_new_tokens": 4}, seed=step, pad_id=0)
            metrics = fgo.train(batch, {"name": "nll"})
            plain_metrics = plain.train(_as_padded_by_the_runtime(batch), {"name": "nll"})
            shape = (count, int(metrics["offload_step_length"]))
            records.append(
                {
                    "step": step,
                    "microbatches": count,
                    "longest": length,
                    "bucket": shape[1],
                    "new_shape": shape not in seen,
                    "grads_bitwise_equal": _bitwise_equal(_grads(fgo), _grads(plain)),
                    "grad_max_abs_diff": _max_abs_diff(_grads(fgo), _grads(plain)),
                    "loss": metrics["loss"],
                    "plain_loss": plain_metrics["loss"],
                    "activation_peak_gib": metrics["peak_activation_gpu_memory_gib"],
                    "plain_activation_peak_gib": plain_metrics["peak_activation_gpu_memory_gib"],
                    "peak_gib": metrics["peak_fwd_bwd_gpu_memory_gib"],
                    "plain_peak_gib": plain_metrics["peak_fwd_bwd_gpu_memory_gib"],
                    "train_s": metrics["step_time_s"],
                    "plain_train_s": plain_metrics["step_time_s"],
                    **{
                        k: v
                        for k, v in metrics.items()
                        if k.startswith(
                            ("offload", "d2h", "h2d", "pinned", "largest", "plan_need", "torch_")
                        )
                    },
                }
            )
            seen.add(shape)
        summary = _summarise(records)
        write_results(
            f"offload_runtime_{kind}",
            {
                "model": model,
                "offload_modules": modules,
                "budget_gib": BUDGET_GIB,
                "summary": summary,
                "steps": records,
            },
        )
    finally:
        _release(fgo, plain)

    assert all(r["grads_bitwise_equal"] for r in records), [
        (r["step"], r["grad_max_abs_diff"]) for r in records if not r["grads_bitwise_equal"]
    ]
    assert all(r["loss"] == r["plain_loss"] for r in records)
    for shape, values in summary["activation_peak_by_shape"].items():
        steady, (first, *replayed) = values["steady_gib"], values["all_gib"]
        tolerance = max(0.05 * steady, ALLOCATOR_SLACK_GIB)
        assert all(abs(v - steady) <= tolerance for v in replayed), (shape, values)
        # The first step of a shape records its plan, offloading every group (the last ones
        # too, which replayed steps keep on the GPU): its peak may only be lower.
        assert first <= steady + tolerance, (shape, values)
    assert all(r["activation_peak_gib"] < r["plain_activation_peak_gib"] for r in records)
    if kind in DENSE:  # MoE expert sizes follow the routing: its pool may still adjust
        for before, after in zip(records, records[1:], strict=False):
            if not after["new_shape"]:
                assert after["offload_pool_gib"] == before["offload_pool_gib"], (before, after)
    assert max(r["pinned_host_gib"] for r in records) <= BUDGET_GIB
    # Pinned host memory (the shared pool and torch's caching host allocator) follows the
    # largest step, not the number of shapes (issue 19): within the pool's slack of the
    # largest plan's need after every step.
    from nemo_rl_offload.offload.owned import POOL_SLACK

    assert all(0 < r["pinned_over_need"] <= POOL_SLACK for r in records), [
        (r["step"], r["pinned_over_need"]) for r in records if r["pinned_over_need"] > POOL_SLACK
    ]
    assert records[-1]["offload_plans_released"] == 0
    assert records[-1]["offload_plans_recorded"] == len(
        {(r["microbatches"], r["bucket"]) for r in records}
    )
    for module in modules:
        assert all(r.get(f"offloaded_gib_{module}", 0) > 0 for r in records), module
    # Every byte offloaded comes back; steps that replay a plan copy at bandwidth (those that
    # record one also allocate their pinned buffers inside the timed copies). The rate is
    # judged over all replayed steps together: a single small step's rate is mostly launch
    # latency and varies several-fold between runs and steps
    # (benchmarks/results/2026-11-24_h100_offload_runtime_moe.json).
    assert all(r["d2h_gib"] == r["h2d_gib"] for r in records)
    floor_gb_per_s = 20.0 if kind in DENSE else 4.0
    replayed = [r for r in records if not r["new_shape"]]
    for way in ("d2h", "h2d"):
        gib = sum(r[f"{way}_gib"] for r in replayed)
        seconds = sum(r[f"{way}_gib"] / r[f"{way}_gb_per_s"] for r in replayed)
        assert gib / seconds > floor_gb_per_s, (way, gib / seconds)


def _peaks_by_shape(records: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    by_shape: dict[str, list[float]] = {}
    for r in records:
        by_shape.setdefault(f"{r['microbatches']}x{r['bucket']}", []).append(r[key])
    peaks = {}
    for shape, values in by_shape.items():
        steady = statistics.median(values[1:] or values)
        deviation = max(abs(v - steady) for v in values)
        peaks[shape] = {
            "steady_gib": steady,
            "all_gib": values,
            "max_rel_dev": deviation / steady if steady else float("inf"),
        }
    return peaks


def _summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    peaks = _peaks_by_shape(records, "activation_peak_gib")
    return {
        "steps": len(records),
        "shapes": len(peaks),
        "grads_bitwise_equal_steps": sum(r["grads_bitwise_equal"] for r in records),
        "max_peak_rel_dev": max(p["max_rel_dev"] for p in peaks.values()),
        "max_replayed_peak_rel_dev": max(
            abs(v - p["steady_gib"]) / p["steady_gib"]
            for p in peaks.values()
            for v in p["all_gib"][1:]
        ),
        "first_step_peak_vs_steady": [
            p["all_gib"][0] / p["steady_gib"] - 1 for p in peaks.values()
        ],
        "max_pinned_gib": max(r["pinned_host_gib"] for r in records),
        "max_offload_pool_gib": max(r["offload_pool_gib"] for r in records),
        "max_torch_pinned_host_gib": max(r["torch_pinned_host_gib"] for r in records),
        "largest_plan_need_gib": records[-1]["largest_plan_need_gib"],
        "max_pinned_over_need": max(r["pinned_over_need"] for r in records),
        "plans_recorded": records[-1]["offload_plans_recorded"],
        "plans_released": records[-1]["offload_plans_released"],
        "median_d2h_gb_per_s": statistics.median(r["d2h_gb_per_s"] for r in records),
        "median_h2d_gb_per_s": statistics.median(r["h2d_gb_per_s"] for r in records),
        "activation_peak_by_shape": peaks,
        "median_activation_saving": statistics.median(
            1 - r["activation_peak_gib"] / r["plain_activation_peak_gib"] for r in records
        ),
    }


def test_flash_attention_within_the_spread_of_two_plain_passes(vocab):
    """Default attention kernels (not deterministic mode): the plain model runs each step twice
    on the same weights (lr 0), which measures the spread; the offloading one must fall in it."""
    torch.use_deterministic_algorithms(False)  # the tests above turned it on process-wide
    model, modules = MODELS["dense"]
    fgo = _worker(_section(model, modules, offload=True, deterministic=False, lr=0.0))
    plain = _worker(_section(model, modules, offload=False, deterministic=False, lr=0.0))
    try:
        rng = np.random.default_rng(3)
        rows = []
        for step, (count, length) in enumerate(_schedule(5, 12), start=1):
            batch = _step_batch(count, length, vocab, rng)
            fgo.token_logprobs(batch[:1])
            fgo.train(batch, {"name": "nll"})
            padded = _as_padded_by_the_runtime(batch)
            plain.train(padded, {"name": "nll"})
            first = [g.clone() for g in _grads(plain)]
            plain.train(padded, {"name": "nll"})
            rows.append(
                {
                    "step": step,
                    "microbatches": count,
                    "longest": length,
                    "offload_vs_plain": _max_abs_diff(_grads(fgo), first),
                    "plain_vs_plain": _max_abs_diff(_grads(plain), first),
                }
            )
        write_results("offload_runtime_flash_spread", {"steps": rows})
    finally:
        _release(fgo, plain)
    # Two passes of one nondeterministic model differ by a few bf16 rounding steps at some
    # steps and not at others; the offloading model is one more such pass, so its largest
    # difference is compared with twice the largest plain one (an offload bug, such as the
    # warm-up race of Megatron-LM 7398, shows up as differences of 1e-3 and more).
    spread = max(r["plain_vs_plain"] for r in rows)
    assert max(r["offload_vs_plain"] for r in rows) <= 2 * spread, rows
