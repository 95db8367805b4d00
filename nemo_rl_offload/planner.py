"""``nemo-rl-offload plan``: pick the offload settings that fit a peak-memory budget fastest.

How (each step runs the recipe's own workers through :mod:`nemo_rl_offload.telemetry`):

1. Profile: a few steps without offloading (peak ``P0``), and a few with every offloadable
   module of the model offloaded, whose telemetry gives the bytes each module moves per
   micro-batch (``s_m``).
2. Predict each candidate's peak: ``P0 - sum(s_m) x fraction`` for a module set. Without
   pipeline parallelism one micro-batch's activations are live at a time, so the saving is one
   micro-batch's offloaded bytes: on an H100 this predicted every measured offload case of
   benchmarks/results within 1.3% (tests/unit/test_planner.py checks it on those tables).
3. Time cannot be predicted from bytes today (the measured cost of a module set is mostly not
   bandwidth: benchmarks/results/README.md), but it grows with the number of modules hooked, so
   the candidates predicted to fit are ranked by module count, then bytes moved, and the first
   ``max_trials`` of different module counts are measured. The fastest one whose measured
   peak fits wins; the override lines to paste are printed.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from nemo_rl_offload.errors import UserInputError

DENSE_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
EXPERT_MODULES = ("expert_fc1", "moe_act")
FRACTIONS = (1.0, 0.5)
SAFETY_MARGIN = 0.02  # a candidate must be predicted this far under the budget to be tried
MCFG = "policy.megatron_cfg"


@dataclass(frozen=True)
class Profile:
    """What the two profiling runs measured (GiB, seconds)."""

    peak_gib: float
    fwd_bwd_s: float
    bytes_per_microbatch_gib: dict[str, float]


@dataclass
class Candidate:
    modules: tuple[str, ...]
    fraction: float
    predicted_peak_gib: float
    measured_peak_gib: float | None = None
    measured_fwd_bwd_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        suffix = "" if self.fraction == 1.0 else f" x{self.fraction:g}"
        return "+".join(self.modules) + suffix

    def overrides(self) -> list[str]:
        lines = [
            f"{MCFG}.fine_grained_activation_offloading=true",
            f"'{MCFG}.offload_modules=[{','.join(self.modules)}]'",
        ]
        if self.fraction != 1.0:
            lines.append(f"{MCFG}.activation_offload_fraction={self.fraction:g}")
        return lines


def offloadable_modules(is_moe: bool) -> tuple[str, ...]:
    return DENSE_MODULES + (EXPERT_MODULES if is_moe else ())


def module_sets(modules: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every non-empty subset the offload rules allow (attn_proj only with core_attn)."""
    sets = []
    for size in range(1, len(modules) + 1):
        for subset in itertools.combinations(modules, size):
            if "attn_proj" in subset and "core_attn" not in subset:
                continue
            sets.append(subset)
    return sets


def predict_peak(profile: Profile, modules: tuple[str, ...], fraction: float) -> float:
    saved = sum(profile.bytes_per_microbatch_gib.get(m, 0.0) for m in modules)
    return profile.peak_gib - fraction * saved


def candidates_within(profile: Profile, budget_gib: float, is_moe: bool) -> list[Candidate]:
    """The candidates predicted to fit ``budget_gib`` (with the safety margin), cheapest first:
    fewer modules hooked, then fewer bytes moved."""
    fitting = []
    for modules in module_sets(offloadable_modules(is_moe)):
        for fraction in FRACTIONS:
            peak = predict_peak(profile, modules, fraction)
            if peak <= budget_gib * (1 - SAFETY_MARGIN):
                fitting.append(Candidate(modules, fraction, peak))
    moved = {c.name: profile.peak_gib - c.predicted_peak_gib for c in fitting}
    return sorted(fitting, key=lambda c: (len(c.modules), moved[c.name], -c.fraction))


def trials(ranked: list[Candidate], max_trials: int) -> list[Candidate]:
    """The first candidate of each module count, in rank order, up to ``max_trials``."""
    chosen: list[Candidate] = []
    seen_counts: set[int] = set()
    for candidate in ranked:
        if len(candidate.modules) not in seen_counts:
            chosen.append(candidate)
            seen_counts.add(len(candidate.modules))
        if len(chosen) == max_trials:
            break
    return chosen


def best(measured: list[Candidate], budget_gib: float) -> Candidate | None:
    fitting = [
        c
        for c in measured
        if c.measured_peak_gib is not None
        and c.measured_fwd_bwd_s is not None
        and c.measured_peak_gib <= budget_gib
    ]
    return min(fitting, key=lambda c: c.measured_fwd_bwd_s or 0.0) if fitting else None


def _replayed_median(records: list[dict[str, Any]], key: str) -> float:
    from nemo_rl_offload.telemetry import replayed_median

    return replayed_median(records, key) or 0.0


def _measure(config: str, overrides: list[str], steps: int, err: TextIO) -> list[dict]:
    from nemo_rl_offload.telemetry import measure

    return measure(config, overrides, steps=steps, err=err)["records"]


def plan(
    config: str,
    overrides: list[str],
    *,
    budget_gib: float,
    steps: int = 3,
    max_trials: int = 3,
    err: TextIO = sys.stderr,
) -> dict[str, Any]:
    """Profile, predict, measure the most promising candidates; returns everything found."""
    from pathlib import Path

    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.preflight import load_and_check

    if budget_gib <= 0:
        raise UserInputError(f"--budget-gib: must be > 0 (got: {budget_gib})")
    report = load_and_check(config, overrides)
    if report.errors:
        raise UserInputError(report.errors)
    recipe = report.recipe
    if int(recipe["cluster"].get("gpus_per_node", 0)) <= 0:
        raise UserInputError(
            "cluster.gpus_per_node: 0; the planner measures GPU memory, so it needs GPU workers"
        )
    is_moe = bool(
        architecture_for(recipe["policy"]["model_name"], base_dir=Path.cwd()).num_moe_experts
    )
    everything = offloadable_modules(is_moe)
    moe_layout = [f"++{MCFG}.model_overrides.moe_grouped_gemm=true"] if is_moe else []
    print("plan: profiling without offloading ...", file=err)
    base = _measure(
        config, [*overrides, f"{MCFG}.fine_grained_activation_offloading=false"], steps, err
    )
    print(f"plan: profiling with every module offloaded ({', '.join(everything)}) ...", file=err)
    full = _measure(
        config,
        [*overrides, *moe_layout, *Candidate(everything, 1.0, 0.0).overrides()],
        steps,
        err,
    )
    microbatches = max(1.0, _replayed_median(full, "offload_step_microbatches"))
    profile = Profile(
        peak_gib=_replayed_median(base, "peak_fwd_bwd_gpu_memory_gib"),
        fwd_bwd_s=_replayed_median(base, "fwd_bwd_time_s"),
        bytes_per_microbatch_gib={
            m: _replayed_median(full, f"offloaded_gib_{m}") / microbatches for m in everything
        },
    )
    if profile.peak_gib <= 0:
        raise UserInputError("the workers report no GPU memory; run the planner on GPU workers")
    ranked = candidates_within(profile, budget_gib, is_moe)
    tried = trials(ranked, max_trials)
    for candidate in tried:
        print(f"plan: measuring {candidate.name} ...", file=err)
        records = _measure(config, [*overrides, *moe_layout, *candidate.overrides()], steps, err)
        candidate.measured_peak_gib = _replayed_median(records, "peak_fwd_bwd_gpu_memory_gib")
        candidate.measured_fwd_bwd_s = _replayed_median(records, "fwd_bwd_time_s")
    return {
        "budget_gib": budget_gib,
        "profile": profile,
        "fitting": len(ranked),
        "tried": tried,
        "chosen": best(tried, budget_gib),
        "moe_layout": moe_layout,
    }


def format_plan(result: dict[str, Any], out: TextIO) -> bool:
    """Print the plan; returns whether one meets the budget."""
    profile: Profile = result["profile"]
    budget = result["budget_gib"]
    print(
        f"no offload: peak {profile.peak_gib:.2f} GiB, forward-backward {profile.fwd_bwd_s:.3f} s; "
        f"budget {budget:.2f} GiB ({100 * budget / profile.peak_gib:.0f}% of the peak)",
        file=out,
    )
    saved = ", ".join(f"{m} {g:.2f}" for m, g in profile.bytes_per_microbatch_gib.items())
    print(f"offloadable per micro-batch (GiB): {saved}", file=out)
    print(f"candidates predicted to fit: {result['fitting']}; measured:", file=out)
    for c in result["tried"]:
        change = (c.measured_fwd_bwd_s or 0.0) / profile.fwd_bwd_s - 1 if profile.fwd_bwd_s else 0
        print(
            f"  {c.name:<48} predicted {c.predicted_peak_gib:6.2f} GiB  measured "
            f"{c.measured_peak_gib or 0:6.2f} GiB  {c.measured_fwd_bwd_s or 0:.3f} s "
            f"({100 * change:+.1f}%)",
            file=out,
        )
    chosen: Candidate | None = result["chosen"]
    if chosen is None:
        print(
            "no offload plan meets the budget: raise it, add full recompute "
            f"({MCFG}.activation_checkpointing=true), or use more GPUs",
            file=out,
        )
        return False
    print(f"plan: {chosen.name}; paste these overrides:", file=out)
    for line in [*result["moe_layout"], *chosen.overrides()]:
        print(f"  {line}", file=out)
    return True
