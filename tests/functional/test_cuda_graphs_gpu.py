"""Full-iteration CUDA graphs with fine-grained offloading through RL-shaped training on a GPU.

For SFT and GRPO steps (GRPO: an old-logprob and a reference pass before every step, outside the
graph), the same 50 steps run on seven freshly built policies, one after the other:

- ``plain_a``, ``plain_b``: no offloading, no graphs, twice (their difference is the spread);
- ``fgo_eager``: the five dense modules offloaded, no graphs;
- ``fgo_graph_0``/``_1``/``_2``: offloaded, ``cuda_graph_impl: full_iteration`` with
  ``fine_grained_offloading_max_inflight_offloads`` 0, 1, 2;
- ``graph_only``: full-iteration graphs without offloading.

Steps come in 4 shapes (1 or 2 micro-batches x 2 length buckets) in a shuffled order, so each
shape warms up, is captured and then replayed. Checked: no error; every step after a shape's
warm-up runs as a graph replay; every graphed run's losses equal the eager offloading run's
within the plain spread (deterministic mode: both are bitwise); offloading still moves bytes and
cuts the activation peak under graphs. Peak memory and step times of every run go to
$NEMO_RL_OFFLOAD_RESULTS (a directory) when set.

Run on a GPU machine (docs/gpu.md, docs/cuda_graphs.md):
    python3 -m pytest -m gpu -q tests/functional/test_cuda_graphs_gpu.py
"""

from __future__ import annotations

import os
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

STEPS = int(os.environ.get("NEMO_RL_OFFLOAD_GRAPH_STEPS", "50"))
COUNTS = (1, 2)  # micro-batches per step
LENGTHS = (700, 1000)  # buckets 768 and 1024
ROWS = 2
MAX_LENGTH = 1024
WARMUP = 2  # cuda_graph_warmup_steps
MODEL = "llama-1b"
MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
GRPO_LOSS = {
    "name": "grpo",
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "kl_penalty": 0.01,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain_a": {},
    "plain_b": {},
    "fgo_eager": {"offload": True},
    "fgo_graph_0": {"offload": True, "graphs": True, "inflight": 0},
    "fgo_graph_1": {"offload": True, "graphs": True, "inflight": 1},
    "fgo_graph_2": {"offload": True, "graphs": True, "inflight": 2},
    "graph_only": {"graphs": True},
}


# A MoE model graphs only with drop-and-pad dispatch (every expert takes its capacity).
MOE_MODEL = "moe-1b"
MOE_MODULES = ["core_attn", "attn_proj", "expert_fc1", "moe_act"]
DROP_AND_PAD = {
    "moe_grouped_gemm": True,
    "moe_expert_capacity_factor": 1.0,
    "moe_pad_expert_input_to_capacity": True,
}
MOE_VARIANTS: dict[str, dict[str, Any]] = {
    "plain_a": {},
    "plain_b": {},
    "fgo_eager": {"offload": True},
    "fgo_graph_4": {"offload": True, "graphs": True, "inflight": 4},
    "graph_only": {"graphs": True},
}


def _section(
    offload: bool = False,
    graphs: bool = False,
    inflight: int | None = None,
    model: str = MODEL,
    modules: list[str] = MODULES,
    overrides: dict[str, Any] | None = None,
) -> dict:
    megatron_cfg: dict[str, Any] = {
        "enabled": True,
        "fine_grained_activation_offloading": offload,
        "offload_modules": modules if offload else None,
        "fine_grained_offloading_max_inflight_offloads": inflight,
        "cuda_graph_impl": "full_iteration" if graphs else "none",
        "cuda_graph_warmup_steps": WARMUP,
        "model_overrides": {"deterministic_mode": True, **(overrides or {})},
        "optimizer": {
            "optimizer": "adam",
            "lr": 1e-5,
            "min_lr": 1e-5,
            "clip_grad": 0.0,
            "use_distributed_optimizer": False,
        },
    }
    return {
        "model_name": model,
        "precision": "bfloat16",
        "max_total_sequence_length": MAX_LENGTH,
        "megatron_cfg": megatron_cfg,
    }


def _check_recipe_section(section: dict) -> None:
    """The section passes the offload rules (the worker gets only what validate accepts)."""
    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.offload.capabilities import detect
    from nemo_rl_offload.preflight import check_policy

    findings = check_policy(
        section,
        where="policy",
        architecture=architecture_for(section["model_name"]),
        caps=detect(),
        gpus_per_node=1,
    )
    assert findings.errors == [], findings.errors


def _schedule(steps: int) -> list[tuple[int, int]]:
    shapes = [(count, length) for count in COUNTS for length in LENGTHS]
    order = (shapes * (steps // len(shapes) + 1))[:steps]
    np.random.default_rng(5).shuffle(order)
    return order


def _batches(algorithm: str, vocab: int) -> list[list[dict[str, np.ndarray]]]:
    """Every step's micro-batches, already padded to their bucket (so that the plain runs,
    which pad nothing, compute on exactly the same inputs)."""
    from nemo_rl_offload.config.batching_settings import sequence_length_buckets
    from nemo_rl_offload.offload.runtime import bucket_for, pad_microbatches

    rng = np.random.default_rng(17)
    steps = []
    for count, length in _schedule(STEPS):
        batch = []
        for index in range(count):
            n = length - 9 * index
            ids = rng.integers(0, vocab, (ROWS, n))
            mask = np.ones((ROWS, n), np.float32)
            mask[:, : n // 4] = 0.0
            mb = {"input_ids": ids, "labels": ids, "loss_mask": mask}
            if algorithm == "grpo":
                mb["advantages"] = rng.standard_normal(ROWS).astype(np.float32)
            batch.append(mb)
        bucket = bucket_for(length, sequence_length_buckets(MAX_LENGTH))
        steps.append(pad_microbatches(batch, bucket))
    return steps


def _run(
    algorithm: str, variant: dict[str, Any], steps: list[list[dict]], **model: Any
) -> list[dict[str, float]]:
    """One run of the steps on a fresh policy: ``variant`` and ``model`` are ``_section``'s
    arguments (``model``: its model, modules and overrides; the dense preset's without). The
    last record also counts the offload groups of the run's plans that allocate fresh pinned
    tensors instead of pooled ones (``unpooled_offload_groups``)."""
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    section = _section(**variant, **model)
    _check_recipe_section(section)
    worker = PolicyWorker(
        settings=resolve_policy(section),
        rank=0,
        world_size=1,
        seed=1234,
        on_gpu=True,
        with_reference=algorithm == "grpo",
    )
    worker.setup(*worker.node_address())
    records = []
    try:
        for batch in steps:
            loss: dict[str, Any] = {"name": "nll"}
            if algorithm == "grpo":
                old = worker.token_logprobs(batch)
                reference = worker.token_logprobs(batch, reference=True)
                batch = [
                    {**mb, "old_logprobs": o, "reference_logprobs": r}
                    for mb, o, r in zip(batch, old, reference, strict=True)
                ]
                loss = GRPO_LOSS
            metrics = worker.train(batch, loss)
            records.append(
                {
                    key: metrics[key]
                    for key in sorted(metrics)
                    if key.startswith(
                        ("loss", "num_tokens", "peak", "step_time", "fwd_bwd", "cuda_graph")
                    )
                    or key.startswith("offload")
                    or key in ("pinned_host_gib", "grad_norm")
                }
            )
        groups = [
            group
            for plan in worker.runtime._plans.values()
            for chunk in plan._cached_chunks_forward
            for group in chunk.offload_groups
        ]
        records[-1]["unpooled_offload_groups"] = float(sum(not g.use_cpu_pool for g in groups))
    finally:
        worker.close()
        torch.cuda.empty_cache()
    return records


def _median(records: list[dict], key: str, only: list[int]) -> float:
    return statistics.median(records[i][key] for i in only)


def _summary(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per run: medians over the steps every graphed run replays (after each shape's warm-up
    and capture), so that eager and graphed runs are compared on the same steps."""
    replayed = [
        i
        for i in range(STEPS)
        if all(runs[v][i].get("cuda_graph_replayed") == 1.0 for v in runs if "graph" in v)
        and not any(runs[v][i].get("cuda_graph_captured") for v in runs if "graph" in v)
    ]
    plain = runs["plain_a"]
    summary: dict[str, Any] = {"replayed_steps_compared": len(replayed)}
    for variant, records in runs.items():
        row = {
            "max_abs_loss_diff_vs_fgo_eager": max(
                abs(r["loss"] - e["loss"]) for r, e in zip(records, runs["fgo_eager"], strict=True)
            ),
            "median_activation_peak_gib": _median(
                records, "peak_activation_gpu_memory_gib", replayed
            ),
            "max_reserved_gib": max(r["peak_reserved_gpu_memory_gib"] for r in records),
            "median_step_time_s": _median(records, "step_time_s", replayed),
            "median_fwd_bwd_time_s": _median(records, "fwd_bwd_time_s", replayed),
        }
        for key in ("median_activation_peak_gib", "median_step_time_s", "median_fwd_bwd_time_s"):
            base = key.replace("median_", "")
            plain_value = _median(
                plain,
                {
                    "activation_peak_gib": "peak_activation_gpu_memory_gib",
                    "step_time_s": "step_time_s",
                    "fwd_bwd_time_s": "fwd_bwd_time_s",
                }[base],
                replayed,
            )
            row[f"{base}_vs_plain"] = row[key] / plain_value - 1
        summary[variant] = row
    summary["plain_spread"] = max(
        abs(a["loss"] - b["loss"]) for a, b in zip(runs["plain_a"], runs["plain_b"], strict=True)
    )
    return summary


def _write(name: str, runs: dict[str, list[dict]], summary: dict[str, Any], **setup: Any) -> None:
    """Every run's records and the summary to $NEMO_RL_OFFLOAD_RESULTS/<name>.json."""
    shapes = [list(s) for s in _schedule(STEPS)]
    write_results(
        name,
        {**setup, "steps": STEPS, "shapes": shapes, "warmup_steps": WARMUP}
        | {"summary": summary, "runs": runs},
    )


def _assert_each_shape_captured_once_then_replayed(records: list[dict]) -> None:
    """Each shape: WARMUP eager steps, one capture, then replays only."""
    shapes = len(set(_schedule(STEPS)))
    assert sum(r["cuda_graph_captured"] for r in records) == shapes
    assert sum(r["cuda_graph_replayed"] for r in records) == STEPS - WARMUP * shapes
    assert records[-1]["cuda_graphs_kept"] == shapes


@pytest.fixture(scope="module")
def vocab() -> int:
    from nemo_rl_offload.config.model_presets import architecture_for

    return architecture_for(MODEL).vocab_size


@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_graphed_offloading_matches_eager_and_replays(algorithm, vocab):
    steps = _batches(algorithm, vocab)
    runs = {name: _run(algorithm, variant, steps) for name, variant in VARIANTS.items()}
    summary = _summary(runs)
    _write(f"cuda_graphs_{algorithm}", runs, summary, model=MODEL, offload_modules=MODULES)
    for variant, records in runs.items():
        assert len(records) == STEPS, variant
        if "graph" not in variant:
            assert not any(r.get("cuda_graph_replayed") for r in records), variant
            continue
        _assert_each_shape_captured_once_then_replayed(records)
    spread = summary["plain_spread"]
    for variant in ("fgo_graph_0", "fgo_graph_1", "fgo_graph_2"):
        assert summary[variant]["max_abs_loss_diff_vs_fgo_eager"] <= spread, summary
        assert all(r["offloaded_gib_per_step"] > 0 for r in runs[variant])
        # Offloading still cuts the activation peak when the step is a graph.
        assert (
            summary[variant]["median_activation_peak_gib"]
            < summary["graph_only"]["median_activation_peak_gib"]
        ), summary
    assert summary["graph_only"]["max_abs_loss_diff_vs_fgo_eager"] <= spread, summary


def test_graphed_moe_with_drop_and_pad_matches_eager_and_replays(vocab):
    """A MoE model with drop-and-pad dispatch under full-iteration graphs, its attention pair
    and both expert modules offloaded (the expert groups then pinned from the pool): every step
    after a shape's warm-up replays, the losses equal eager offloading's, and every module
    still moves its bytes and the activation peak stays below the graphs alone."""
    from nemo_rl_offload.config.model_presets import architecture_for

    assert architecture_for(MOE_MODEL).vocab_size == vocab  # the same batches fit
    steps = _batches("sft", vocab)
    model = {"model": MOE_MODEL, "modules": MOE_MODULES, "overrides": DROP_AND_PAD}
    runs = {name: _run("sft", variant, steps, **model) for name, variant in MOE_VARIANTS.items()}
    summary = _summary(runs)
    _write(
        "cuda_graphs_moe_drop_and_pad",
        runs,
        summary,
        model=MOE_MODEL,
        model_overrides=DROP_AND_PAD,
        offload_modules=MOE_MODULES,
    )
    graphed = runs["fgo_graph_4"]
    _assert_each_shape_captured_once_then_replayed(graphed)
    spread = summary["plain_spread"]
    for variant in ("fgo_graph_4", "graph_only"):
        assert summary[variant]["max_abs_loss_diff_vs_fgo_eager"] <= spread, summary
    for name in MOE_MODULES:
        assert all(r.get(f"offloaded_gib_{name}", 0) > 0 for r in graphed), name
    # Every group of every plan, the expert groups included, takes pooled pinned buffers.
    for variant in ("fgo_eager", "fgo_graph_4"):
        assert runs[variant][-1]["unpooled_offload_groups"] == 0, variant
    assert (
        summary["fgo_graph_4"]["median_activation_peak_gib"]
        < summary["graph_only"]["median_activation_peak_gib"]
    ), summary
