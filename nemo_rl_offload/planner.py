"""``nemo-rl-offload plan``: pick the activation-memory settings that fit a peak budget fastest.

How (each measurement runs the recipe's own workers through :mod:`nemo_rl_offload.telemetry`):

1. Profile, once for every budget asked: a few steps without offloading (peak ``P0``, and the
   resident state ``R``: weights, gradients and optimizer state, which no activation setting
   changes); a few with every offloadable module offloaded, whose telemetry gives the bytes each
   module moves per micro-batch (``s_m``); and a few with full recompute (its peak and time).
2. Predict each offload set's peak: ``P0 - sum(s_m) x fraction``. Without pipeline parallelism
   one micro-batch's activations are live at a time, so the saving is one micro-batch's
   offloaded bytes: this predicted every measured offload case of the benchmark tables within
   ``PREDICTION_TOLERANCE`` (benchmarks/results/README.md, the benchmark section;
   tests/unit/test_planner.py checks it on those tables).
3. Time is not predicted from bytes: eagerly, most of an offload set's cost is the CPU work of
   its hooks, which grows with the number of modules hooked (benchmarks/results/README.md,
   the step profile). So the offload sets predicted to fit are ranked by module count, then
   bytes moved (sets predicted up to ``PREDICTION_TOLERANCE`` over a budget are included:
   predictions were that close), and the first ``max_trials`` of different module counts are
   measured. Among the measured offload sets, the recipe without offloading and full
   recompute, the fastest whose measured peak fits wins. The result is a settings patch (a
   nested dict of recipe keys); the ``plan`` command prints it as override lines to paste, and
   a job that plans at start applies it to its loaded recipe
   (:mod:`nemo_rl_offload.plan_at_start`). Measurements are shared between budgets.
   One measurement is not enough to rank close plans: the same offload set measured in fresh
   processes spreads by more than close plans differ, and a planner that trusted one
   measurement chose a slower set than the fastest fitting one
   (benchmarks/results/2026-11-22_h100_plan_once_llama-1b_seq8192.txt against
   ..._plan_recheck_...). So every fitting plan within ``RECHECK_MARGIN`` of the fastest is
   measured once more, and keeps its fastest time (noise only adds time) and its highest peak.
4. A budget under ``R`` cannot be met by any activation setting: the plan says so, with ``R``.

A recipe with full-iteration CUDA graphs is measured graphed: each measurement runs the
shape's warm-up and capture steps first, so that its medians are over replays (graphs take the
hooks' CPU work away, which changes which set is fastest), and offloading there gets the
max-inflight cap it needs (the recipe's own, else ``GRAPH_INFLIGHT``, the fastest on the 1B
step: benchmarks/results/2026-11-22_h100_benchmark_graphs_inflight_llama-1b_seq4096.md).
"""

from __future__ import annotations

import itertools
import shlex
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from nemo_rl_offload.config.loader import deep_merge
from nemo_rl_offload.errors import UserInputError

# A settings patch: recipe keys nested as in the recipe, merged onto a loaded recipe.
Patch = dict[str, Any]

DENSE_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
EXPERT_MODULES = ("expert_fc1", "moe_act")
FRACTIONS = (1.0, 0.5)
# How close peak predictions came to the measured peaks, both ways (benchmarks/results/README.md):
# a set predicted up to this much over the budget may still fit, and is tried; only its measured
# peak decides.
PREDICTION_TOLERANCE = 0.02
MCFG = "policy.megatron_cfg"
GRAPH_INFLIGHT = 4  # max inflight offloads for graphed measurements when the recipe sets none
# Fitting plans measured within this of the fastest fitting one are measured again: one offload
# set's time spreads about this much between fresh processes
# (benchmarks/results/2026-11-22_h100_plan_once_llama-1b_seq8192.txt).
RECHECK_MARGIN = 0.20


@dataclass(frozen=True)
class Profile:
    """What the profiling runs measured (GiB, seconds). ``resident_gib``: the part of the peak
    that is not activations (weights, gradients, optimizer state)."""

    peak_gib: float
    fwd_bwd_s: float
    bytes_per_microbatch_gib: dict[str, float]
    resident_gib: float = 0.0


@dataclass
class Candidate:
    modules: tuple[str, ...]
    fraction: float
    predicted_peak_gib: float | None  # None: measured in the profile, not predicted
    measured_peak_gib: float | None = None
    measured_fwd_bwd_s: float | None = None
    full_recompute: bool = False  # recompute whole layers instead of offloading
    measurements: int = 1  # more than 1: a close contender, measured again (see remeasured)
    # Why its measurement failed (failures.Failure.as_dict(): type, message, out-of-memory
    # sizes); a failed candidate has no measured peak or time, so no budget picks it.
    failure: dict[str, Any] | None = None

    @property
    def failed(self) -> str | None:
        """The failure as one line, or None."""
        from nemo_rl_offload.failures import Failure

        return Failure.from_dict(self.failure).summary() if self.failure else None

    @property
    def name(self) -> str:
        if self.full_recompute:
            return "full recompute"
        if not self.modules:
            return "no offload"
        suffix = "" if self.fraction == 1.0 else f" x{self.fraction:g}"
        return "+".join(self.modules) + suffix

    def patch(self) -> Patch:
        """The candidate's settings as a patch of the policy's megatron_cfg."""
        if self.full_recompute:
            settings: dict[str, Any] = {
                "fine_grained_activation_offloading": False,
                "activation_checkpointing": True,
                "recompute_granularity": "full",
            }
        elif not self.modules:
            settings = {"fine_grained_activation_offloading": False}
        else:
            settings = {
                "fine_grained_activation_offloading": True,
                "offload_modules": list(self.modules),
            }
            if self.fraction != 1.0:
                settings["activation_offload_fraction"] = self.fraction
        return megatron_patch(settings)


def megatron_patch(settings: dict[str, Any]) -> Patch:
    """``settings`` placed under ``policy.megatron_cfg`` (no settings: an empty patch)."""
    return {"policy": {"megatron_cfg": settings}} if settings else {}


def _leaves(patch: Patch, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for key, value in patch.items():
        if isinstance(value, dict):
            out += _leaves(value, (*prefix, key))  # an empty mapping changes nothing
        else:
            out.append(((*prefix, key), value))
    return out


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    return str(value)


def render_overrides(patch: Patch, recipe: dict[str, Any]) -> list[str]:
    """The patch as Hydra-grammar override lines for ``recipe`` (the loaded recipe it applies
    to): a key the recipe has is set (``key=value``), one it lacks is added (``++key=value``),
    so that every line applies as written."""
    lines = []
    for path, value in _leaves(patch):
        node: Any = recipe
        for key in path:
            node = node.get(key, _MISSING) if isinstance(node, dict) else _MISSING
        prefix = "++" if node is _MISSING else ""
        lines.append(f"{prefix}{'.'.join(path)}={_value_text(value)}")
    return lines


_MISSING = object()


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
    """The candidates predicted to fit ``budget_gib`` (within the prediction tolerance):
    first those predicted under the budget, then those within the tolerance over it; in each,
    cheapest first: fewer modules hooked, then fewer bytes moved."""
    fitting = []
    for modules in module_sets(offloadable_modules(is_moe)):
        for fraction in FRACTIONS:
            peak = predict_peak(profile, modules, fraction)
            if peak <= budget_gib * (1 + PREDICTION_TOLERANCE):
                fitting.append(Candidate(modules, fraction, peak))
    # Fewer bytes moved: a higher predicted peak.
    return sorted(
        fitting,
        key=lambda c: (c.predicted_peak_gib > budget_gib, len(c.modules), -c.predicted_peak_gib),
    )


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


def _fitting(measured: list[Candidate], budget_gib: float) -> list[Candidate]:
    return [
        c
        for c in measured
        if c.measured_peak_gib is not None
        and c.measured_fwd_bwd_s is not None
        and c.measured_peak_gib <= budget_gib
    ]


def best(measured: list[Candidate], budget_gib: float) -> Candidate | None:
    fitting = _fitting(measured, budget_gib)
    return min(fitting, key=lambda c: c.measured_fwd_bwd_s or 0.0) if fitting else None


def contenders(measured: list[Candidate], budget_gib: float) -> list[Candidate]:
    """The fitting plans measured within ``RECHECK_MARGIN`` of the fastest fitting one, when
    there is more than one (a lone plan has nothing to be ranked against)."""
    fitting = _fitting(measured, budget_gib)
    if len(fitting) < 2:
        return []
    limit = min(c.measured_fwd_bwd_s or 0.0 for c in fitting) * (1 + RECHECK_MARGIN)
    close = [c for c in fitting if (c.measured_fwd_bwd_s or 0.0) <= limit]
    return close if len(close) > 1 else []


def remeasured(candidate: Candidate, records: list[dict[str, Any]]) -> None:
    """Fold a second measurement in: the fastest time (noise only adds time) and the highest
    peak (the budget must hold in both)."""
    peak, seconds = _measured(records)
    candidate.measured_peak_gib = max(candidate.measured_peak_gib or 0.0, peak)
    candidate.measured_fwd_bwd_s = min(candidate.measured_fwd_bwd_s or seconds, seconds)
    candidate.measurements += 1


def _replayed_median(records: list[dict[str, Any]], key: str) -> float:
    from nemo_rl_offload.telemetry import replayed_median

    return replayed_median(records, key) or 0.0


def _measure(config: str, overrides: list[str], steps: int, err: TextIO) -> list[dict]:
    from nemo_rl_offload.telemetry import measure

    return measure(config, overrides, steps=steps, err=err)["records"]


class ProfileFailed(RuntimeError):
    """A profiling measurement failed, so nothing can be planned; the message says which and
    why (out of memory with its sizes, or the exception)."""


def measure_candidate(
    candidate: Candidate,
    measure: Any,
) -> list[dict[str, Any]] | None:
    """``measure()``'s records, or None with ``candidate.failure`` set when the workers
    failed: a plan that does not fit, or a bug, is a result of the trial, not the end of the
    plan."""
    from nemo_rl_offload.distributed.worker_group import WorkerError
    from nemo_rl_offload.failures import from_exception

    try:
        return measure()
    except WorkerError as exc:
        candidate.failure = from_exception(exc).as_dict()
        return None


def _profile(what: str, measure: Any) -> list[dict[str, Any]]:
    """A profiling measurement; its failure ends the plan with :class:`ProfileFailed`."""
    probe = Candidate((), 1.0, None)
    records = measure_candidate(probe, measure)
    if records is None:
        raise ProfileFailed(f"plan: profiling {what} failed: {probe.failed}")
    return records


def _measured(records: list[dict[str, Any]]) -> tuple[float, float]:
    """(peak GiB, forward-backward s) of a measurement: medians of the replayed steps."""
    return (
        _replayed_median(records, "peak_fwd_bwd_gpu_memory_gib"),
        _replayed_median(records, "fwd_bwd_time_s"),
    )


def plan(
    config: str,
    overrides: list[str],
    *,
    budgets_gib: list[float] | None = None,
    budget_fractions: list[float] | None = None,
    steps: int = 3,
    max_trials: int = 3,
    err: TextIO = sys.stderr,
) -> dict[str, Any]:
    """Profile once, then for every budget (GiB, or fractions of the measured no-offload peak)
    measure the most promising candidates that fit; returns everything found."""
    from pathlib import Path

    from nemo_rl_offload.config.loader import load_recipe
    from nemo_rl_offload.config.model_presets import section_architecture
    from nemo_rl_offload.offload.apply import effective_settings
    from nemo_rl_offload.preflight import check_recipe

    budgets_gib, budget_fractions = list(budgets_gib or []), list(budget_fractions or [])
    if not budgets_gib and not budget_fractions:
        raise UserInputError("plan: give --budget-gib or --budget-fraction")
    if any(b <= 0 for b in budgets_gib):
        raise UserInputError(f"--budget-gib: must be > 0 (got: {budgets_gib})")
    if any(not 0 < f <= 1 for f in budget_fractions):
        raise UserInputError(f"--budget-fraction: must be in (0, 1] (got: {budget_fractions})")
    loaded = load_recipe(config, overrides)
    report = check_recipe(loaded, base_dir=Path.cwd())
    if report.errors:
        raise UserInputError(report.errors)
    recipe = report.recipe
    # A DTensor section reads activation checkpointing from dtensor_cfg (config/dtensor_recipes).
    dtensor = "policy" in report.dtensor_sections
    if int(recipe["cluster"].get("gpus_per_node", 0)) <= 0:
        raise UserInputError(
            "cluster.gpus_per_node: 0; the planner measures GPU memory, so it needs GPU workers"
        )
    # Whether the model has experts, as the offload rules and the workers decide it: from the
    # effective settings (the model's num_moe_experts, or model_overrides').
    architecture = section_architecture(recipe["policy"], base_dir=Path.cwd())
    is_moe = effective_settings(
        recipe["policy"], architecture, te_installed=report.caps.has_transformer_engine
    ).is_moe
    everything = offloadable_modules(is_moe)
    # Expert offload needs the grouped expert layout; every measurement (and so every plan)
    # runs on it, so that the profile and the candidates are the same model. Graphed
    # offloading needs the max-inflight cap, and more steps to reach the replays.
    measured_with = megatron_patch(
        {"model_overrides": {"moe_grouped_gemm": True}} if is_moe else {}
    )
    graph_patch, graph_steps = graph_settings(recipe["policy"]["megatron_cfg"])
    measured_with = deep_merge(measured_with, graph_patch)
    steps += graph_steps

    def lines(patch: Patch) -> list[str]:
        """The overrides a measurement runs with: the user's, then the patch's."""
        return [*overrides, *render_overrides(with_layout(measured_with, patch, dtensor), loaded)]

    print("plan: profiling without offloading ...", file=err)
    no_offload = lines(megatron_patch({"fine_grained_activation_offloading": False}))
    base = _profile("without offloading", lambda: _measure(config, no_offload, steps, err))
    print(f"plan: profiling with every module offloaded ({', '.join(everything)}) ...", file=err)
    every = lines(Candidate(everything, 1.0, None).patch())
    full = _profile("with every module offloaded", lambda: _measure(config, every, steps, err))
    microbatches = max(1.0, _replayed_median(full, "offload_step_microbatches"))
    peak, fwd_bwd = _measured(base)
    profile = Profile(
        peak_gib=peak,
        fwd_bwd_s=fwd_bwd,
        bytes_per_microbatch_gib={
            m: _replayed_median(full, f"offloaded_gib_{m}") / microbatches for m in everything
        },
        resident_gib=peak - _replayed_median(base, "peak_activation_gpu_memory_gib"),
    )
    if profile.peak_gib <= 0:
        raise UserInputError("the workers report no GPU memory; run the planner on GPU workers")
    print("plan: profiling full recompute ...", file=err)
    recompute = Candidate((), 1.0, None, full_recompute=True)
    records = measure_candidate(
        recompute, lambda: _measure(config, lines(recompute.patch()), steps, err)
    )
    if records is not None:
        recompute.measured_peak_gib, recompute.measured_fwd_bwd_s = _measured(records)
    # The recipe without offloading is a plan too: when it fits, nothing needs changing.
    plain = Candidate((), 1.0, None, profile.peak_gib, profile.fwd_bwd_s)
    measured: dict[str, Candidate] = {recompute.name: recompute}
    rechecked: set[str] = set()
    budgets = [*budgets_gib, *(f * profile.peak_gib for f in budget_fractions)]
    plans = []
    for budget in budgets:
        ranked = candidates_within(profile, budget, is_moe)
        tried = []
        for candidate in trials(ranked, max_trials):
            if candidate.name not in measured:
                print(f"plan: measuring {candidate.name} ...", file=err)
                records = measure_candidate(
                    candidate,
                    lambda c=candidate: _measure(config, lines(c.patch()), steps, err),
                )
                if records is not None:
                    candidate.measured_peak_gib, candidate.measured_fwd_bwd_s = _measured(records)
                measured[candidate.name] = candidate
            tried.append(measured[candidate.name])
        options = [plain, *tried, recompute]
        for candidate in contenders(options, budget):
            # The recipe without offloading is the profile itself: it fits only when no
            # plan is needed, and then nothing is faster.
            if candidate is plain or candidate.name in rechecked:
                continue
            print(f"plan: measuring {candidate.name} again (a close contender) ...", file=err)
            again = Candidate(candidate.modules, candidate.fraction, None)
            records = measure_candidate(
                again, lambda c=candidate: _measure(config, lines(c.patch()), steps, err)
            )
            if records is None:  # it fit once and failed now: it cannot be relied on
                candidate.failure = again.failure
                candidate.measured_peak_gib = candidate.measured_fwd_bwd_s = None
            else:
                remeasured(candidate, records)
            rechecked.add(candidate.name)
        plans.append(
            {
                "budget_gib": budget,
                "fitting": len(ranked),
                "tried": options,
                "chosen": best(options, budget),
            }
        )
    return {
        "profile": profile,
        "plans": plans,
        "measured_with": measured_with,
        "dtensor": dtensor,
        "recipe": loaded,
    }


def graph_settings(megatron_cfg: dict[str, Any]) -> tuple[Patch, int]:
    """For a recipe with full-iteration CUDA graphs: the settings every measurement needs (the
    max-inflight cap offloading requires there, when the recipe sets none) and the steps each
    shape spends before its first replay (warm-up and capture). Else nothing."""
    if megatron_cfg.get("cuda_graph_impl") != "full_iteration":
        return {}, 0
    settings = {}
    if megatron_cfg.get("fine_grained_offloading_max_inflight_offloads") is None:
        settings["fine_grained_offloading_max_inflight_offloads"] = GRAPH_INFLIGHT
    return megatron_patch(settings), int(megatron_cfg.get("cuda_graph_warmup_steps", 3)) + 1


def with_layout(measured_with: Patch, patch: Patch, dtensor: bool) -> Patch:
    """A candidate's patch on top of what every measurement ran with (the expert layout, graph
    settings), placed where the recipe reads it (:func:`retarget`)."""
    return retarget(deep_merge(measured_with, patch), dtensor)


def plan_patch(result: dict[str, Any], chosen: Candidate) -> Patch:
    """The settings patch of a chosen plan: what every measurement ran with, then the plan's
    own settings."""
    return with_layout(result["measured_with"], chosen.patch(), result.get("dtensor", False))


def plan_overrides(result: dict[str, Any], chosen: Candidate) -> list[str]:
    """:func:`plan_patch` as override lines to paste after the recipe's own overrides."""
    return render_overrides(plan_patch(result, chosen), result.get("recipe") or {})


def retarget(patch: Patch, dtensor: bool) -> Patch:
    """The planner's patch for a policy that selects DTensor: its activation checkpointing is
    dtensor_cfg's (full recompute once on), as the mapping reads it; the rest stay."""
    megatron = dict((patch.get("policy") or {}).get("megatron_cfg") or {})
    if not dtensor or "activation_checkpointing" not in megatron:
        return patch
    switch = megatron.pop("activation_checkpointing")
    megatron.pop("recompute_granularity", None)  # dtensor_cfg's switch means full recompute
    policy = {**patch["policy"], "megatron_cfg": megatron}
    policy["dtensor_cfg"] = {
        **(policy.get("dtensor_cfg") or {}),
        "activation_checkpointing": switch,
    }
    return {**patch, "policy": policy}


def why_none(profile: Profile, budget: float, tried: list[Candidate]) -> str:
    if profile.resident_gib >= budget:
        return (
            f"no activation setting can meet {budget:.2f} GiB: weights, gradients and optimizer "
            f"state alone hold {profile.resident_gib:.2f} GiB; use the distributed optimizer, "
            f"{MCFG}.optimizer.optimizer_cpu_offload, or more GPUs"
        )
    lowest = min(
        (c for c in tried if c.measured_peak_gib is not None),
        key=lambda c: c.measured_peak_gib or 0.0,
        default=None,
    )
    reached = f"; the lowest measured peak is {lowest.measured_peak_gib:.2f} GiB ({lowest.name})"
    return (
        f"no measured plan meets {budget:.2f} GiB{reached if lowest else ''}: raise the budget, "
        "shorten the micro-batches, or use more GPUs"
    )


def format_plan(result: dict[str, Any], out: TextIO) -> bool:
    """Print the plans; returns whether every budget has one."""
    profile: Profile = result["profile"]
    print(
        f"no offload: peak {profile.peak_gib:.2f} GiB (resident {profile.resident_gib:.2f} GiB: "
        f"weights, gradients, optimizer; activations {profile.peak_gib - profile.resident_gib:.2f}"
        f" GiB), forward-backward {profile.fwd_bwd_s:.3f} s",
        file=out,
    )
    saved = ", ".join(f"{m} {g:.2f}" for m, g in profile.bytes_per_microbatch_gib.items())
    print(f"offloadable per micro-batch (GiB): {saved}", file=out)
    all_met = True
    for entry in result["plans"]:
        budget = entry["budget_gib"]
        print(
            f"\nbudget {budget:.2f} GiB ({100 * budget / profile.peak_gib:.0f}% of the peak): "
            f"{entry['fitting']} offload sets predicted to fit; measured:",
            file=out,
        )
        for c in entry["tried"]:
            predicted = "     -" if c.predicted_peak_gib is None else f"{c.predicted_peak_gib:6.2f}"
            if c.failed:
                print(f"  {c.name:<48} predicted {predicted} GiB  failed: {c.failed}", file=out)
                continue
            change = (c.measured_fwd_bwd_s or 0.0) / profile.fwd_bwd_s - 1
            print(
                f"  {c.name:<48} predicted {predicted} GiB  measured "
                f"{c.measured_peak_gib or 0:6.2f} GiB  {c.measured_fwd_bwd_s or 0:.3f} s "
                f"({100 * change:+.1f}%)"
                + (f", best of {c.measurements}" if c.measurements > 1 else ""),
                file=out,
            )
        chosen: Candidate | None = entry["chosen"]
        if chosen is None:
            print(why_none(profile, budget, entry["tried"]), file=out)
            all_met = False
            continue
        print(f"plan: {chosen.name}; paste these overrides:", file=out)
        for line in plan_overrides(result, chosen):
            print(f"  {shlex.quote(line)}", file=out)
    return all_met


def as_json(result: dict[str, Any]) -> dict[str, Any]:
    """The result as plain data (for --json)."""
    from dataclasses import asdict

    return {
        "profile": asdict(result["profile"]),
        "plans": [
            {
                "budget_gib": entry["budget_gib"],
                "fitting": entry["fitting"],
                "tried": [
                    {"name": c.name, "failed": c.failed, **asdict(c)} for c in entry["tried"]
                ],
                "chosen": entry["chosen"].name if entry["chosen"] else None,
                "overrides": plan_overrides(result, entry["chosen"]) if entry["chosen"] else None,
            }
            for entry in result["plans"]
        ],
    }
