"""``nemo-rl-offload plan``: pick the activation-memory settings that fit a peak budget fastest.

A menu of candidates (:mod:`.plan_menu`) and a cost model calibrated by measured runs
(:mod:`.cost_model`) choose what to measure; each measurement runs the recipe's own workers
(:mod:`nemo_rl_offload.telemetry`), and the fastest plan whose measured peak fits wins. A share
of the optimizer state on the host (:mod:`.plan_optimizer`) is the last resort. How the
planner picks a plan: docs/design/planner.md.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import statistics
import sys
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from nemo_rl_offload.config.loader import deep_merge
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.planning import cost_model, plan_optimizer
from nemo_rl_offload.planning.activation_bytes import ActivationSettings
from nemo_rl_offload.planning.cost_model import Calibration, LayerCosts
from nemo_rl_offload.planning.plan_menu import (
    DENSE_MODULES,
    EXPERT_MODULES,
    Candidate,
    Patch,
    frontier,
    megatron_patch,
    menu,
    offloadable_modules,
    predictor,
)
from nemo_rl_offload.progress import Progress

__all__ = [
    "DENSE_MODULES",
    "EXPERT_MODULES",
    "Candidate",
    "Patch",
    "megatron_patch",
    "offloadable_modules",
]

# How close peak predictions must come to be trusted for the choice of what to measure: a
# candidate predicted up to this much over the budget may still fit, and is tried; only its
# measured peak decides.
PREDICTION_TOLERANCE = 0.02
# How far peak predictions miss before an offload plan of the recipe is measured: on the 3B
# shape most came within this of the measured peaks, either way; a whole-set fraction plan at
# 8k missed by more (measured on an H100; see docs/design/planner.md). A candidate predicted
# this far under a budget should fit it (trial_order).
PEAK_MARGIN = 0.05
# The host time an offload hook adds to a step before an offload plan of the recipe has been
# measured: what the 3B shape's 8k plans showed per hook beyond their recompute and copies
# (measured on an H100; see docs/design/planner.md). Zero made every offload plan look as fast
# as its copies' floor, and the first trials went to the plans that move the most.
HOST_S_PER_HOOK_PRIOR = 1e-4
# The share of the copies' time that shows in the step before an offload plan of the recipe
# has been measured (cost_model.Calibration.copy_pressure): the 3B shape's 16k plans that
# copied most showed about this much of their copy time beyond their recompute and hooks
# (measured on H100s; see docs/design/planner.md). At 8k and 32k the measured plans showed
# less: a measured offload plan rescales both priors (cost_model.offload_scale), so a recipe
# where copies hide learns it from its first one.
COPY_PRESSURE_PRIOR = 0.15
MCFG = "policy.megatron_cfg"
GRAPH_INFLIGHT = 4  # max inflight offloads for graphed measurements when the recipe sets none
EXPANDABLE_SEGMENTS = "expandable_segments:True"  # see allocator_settings
# Fitting plans measured within this of the fastest fitting one are measured again: one offload
# set's time spreads about this much between fresh processes (measured on an H100; see
# docs/design/planner.md).
RECHECK_MARGIN = 0.20
# Until a run measures them: pinned copy bandwidth each way and HBM bandwidth (docs/DESIGN's
# facts for an H100; the first offload run replaces the copy bandwidths).
DEFAULT_COPY_BYTES_PER_S = 50e9
DEFAULT_HBM_BYTES_PER_S = 3.35e12
# Faster plans predicted over a budget that the printed plan names as the reason it is not
# faster.
WHY_NOT_SHOWN = 3


@dataclass(frozen=True)
class Profile:
    """The recipe as it is, without offloading or recompute (GiB, seconds): measured when it
    fit (``measured``), else predicted by the calibrated cost model. ``resident_gib``: the
    part of the peak that is not activations (weights, gradients, optimizer state), measured;
    ``bytes_per_microbatch_gib``: what each offload module moves per micro-batch
    (:mod:`.planning.activation_bytes`' count from the ledger)."""

    peak_gib: float
    fwd_bwd_s: float
    bytes_per_microbatch_gib: dict[str, float]
    resident_gib: float = 0.0
    measured: bool = True
    failure: str | None = None  # why the recipe as it is did not run
    # The whole step's peak without offloading or recompute, the optimizer step's included
    # (0.0: that run failed): budgets are the forward-backward peak's, which activation
    # settings change.
    step_peak_gib: float = 0.0
    # The optimizer step's own peak (torch's Adam holds parameter-sized float32 buffers), the
    # same whatever the activation settings: measured where a profiled step peaked after its
    # forward-backward (optimizer_peak); None when every one peaked inside it.
    optimizer_peak_gib: float | None = None


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    if isinstance(value, dict):  # strings quoted: a mapping's values may hold ':' or ','
        return (
            "{"
            + ", ".join(
                f"{k}: {json.dumps(v) if isinstance(v, str) else _value_text(v)}"
                for k, v in value.items()
            )
            + "}"
        )
    return str(value)


def render_overrides(patch: Patch, recipe: dict[str, Any]) -> list[str]:
    """The patch as Hydra-grammar override lines for ``recipe`` (the loaded recipe it applies
    to): a key the recipe has is set (``key=value``), one it lacks is added (``++key=value``),
    so that every line applies as written."""
    lines: list[str] = []

    def walk(part: Patch, node: Any, path: tuple[str, ...]) -> None:
        for key, value in part.items():
            here = (*path, key)
            child = node.get(key, _MISSING) if isinstance(node, dict) else _MISSING
            if isinstance(value, dict) and child is None and value:
                # A mapping the recipe sets to null (e.g. env_vars: null) has no keys to
                # add: it is set whole.
                lines.append(f"{'.'.join(here)}={_value_text(value)}")
            elif isinstance(value, dict):
                walk(value, child, here)  # an empty mapping changes nothing
            else:
                prefix = "++" if child is _MISSING else ""
                lines.append(f"{prefix}{'.'.join(here)}={_value_text(value)}")

    walk(patch, recipe, ())
    return lines


_MISSING = object()


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
    return min(fitting, key=lambda c: c.measured_cost_s or 0.0) if fitting else None


def contenders(measured: list[Candidate], budget_gib: float) -> list[Candidate]:
    """The fitting plans measured within ``RECHECK_MARGIN`` of the fastest fitting one, when
    there is more than one (a lone plan has nothing to be ranked against)."""
    fitting = _fitting(measured, budget_gib)
    if len(fitting) < 2:
        return []
    limit = min(c.measured_cost_s or 0.0 for c in fitting) * (1 + RECHECK_MARGIN)
    close = [c for c in fitting if (c.measured_cost_s or 0.0) <= limit]
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


def trial_order(
    fitting: list[Candidate], predict: Any, budget: float, *, incumbent: bool = True
) -> list[Candidate]:
    """The order to measure a budget's candidates in (``fitting``: fastest first, each
    predicted within the budget or within the prediction's tolerance over it): those predicted
    within the budget first, then the borderline ones, each group fastest first. With few
    trials, plans predicted just over the budget, which mostly turn out over it, must not use
    them all up (measured on an H100; see docs/design/planner.md).

    Without an ``incumbent`` (no measured plan but the profiles fits the budget: full
    recompute, when it fits, is the slowest way to), the fastest candidate predicted to fit
    with ``PEAK_MARGIN`` to spare goes first: a plan that surely fits bounds the rest (only
    candidates predicted faster than it are measured after it), where plans predicted just
    under the budget ran out of memory and used up the trials (docs/design/planner.md)."""
    ordered = sorted(fitting, key=lambda c: predict(c)[0] > budget)
    if incumbent:
        return ordered
    safe = next((c for c in ordered if predict(c)[0] <= budget * (1 - PEAK_MARGIN)), None)
    return ordered if safe is None else [safe, *(c for c in ordered if c is not safe)]


def measure_candidate(
    candidate: Candidate,
    measure: Any,
) -> list[dict[str, Any]] | None:
    """``measure()``'s records, or None with ``candidate.failure`` set when the workers
    failed: a plan that does not fit, or a bug, is a result of the trial, not the end of the
    plan."""
    from nemo_rl_offload.distributed.worker_group import WorkerError
    from nemo_rl_offload.planning.failures import from_exception

    try:
        return measure()
    except WorkerError as exc:
        candidate.failure = from_exception(exc).as_dict()
        return None


def _optimizer_s(records: list[dict[str, Any]]) -> float:
    """The step's time beyond its forward-backward (the optimizer step, mostly): the median
    over the replayed steps."""
    steps = [
        {**r, "optimizer_s": r["train_time_s"] - r["fwd_bwd_time_s"]}
        for r in records
        if "train_time_s" in r and "fwd_bwd_time_s" in r
    ]
    return _replayed_median(steps, "optimizer_s") if steps else 0.0


def _measured(records: list[dict[str, Any]]) -> tuple[float, float]:
    """(peak GiB, forward-backward s) of a measurement: medians of the replayed steps."""
    return (
        _replayed_median(records, "peak_fwd_bwd_gpu_memory_gib"),
        _replayed_median(records, "fwd_bwd_time_s"),
    )


@dataclass
class RecipeCosts:
    """The cost model's view of a recipe (:func:`plan_menu.layer_costs`): its activation
    table and recompute FLOPs, one micro-batch's forward FLOPs (the layers' and the output
    layer's), and the micro-batches of a step."""

    layers: LayerCosts
    forward_flops: float
    microbatches: int

    def removal(self, candidate: Candidate) -> cost_model.Removal:
        return cost_model.removal(self.layers, candidate.settings())

    def offloadable_gib(self) -> dict[str, float]:
        """What each offload module moves per micro-batch when every module offloads."""
        table = self.layers.table
        modules = dict.fromkeys(r.offload for r in table.rows if r.offload)
        return {
            m: table.estimate(ActivationSettings(offload=frozenset({m}))).offloaded / 2**30
            for m in modules
        }


@dataclass
class Calibrator:
    """Calibration from the measured runs that fit: the memory line through (ledger
    activations, measured peak), the FLOP rate and the plain step from full recompute and the
    plain run, and the copy bandwidths and the scale of offloading's overhead (hooks' host time
    and copy pressure) from offload runs."""

    costs: RecipeCosts
    recompute_s: float | None = None
    base_s: float | None = None
    points: list[tuple[float, float]] = field(default_factory=list)
    # (ledger activation bytes, peak bytes) of offload plans without full recompute, whose
    # peak holds more than the line (cost_model.Calibration.offload_peak_bytes)
    offload_points: list[tuple[float, float]] = field(default_factory=list)
    # (ledger activation bytes, bytes it had allocated and asked for when it failed) of offload
    # plans that ran out of memory: their peak is at least that (a lower bound on the offset)
    offload_failures: list[tuple[float, float]] = field(default_factory=list)
    d2h: list[float] = field(default_factory=list)
    h2d: list[float] = field(default_factory=list)
    offload_runs: list[tuple[cost_model.Removal, float]] = field(default_factory=list)

    def observe(self, candidate: Candidate, records: list[dict[str, Any]]) -> None:
        removed = self.costs.removal(candidate)
        peak = candidate.measured_peak_gib or 0.0
        point = (removed.activation_bytes, peak * 2**30)
        if cost_model.holds_offload_peak(candidate.settings()):
            self.offload_points.append(point)
        else:
            self.points.append(point)
        if removed.offloaded_bytes > 0:
            for key, out in (("d2h_gb_per_s", self.d2h), ("h2d_gb_per_s", self.h2d)):
                value = _replayed_median(records, key)
                if value > 0:
                    out.append(value * 1e9)
        if removed.hooks > 0:
            self.offload_runs.append((removed, candidate.measured_fwd_bwd_s or 0.0))

    def observe_failure(self, candidate: Candidate) -> None:
        """An offload plan that ran out of memory needed at least what it had allocated plus
        what it asked for: the offload peak's offset is at least what puts it there (a planner
        whose first offload trials fail learns from them instead of trying the next plan with
        the same underestimate)."""
        oom = (candidate.failure or {}).get("oom") or {}
        if "allocated_gib" not in oom or "tried_gib" not in oom:
            return
        if not cost_model.holds_offload_peak(candidate.settings()):
            return
        needed = (oom["allocated_gib"] + oom["tried_gib"]) * 2**30
        self.offload_failures.append((self.costs.removal(candidate).activation_bytes, needed))

    def calibration(self) -> Calibration:
        costs = self.costs
        full = costs.removal(Candidate((), 1.0, None, full_recompute=True)).recompute_flops
        forward, microbatches = costs.forward_flops, costs.microbatches
        if self.recompute_s is not None:
            base = (
                self.base_s
                if self.base_s is not None
                else cost_model.base_step_s(self.recompute_s, forward, full)
            )
            rate = cost_model.flops_per_s(
                self.recompute_s, self.base_s, forward, full, microbatches
            )
        elif self.base_s is not None:  # only the plain step: the rate of its forward-backward
            base = self.base_s
            rate = cost_model.flops_per_s(self.base_s, None, forward, 0.0, microbatches)
        else:
            raise ValueError("calibration needs the plain step or full recompute measured")
        resident, scale = cost_model.fit_memory(self.points or self.offload_points)
        offload_peak = (
            statistics.median(peak - resident - scale * kept for kept, peak in self.offload_points)
            if self.points and self.offload_points
            else None
        )
        floor = 0.0
        if self.points and self.offload_failures:
            floor = max(needed - resident - scale * kept for kept, needed in self.offload_failures)
        calibration = Calibration(
            offload_peak_bytes=offload_peak,
            offload_peak_floor_bytes=floor,
            resident_bytes=resident,
            activation_scale=scale,
            base_step_s=base,
            microbatches=costs.microbatches,
            flops_per_s=rate,
            hbm_bytes_per_s=DEFAULT_HBM_BYTES_PER_S,
            d2h_bytes_per_s=statistics.median(self.d2h) if self.d2h else DEFAULT_COPY_BYTES_PER_S,
            h2d_bytes_per_s=statistics.median(self.h2d) if self.h2d else DEFAULT_COPY_BYTES_PER_S,
            host_s_per_hook=HOST_S_PER_HOOK_PRIOR,
            copy_pressure=COPY_PRESSURE_PRIOR,
        )
        overhead_scales = [
            s
            for removed, seconds in self.offload_runs
            if (s := cost_model.offload_scale(seconds, removed, calibration)) is not None
        ]
        if not overhead_scales:
            return calibration
        fitted = statistics.median(overhead_scales)
        return replace(
            calibration,
            host_s_per_hook=fitted * HOST_S_PER_HOOK_PRIOR,
            copy_pressure=fitted * COPY_PRESSURE_PRIOR,
        )


def _layer_costs(
    section: dict[str, Any], base_dir: Any, microbatches: int, chunked_loss: bool = True
) -> RecipeCosts:
    """The recipe's :class:`RecipeCosts` from its activation ledger, measured on the CPU (a
    seam: tests give a small one). With ``chunked_loss``: for a recipe without a
    ``logprob_chunk_size``, also the loss's bytes with one (the ledger measured again with
    it); for a recipe without ``chunked_output_layer``, also the bytes with the output layer in
    the loss's chunks (once more)."""
    from nemo_rl_offload.config import megatron_settings, model_shape
    from nemo_rl_offload.config.model_presets import section_architecture
    from nemo_rl_offload.planning import ledger
    from nemo_rl_offload.planning.activation_bytes import dtype_bytes, parallel_sizes
    from nemo_rl_offload.planning.ledger_run import build_ledger
    from nemo_rl_offload.planning.plan_menu import LEAN_LOSS_CHUNK, layer_costs

    architecture = section_architecture(section, base_dir=base_dir)
    effective = megatron_settings.effective_settings(section, architecture, te_installed=False)
    built = build_ledger(section, base_dir=base_dir)
    seq = int(section.get("max_total_sequence_length") or built.tokens_per_microbatch)
    settings = {
        kind: ledger.one_layer_settings(effective, overrides)
        for kind, _, overrides in model_shape.layer_kinds(effective)
    }

    def flops(kind: str, option: str) -> float:
        return ledger.recompute_flops_per_token(option, settings[kind], seq)

    element = dtype_bytes(section.get("precision") or "float32")
    hidden = int(effective.value("hidden_size"))
    lean = chunked = None
    if chunked_loss:
        chunked_section = section
        if not section.get("logprob_chunk_size"):
            chunked_section = {**section, "logprob_chunk_size": LEAN_LOSS_CHUNK}
            lean = build_ledger(chunked_section, base_dir=base_dir)
        megatron_cfg = section.get("megatron_cfg") or {}
        if not megatron_cfg.get("chunked_output_layer"):
            chunked_cfg = {**megatron_cfg, "chunked_output_layer": True}
            chunked_section = {**chunked_section, "megatron_cfg": chunked_cfg}
            chunked = build_ledger(chunked_section, base_dir=base_dir)
    tp = parallel_sizes(effective)["tensor_model_parallel_size"]
    output = 2 * hidden * architecture.vocab_size * built.tokens_per_microbatch
    layers = layer_costs(effective, built, flops, element, lean, chunked, output / tp)
    forward = layers.forward_flops() + output
    return RecipeCosts(layers, forward, microbatches)


def step_microbatches(recipe: dict[str, Any]) -> int:
    """Micro-batches each data-parallel rank runs per training step (as telemetry shapes it)."""
    policy, cluster = recipe["policy"], recipe["cluster"]
    mcfg = policy.get("megatron_cfg") or {}
    workers = int(cluster.get("gpus_per_node") or 1) * int(cluster.get("num_nodes") or 1)
    model_parallel = 1
    for key in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        model_parallel *= int(mcfg.get(key) or 1)
    dp = max(1, workers // model_parallel)
    rows = int(policy["train_micro_batch_size"]) * dp
    return max(1, int(policy["train_global_batch_size"]) // rows)


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
    """Profile once, then for every budget (GiB, or fractions of the no-offload peak, measured
    or predicted) measure the most promising candidates predicted to fit; returns everything
    found. Every measurement runs on one Ray cluster, started by the first."""
    from nemo_rl_offload.distributed import cluster

    # Each trial is a job of minutes: a line as it starts and every interval while it runs.
    progress = Progress(stream=err, heartbeat=True)
    with cluster.kept_open(), contextlib.closing(progress):
        return _plan(
            config,
            overrides,
            budgets_gib=budgets_gib,
            budget_fractions=budget_fractions,
            steps=steps,
            max_trials=max_trials,
            err=err,
            progress=progress,
        )


def _plan(
    config: str,
    overrides: list[str],
    *,
    budgets_gib: list[float] | None,
    budget_fractions: list[float] | None,
    steps: int,
    max_trials: int,
    err: TextIO,
    progress: Progress,
) -> dict[str, Any]:
    """The work of :func:`plan`. Returns ``profile``, ``plans`` (per budget: the candidates
    tried, the ``chosen`` one or None, the faster plans predicted over it), ``measured_with``,
    ``dtensor``, the loaded ``recipe`` and the final ``calibration``. Steps: check the budgets
    and the recipe; measure the activation ledger on the CPU and build the menu; profile full
    recompute, then the recipe without offloading or recompute; per budget, measure up to
    ``max_trials`` candidates predicted to fit (:func:`trial_order`), measure close contenders
    again, and where none fits try a share of the optimizer on the host (:mod:`.plan_optimizer`).
    """
    from pathlib import Path

    from nemo_rl_offload.config.loader import load_recipe
    from nemo_rl_offload.config.megatron_settings import effective_settings
    from nemo_rl_offload.config.model_presets import section_architecture
    from nemo_rl_offload.planning.memory_estimate import host_optimizer_state
    from nemo_rl_offload.preflight import check_policy, check_recipe

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
    effective = effective_settings(
        recipe["policy"], architecture, te_installed=report.caps.has_transformer_engine
    )
    is_moe = effective.is_moe
    # Expert offload needs the grouped expert layout; every measurement (and so every plan)
    # runs on it, so that the profile and the candidates are the same model. Graphed
    # offloading needs the max-inflight cap, and more steps to reach the replays.
    measured_with = megatron_patch(
        {"model_overrides": {"moe_grouped_gemm": True}} if is_moe else {}
    )
    graph_patch, graph_steps = graph_settings(recipe["policy"]["megatron_cfg"])
    measured_with = deep_merge(measured_with, graph_patch)
    measured_with = deep_merge(
        measured_with,
        allocator_settings(
            recipe["policy"]["megatron_cfg"], report.worker_environment("policy"), dtensor
        ),
    )
    steps += graph_steps

    def lines(patch: Patch) -> list[str]:
        """The overrides a measurement runs with: the user's, then the patch's."""
        return [*overrides, *render_overrides(with_layout(measured_with, patch, dtensor), loaded)]

    workers = int(recipe["cluster"]["gpus_per_node"]) * int(recipe["cluster"].get("num_nodes") or 1)

    verdicts: dict[str, bool] = {}

    def valid(candidate: Candidate) -> bool:
        """Whether the rules every recipe passes accept the candidate on this recipe."""
        if candidate.name in verdicts:
            return verdicts[candidate.name]
        patched = deep_merge(recipe, with_layout(measured_with, candidate.patch(), dtensor))
        findings = check_policy(
            patched["policy"],
            where="policy",
            architecture=architecture,
            caps=report.caps,
            gpus_per_node=recipe["cluster"]["gpus_per_node"],
            workers=workers,
        )
        verdicts[candidate.name] = not findings.errors
        return verdicts[candidate.name]

    progress.start("plan: the activation ledger (on the CPU)")
    # A DTensor policy gets no chunked-loss or chunked-output candidates (plan_menu.menu): no
    # further ledgers.
    costs = _layer_costs(recipe["policy"], Path.cwd(), step_microbatches(recipe), not dtensor)
    candidates = menu(costs.layers.table, is_moe, dtensor)
    calibrator = Calibrator(costs)

    def run(candidate: Candidate) -> list[dict[str, Any]] | None:
        records = measure_candidate(
            candidate, lambda: _measure(config, lines(candidate.patch()), steps, err)
        )
        progress.finish()
        # A host optimizer lowers the resident state the activation model is fitted to: its
        # plans fit the host optimizer's own model (plan_optimizer) instead.
        own_model = candidate.host_optimizer is None
        if records is not None:
            candidate.measured_peak_gib, candidate.measured_fwd_bwd_s = _measured(records)
            if own_model:
                calibrator.observe(candidate, records)
        elif own_model:
            calibrator.observe_failure(candidate)
        # As each trial ends: a plan stopped by a time limit has still said what it measured.
        print(f"plan: {candidate.name}: {_outcome(candidate)}", file=err)
        return records

    # Full recompute first: at long context it is often the only setting that fits.
    progress.start("plan: profiling full recompute")
    recompute = Candidate((), 1.0, None, full_recompute=True)
    recompute_records = run(recompute)
    if recompute_records is not None:
        calibrator.recompute_s = recompute.measured_fwd_bwd_s
    progress.start("plan: profiling without offloading or recompute")
    plain = Candidate((), 1.0, None)
    plain_records = run(plain)
    if plain_records is not None:
        calibrator.base_s = plain.measured_fwd_bwd_s
    if recompute_records is None and plain_records is None:
        raise ProfileFailed(
            f"plan: profiling failed: full recompute: {recompute.failed}; without offloading "
            f"or recompute: {plain.failed}"
        )
    if max((p for _, p in calibrator.points), default=0.0) <= 0:
        raise UserInputError("the workers report no GPU memory; run the planner on GPU workers")
    profiled = plain_records if plain_records is not None else recompute_records
    resident = _replayed_median(profiled, "peak_fwd_bwd_gpu_memory_gib") - _replayed_median(
        profiled, "peak_activation_gpu_memory_gib"
    )
    measured: dict[str, Candidate] = {recompute.name: recompute, plain.name: plain}
    if plain_records is None:
        plain.predicted_peak_gib, plain.predicted_fwd_bwd_s = predictor(
            costs.layers, calibrator.calibration()
        )(plain)
    step_peak = max((r.get("peak_gpu_memory_gib", 0.0) for r in plain_records or []), default=0.0)
    profile = Profile(
        step_peak_gib=step_peak,
        optimizer_peak_gib=optimizer_peak([*(recompute_records or []), *(plain_records or [])]),
        peak_gib=plain.measured_peak_gib or plain.predicted_peak_gib or 0.0,
        fwd_bwd_s=plain.measured_fwd_bwd_s or plain.predicted_fwd_bwd_s or 0.0,
        bytes_per_microbatch_gib=costs.offloadable_gib(),
        resident_gib=resident,
        measured=plain_records is not None,
        failure=plain.failed,
    )
    rechecked: set[str] = set()
    # The last resort for a budget no activation plan meets (plan_optimizer), where the rules
    # accept the host optimizer on this recipe (a DTensor policy's optimizer is not Megatron's):
    # its model's priors from the memory estimate's optimizer state and the host's Adam per
    # parameter, refitted from them by every measured host plan.
    host_prior = None
    if not dtensor and valid(plain.with_host_optimizer(1.0)):
        host_prior = plan_optimizer.HostOptimizerModel.prior(
            *host_optimizer_state(effective, architecture, recipe["policy"], workers=workers)
        )
    host_observations: list[plan_optimizer.Observation] = []
    profile_optimizer_s = _optimizer_s(profiled)
    budgets = [*budgets_gib, *(f * profile.peak_gib for f in budget_fractions)]
    plans = []
    for budget in budgets:
        # What earlier budgets measured is known: it is an option here too.
        tried = [c for c in measured.values() if c is not plain and c is not recompute]
        for trial in range(1, max_trials + 1):
            predict = predictor(costs.layers, calibrator.calibration())
            fitting = [
                c
                for c in frontier(candidates, predict, valid)
                if predict(c)[0] <= budget * (1 + PREDICTION_TOLERANCE)
            ]
            done = [
                c
                for c in (plain, recompute, *tried)
                if c.measured_peak_gib is not None and c.measured_peak_gib <= budget
            ]
            fastest = min((c.measured_cost_s or 0.0 for c in done), default=float("inf"))
            incumbent = any(c is not plain and c is not recompute for c in done)
            chosen = next(
                (
                    c
                    for c in trial_order(fitting, predict, budget, incumbent=incumbent)
                    if c.name not in measured and predict(c)[1] < fastest
                ),
                None,
            )
            if chosen is None:
                break
            chosen.predicted_peak_gib, chosen.predicted_fwd_bwd_s = predict(chosen)
            progress.start(
                f"plan: trial {trial}/{max_trials} for {budget:.1f} GiB: measuring {chosen.name}"
            )
            run(chosen)
            measured[chosen.name] = chosen
            tried.append(chosen)
        options = [plain, *tried, recompute]
        for candidate in contenders(options, budget):
            # The recipe without offloading is the profile itself: it fits only when no
            # plan is needed, and then nothing is faster.
            if candidate is plain or candidate.name in rechecked:
                continue
            progress.start(f"plan: measuring {candidate.name} again (a close contender)")
            again = replace(candidate, failure=None, measurements=1)
            records = measure_candidate(
                again, lambda c=candidate: _measure(config, lines(c.patch()), steps, err)
            )
            progress.finish()
            if records is None:  # it fit once and failed now: it cannot be relied on
                candidate.failure = again.failure
                candidate.measured_peak_gib = candidate.measured_fwd_bwd_s = None
            else:
                again.measured_peak_gib, again.measured_fwd_bwd_s = _measured(records)
                remeasured(candidate, records)
            print(f"plan: {candidate.name} again: {_outcome(again)}", file=err)
            rechecked.add(candidate.name)
        if best(options, budget) is None and host_prior is not None:
            for trial in range(1, max_trials + 1):
                host_model = host_prior.fitted(host_observations)
                predict = predictor(costs.layers, calibrator.calibration())
                fitting = _fitting(options, budget)
                fastest = min((c.measured_cost_s or 0.0 for c in fitting), default=float("inf"))
                offered = plan_optimizer.offers(
                    frontier(candidates, predict, valid), predict, budget, host_model, PEAK_MARGIN
                )
                host = next(
                    (
                        c
                        for c in offered
                        if c.name not in measured
                        and (c.predicted_cost_s or 0.0) < fastest
                        and valid(c)
                    ),
                    None,
                )
                if host is None:
                    break
                progress.start(
                    f"plan: host-optimizer trial {trial}/{max_trials} for {budget:.1f} GiB: "
                    f"measuring {host.name}"
                )
                records = run(host)
                measured[host.name] = host
                tried.append(host)
                options.append(host)
                if records is not None and host.measured_peak_gib is not None:
                    host.optimizer_extra_s = max(0.0, _optimizer_s(records) - profile_optimizer_s)
                    host_observations.append(
                        plan_optimizer.Observation(
                            host.host_optimizer or 0.0,
                            predict(host)[0],  # the activation plan's peak, no host share
                            host.measured_peak_gib,
                            host.optimizer_extra_s,
                        )
                    )
        chosen = best(options, budget)
        predict = predictor(costs.layers, calibrator.calibration())
        ranked = frontier(candidates, predict, valid)
        plans.append(
            {
                "budget_gib": budget,
                "fitting": sum(
                    1 for c in ranked if predict(c)[0] <= budget * (1 + PREDICTION_TOLERANCE)
                ),
                "tried": options,
                "chosen": chosen,
                "over_budget": faster_over_budget(ranked, predict, budget, chosen),
                "host_optimizer_offered": host_prior is not None,
            }
        )
    return {
        "profile": profile,
        "plans": plans,
        "measured_with": measured_with,
        "dtensor": dtensor,
        "recipe": loaded,
        "calibration": calibrator.calibration(),
    }


def faster_over_budget(
    ranked: list[Candidate], predict: Any, budget: float, chosen: Candidate | None
) -> list[tuple[str, float, float]]:
    """(name, predicted peak GiB, predicted s) of the frontier's plans predicted faster than
    the chosen one (its measured time) and over ``budget``: why no cheaper plan was chosen."""
    limit = chosen.measured_cost_s if chosen and chosen.measured_cost_s else float("inf")
    out = [
        (c.name, *predict(c)) for c in ranked if predict(c)[1] < limit and predict(c)[0] > budget
    ]
    return out[:WHY_NOT_SHOWN]


def allocator_settings(
    megatron_cfg: dict[str, Any], worker_environment: dict[str, str], dtensor: bool
) -> Patch:
    """What every measurement of an eager Megatron recipe runs with when its workers' environment
    leaves the CUDA allocator's configuration to the default: expandable segments. Offloaded and
    reloaded activations of many sizes otherwise leave memory reserved but unusable: at 16k
    tokens on the 3B shape, plans that fit with expandable segments ran out of memory with
    GiBs reserved but unallocated (measured on two H100s; see docs/design/planner.md).
    The plan then carries the setting, so the job runs as measured. A recipe that sets
    PYTORCH_CUDA_ALLOC_CONF is measured as it is, as are graphed recipes (graphs capture from
    the allocator's private pools) and DTensor sections (their env_vars replace megatron_cfg's)."""
    if (
        dtensor
        or "PYTORCH_CUDA_ALLOC_CONF" in worker_environment
        or megatron_cfg.get("cuda_graph_impl") == "full_iteration"
    ):
        return {}
    return megatron_patch({"env_vars": {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE_SEGMENTS}})


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


_NO_PEAK = float("inf")  # a record without a forward-backward peak tells nothing


def optimizer_peak(records: list[dict[str, Any]]) -> float | None:
    """The optimizer step's own peak (GiB) in profiled steps: a step whose whole peak is above
    its forward-backward peak reached it after the forward-backward (the peak counter runs on
    through the optimizer step), so that peak is the optimizer step's. None when every step
    peaked inside its forward-backward: the optimizer step's is then below it, unknown."""
    return max(
        (
            r["peak_gpu_memory_gib"]
            for r in records
            if r.get("peak_gpu_memory_gib", 0.0) > r.get("peak_fwd_bwd_gpu_memory_gib", _NO_PEAK)
        ),
        default=None,
    )


def optimizer_note(profile: Profile, budget: float) -> str:
    """The line under a plan whose budget the optimizer step's own peak exceeds (a figure
    measured in that step, not the forward-backward's): it peaks over it whatever the
    activation setting."""
    return (
        f"note: the optimizer step peaks at {profile.optimizer_peak_gib or 0.0:.2f} GiB, over "
        f"{budget:.2f} GiB, whatever the activation setting (the budget is the forward-backward "
        f"peak's); to lower it: {MCFG}.optimizer.optimizer_cpu_offload, the distributed "
        "optimizer over more ranks, or a fused Adam (Transformer Engine or Apex installed)"
    )


def why_none(
    profile: Profile, budget: float, tried: list[Candidate], host_offered: bool = False
) -> str:
    """Why no plan meets ``budget``. ``host_offered``: the planner could offer the optimizer
    state on the host (plan_optimizer), so a budget it tried none for is beyond even all of it."""
    host_tried = any(c.host_optimizer is not None for c in tried)
    if profile.resident_gib >= budget and host_offered and not host_tried:
        return (
            f"no plan can meet {budget:.2f} GiB: weights, gradients and optimizer state hold "
            f"{profile.resident_gib:.2f} GiB, and no plan is predicted under it even with all "
            "of the optimizer state on the host; shorten the micro-batches or use more GPUs"
        )
    if profile.resident_gib >= budget and not host_tried:
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


def _profile_line(profile: Profile) -> str:
    step = (
        f"; the whole step, optimizer step included, peaked at {profile.step_peak_gib:.2f} GiB"
        if profile.step_peak_gib
        else ""
    )
    if profile.measured:
        return (
            f"no offload: peak {profile.peak_gib:.2f} GiB (resident {profile.resident_gib:.2f} "
            f"GiB: weights, gradients, optimizer; activations "
            f"{profile.peak_gib - profile.resident_gib:.2f} GiB), forward-backward "
            f"{profile.fwd_bwd_s:.3f} s{step}"
        )
    return (
        f"no offload: did not run ({profile.failure}); predicted peak {profile.peak_gib:.2f} GiB "
        f"(resident {profile.resident_gib:.2f} GiB: weights, gradients, optimizer, measured), "
        f"forward-backward {profile.fwd_bwd_s:.3f} s (estimated from full recompute){step}"
    )


def _calibration_line(calibration: Calibration | None) -> str | None:
    if calibration is None:
        return None
    c = calibration
    return (
        f"cost model: resident {c.resident_bytes / 2**30:.2f} GiB + {c.activation_scale:.2f} x "
        f"the ledger's activations; {c.flops_per_s / 1e12:.0f} TFLOP/s; copies "
        f"{c.d2h_bytes_per_s / 1e9:.0f}/{c.h2d_bytes_per_s / 1e9:.0f} GB/s to/from the host; "
        f"{1e6 * c.host_s_per_hook:.0f} us of host time per offload hook and "
        f"{100 * c.copy_pressure:.0f}% of the copies' time"
        + (
            f"; offload plans peak {c.offload_peak_bytes / 2**30:+.2f} GiB beyond it"
            if c.offload_peak_bytes is not None
            else "; offload plans peak at least two layers' copies beyond it (none measured yet)"
        )
        + (
            f", at least {c.offload_peak_floor_bytes / 2**30:+.2f} GiB (a plan out of memory)"
            if c.offload_peak_floor_bytes
            else ""
        )
    )


def _outcome(c: Candidate) -> str:
    """What a trial measured, or why it failed."""
    if c.failed:
        return f"failed: {c.failed}"
    return f"measured {c.measured_peak_gib or 0:6.2f} GiB  {c.measured_fwd_bwd_s or 0:.3f} s"


def _host_optimizer_outcome(c: Candidate) -> str:
    """A host-optimizer plan's step time beyond its forward-backward: what its change counts."""
    if c.host_optimizer is None or c.optimizer_extra_s is None:
        return ""
    predicted = c.predicted_optimizer_extra_s
    guess = f" (predicted +{predicted:.3f} s)" if predicted is not None else ""
    return f"; the optimizer step on the host +{c.optimizer_extra_s:.3f} s{guess}"


def _predicted(c: Candidate) -> str:
    peak = "     -" if c.predicted_peak_gib is None else f"{c.predicted_peak_gib:6.2f}"
    seconds = "" if c.predicted_fwd_bwd_s is None else f" {c.predicted_fwd_bwd_s:.3f} s"
    return f"predicted {peak} GiB{seconds}"


def format_plan(result: dict[str, Any], out: TextIO) -> bool:
    """Print the plans; returns whether every budget has one."""
    profile: Profile = result["profile"]
    print(_profile_line(profile), file=out)
    calibration = _calibration_line(result.get("calibration"))
    if calibration:
        print(calibration, file=out)
    saved = ", ".join(f"{m} {g:.2f}" for m, g in profile.bytes_per_microbatch_gib.items())
    print(f"offloadable per micro-batch (GiB): {saved}", file=out)
    all_met = True
    for entry in result["plans"]:
        budget = entry["budget_gib"]
        print(
            f"\nbudget {budget:.2f} GiB ({100 * budget / profile.peak_gib:.0f}% of the peak): "
            f"{entry['fitting']} plans on the frontier predicted to fit; measured:",
            file=out,
        )
        for c in entry["tried"]:
            if c.failed:
                print(f"  {c.name:<48} {_predicted(c)}  {_outcome(c)}", file=out)
                continue
            change = (c.measured_cost_s or 0.0) / profile.fwd_bwd_s - 1
            print(
                f"  {c.name:<48} {_predicted(c)}  {_outcome(c)} ({100 * change:+.1f}%)"
                + (f", best of {c.measurements}" if c.measurements > 1 else "")
                + _host_optimizer_outcome(c),
                file=out,
            )
        chosen: Candidate | None = entry["chosen"]
        over = entry.get("over_budget") or []
        if over:
            print(
                "faster plans predicted over the budget: "
                + "; ".join(f"{name} ({peak:.2f} GiB, {sec:.3f} s)" for name, peak, sec in over),
                file=out,
            )
        if chosen is None:
            offered = entry.get("host_optimizer_offered", False)
            print(why_none(profile, budget, entry["tried"], offered), file=out)
            all_met = False
            continue
        if (profile.optimizer_peak_gib or 0.0) > budget and chosen.host_optimizer is None:
            print(optimizer_note(profile, budget), file=out)
        print(f"plan: {chosen.name}; paste these overrides:", file=out)
        for line in plan_overrides(result, chosen):
            print(f"  {shlex.quote(line)}", file=out)
    return all_met


def as_json(result: dict[str, Any]) -> dict[str, Any]:
    """The result as plain data (for --json)."""
    from dataclasses import asdict

    calibration = result.get("calibration")
    return {
        "profile": asdict(result["profile"]),
        "calibration": asdict(calibration) if calibration else None,
        "plans": [
            {
                "budget_gib": entry["budget_gib"],
                "fitting": entry["fitting"],
                "tried": [
                    {"name": c.name, "failed": c.failed, **asdict(c)} for c in entry["tried"]
                ],
                "chosen": entry["chosen"].name if entry["chosen"] else None,
                "overrides": plan_overrides(result, entry["chosen"]) if entry["chosen"] else None,
                "over_budget": [
                    {"name": name, "predicted_peak_gib": peak, "predicted_fwd_bwd_s": sec}
                    for name, peak, sec in entry.get("over_budget") or []
                ],
            }
            for entry in result["plans"]
        ],
    }
