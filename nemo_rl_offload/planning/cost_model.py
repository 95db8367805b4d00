"""The physical model of offloading's cost (docs/benchmark.md): the benchmark's floors.

Per micro-batch, offloading moves S bytes to the host during the forward pass (forward time F,
device-to-host bandwidth Wd) and back during the backward pass (time B, host-to-device
bandwidth Wh). The copies run on their own streams beside the compute, so at best they hide
completely; what cannot hide is the part of each transfer longer than the pass it overlaps:

    floor = max(0, S / Wd - F) + max(0, S / Wh - B)

A plan's measured overhead above this floor is cost that is not bandwidth: hook and launch
overhead on the CPU, reloads scheduled late, allocator effects. The benchmark reports both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nemo_rl_offload.config.module_names import LAYER_INPUT
from nemo_rl_offload.planning.activation_bytes import ActivationSettings, ActivationTable, covered


@dataclass(frozen=True)
class PassTimes:
    """Forward and backward seconds of one micro-batch without offloading."""

    forward_s: float
    backward_s: float


def overhead_floor_s(
    offloaded_bytes: float, times: PassTimes, d2h_bytes_per_s: float, h2d_bytes_per_s: float
) -> float:
    """The least time offloading ``offloaded_bytes`` of one micro-batch can add (seconds)."""
    if offloaded_bytes <= 0:
        return 0.0
    if d2h_bytes_per_s <= 0 or h2d_bytes_per_s <= 0:
        raise ValueError("bandwidths must be > 0")
    to_host = offloaded_bytes / d2h_bytes_per_s
    back = offloaded_bytes / h2d_bytes_per_s
    return max(0.0, to_host - times.forward_s) + max(0.0, back - times.backward_s)


def step_floor_s(
    baseline_step_s: float,
    microbatches: int,
    offloaded_bytes_per_step: float,
    times: PassTimes,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
) -> float:
    """The least step time of a plan: the step without offloading plus each micro-batch's
    floor (micro-batches run one after another without pipeline parallelism)."""
    per_microbatch = offloaded_bytes_per_step / max(1, microbatches)
    floor = overhead_floor_s(per_microbatch, times, d2h_bytes_per_s, h2d_bytes_per_s)
    return baseline_step_s + microbatches * floor


# ------------------------------------------------------------------ the planner's cost model
#
# A candidate's peak and step time from the activation ledger (planning.ledger) and a few
# measured steps. The activation bytes a candidate keeps and the bytes it moves are
# planning.activation_bytes' (the arithmetic validate's estimate uses too); this model adds
# what is about time. Peak: the resident state (weights, gradients, optimizer) plus the
# activations the candidate keeps; the resident part and the activations' scale are fitted to
# the measured peaks (transient buffers are in neither count, so the fit carries them). Time:
# the step without offloading or recompute, plus recompute at the measured FLOP rate (or
# memory bandwidth for elementwise recompute), plus the copy floor, plus each offload hook's
# host time and the copies' pressure on the compute they overlap (offload_overhead_s).

# Recompute options whose cost is memory traffic, not matrix products: a norm or an
# activation function reads its input and writes its output once more.
ELEMENTWISE_RECOMPUTE = frozenset({"layernorm", "mlp_act", "moe_act"})


@dataclass(frozen=True)
class LayerCosts:
    """The cost model's view of a recipe: its activation table (what each module saves and
    what removes it) and, per layer kind, the forward FLOPs of one layer for each recompute
    option (``full``: the whole layer) in one micro-batch."""

    table: ActivationTable
    flops: dict[str, dict[str, float]]
    # One micro-batch's output-layer forward FLOPs on a rank: what the chunked output layer
    # runs again in the backward (each chunk's logits recomputed).
    output_flops: float = 0.0

    def forward_flops(self) -> float:
        """One micro-batch's forward FLOPs through the stage's layers."""
        layers = self.table.layers_of()
        return sum(n * self.flops.get(kind, {}).get("full", 0.0) for kind, n in layers.items())


@dataclass(frozen=True)
class Removal:
    """What a plan leaves of one micro-batch: the activation bytes on the GPU at the peak,
    the bytes moved each way, the forward FLOPs and elementwise bytes run again, and the
    offload hooks run."""

    activation_bytes: float
    offloaded_bytes: float
    recompute_flops: float
    recompute_traffic_bytes: float
    hooks: float


def removal(costs: LayerCosts, plan: ActivationSettings) -> Removal:
    """What ``plan`` keeps and moves (:mod:`.activation_bytes`), and the recompute it runs
    again and the offload hooks it runs. Full recompute re-runs the covered layers' forward
    FLOPs and hooks each checkpoint input it offloads; selective recompute re-runs its
    options' FLOPs (an elementwise option's traffic instead, unless a larger option that
    covers it runs it); offloading hooks each offload module of each layer, in proportion to
    the fraction; the chunked output layer re-runs the output layer's forward."""
    table = costs.table
    kept = table.estimate(plan)
    layers = table.layers_of()
    output = costs.output_flops if plan.output_chunked else 0.0
    if plan.full is not None:
        share = table.recomputed_layers(plan) / max(1, table.stage_layers)
        hooks = float(table.checkpoints(plan)) if LAYER_INPUT in plan.offload else 0.0
        flops = costs.forward_flops() * share + output
        return Removal(kept.total, kept.offloaded, flops, 0.0, hooks)
    freed = covered(plan.recompute)
    traffic = sum(
        row.layers * 2 * row.nbytes
        for row in table.rows
        if row.recompute in freed and row.recompute in ELEMENTWISE_RECOMPUTE & plan.recompute
    )
    hooks = flops = 0.0
    for kind, n in layers.items():
        present = {r.offload for r in table.rows if r.kind == kind and r.offload in plan.offload}
        hooks += n * sum(plan.fraction_of(module) for module in present)
        options = plan.recompute - ELEMENTWISE_RECOMPUTE
        flops += n * sum(costs.flops.get(kind, {}).get(o, 0.0) for o in options)
    return Removal(kept.total, kept.offloaded, flops + output, traffic, hooks)


@dataclass(frozen=True)
class Calibration:
    """What a few measured steps say about this recipe on this machine. Peak bytes =
    ``resident_bytes + activation_scale x`` activation bytes, plus ``offload_peak_bytes`` for
    a plan that offloads without full recompute; ``base_step_s``: a step without offloading or
    recompute, of ``microbatches`` micro-batches."""

    resident_bytes: float
    activation_scale: float
    base_step_s: float
    microbatches: int
    flops_per_s: float
    hbm_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_s_per_hook: float = 0.0
    # The share of the copies' own time (each way, per micro-batch) that shows in the step
    # beyond their floor: copies that fit inside the compute's windows by their bandwidth
    # still slowed the 3B shape's 16k step on an H100 (see docs/design/planner.md), which the
    # floor alone put at no cost.
    copy_pressure: float = 0.0
    # What an offload plan's peak holds beyond the activations it keeps, fitted from the
    # offload plans measured (None until one is; :func:`offload_peak_prior_bytes`, a lower
    # bound, stands in). Such a plan peaks as the backward starts, with the output layer's
    # gradients and the first reloads beside everything kept, where full recompute and the
    # plain step, which the line is fitted to, peak elsewhere. On the 3B shape it was the same
    # for every attention-offload plan of one length and grew with the tokens (measured on two
    # H100s, see docs/design/planner.md; the planner's replay of it in
    # tests/unit/test_cost_model_replay.py).
    offload_peak_bytes: float | None = None
    # At least this much (an offload plan that ran out of memory needed it), fitted or not.
    offload_peak_floor_bytes: float = 0.0


def holds_offload_peak(plan: ActivationSettings) -> bool:
    """Whether a plan's peak is an offload plan's (:attr:`Calibration.offload_peak_bytes`):
    it offloads without full recompute."""
    return bool(plan.offload) and plan.full is None


@dataclass(frozen=True)
class Prediction:
    peak_bytes: float
    step_s: float
    removal: Removal


def peak_bytes(resident_bytes: float, activation_bytes: float, scale: float = 1.0) -> float:
    """A GPU's peak: the resident state plus one micro-batch's activations (scaled as the
    measured peaks say the ledger's count should be)."""
    return resident_bytes + scale * activation_bytes


def step_time_s(removed: Removal, calibration: Calibration) -> float:
    """A step's time: the plain step, then per micro-batch the recompute (FLOPs at the
    measured rate, elementwise traffic at the memory bandwidth), the copies' floor against
    the forward (a third of the plain micro-batch) and backward (two thirds) windows, and
    the hooks' host time."""
    c = calibration
    per_microbatch = c.base_step_s / max(1, c.microbatches)
    times = PassTimes(per_microbatch / 3, 2 * per_microbatch / 3)
    extra = removed.recompute_flops / c.flops_per_s
    extra += removed.recompute_traffic_bytes / c.hbm_bytes_per_s
    extra += overhead_floor_s(removed.offloaded_bytes, times, c.d2h_bytes_per_s, c.h2d_bytes_per_s)
    extra += offload_overhead_s(removed, c)
    return c.base_step_s + c.microbatches * extra


def copy_seconds(removed: Removal, calibration: Calibration) -> float:
    """One micro-batch's copies at the calibrated bandwidths, to the host and back."""
    c = calibration
    return removed.offloaded_bytes / c.d2h_bytes_per_s + removed.offloaded_bytes / c.h2d_bytes_per_s


def offload_overhead_s(removed: Removal, calibration: Calibration) -> float:
    """What offloading adds to one micro-batch beyond the copies' floor: each hook's host time
    and the copies' pressure on the compute they overlap."""
    c = calibration
    return removed.hooks * c.host_s_per_hook + c.copy_pressure * copy_seconds(removed, c)


def offload_peak_prior_bytes(costs: LayerCosts, removed: Removal) -> float:
    """What an offload plan's peak holds beyond the line before any offload plan of the recipe
    has been measured: two layers' offloaded bytes (the last layer's groups, which Megatron
    keeps on the GPU, and the first reload beside them). It is a lower bound: the offsets the
    planner fitted on the 3B shape were at least this, and at one tensor-parallel rank
    several times more, growing with the tokens faster than a layer's copies do (measured on
    an H100 and on two H200s; see docs/design/planner.md), which no one term matched at both
    parallel layouts; the first measured offload plan replaces it."""
    return 2 * removed.offloaded_bytes / max(1, costs.table.stage_layers - 1)


def offload_peak_offset(
    costs: LayerCosts, plan: ActivationSettings, removed: Removal, calibration: Calibration
) -> float:
    """What ``plan``'s peak holds beyond the line: nothing unless it offloads without full
    recompute; then the fitted offset, or the prior before one is fitted, and at least what a
    failed offload plan needed."""
    if not holds_offload_peak(plan):
        return 0.0
    offset = calibration.offload_peak_bytes
    if offset is None:
        offset = offload_peak_prior_bytes(costs, removed)
    return max(offset, calibration.offload_peak_floor_bytes)


def predict(costs: LayerCosts, plan: ActivationSettings, calibration: Calibration) -> Prediction:
    removed = removal(costs, plan)
    peak = peak_bytes(
        calibration.resident_bytes, removed.activation_bytes, calibration.activation_scale
    )
    peak += offload_peak_offset(costs, plan, removed, calibration)
    return Prediction(peak, step_time_s(removed, calibration), removed)


def fit_memory(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(resident bytes, activation scale) from measured (ledger activation bytes, peak bytes)
    pairs: a least-squares line through two or more distinct points, else the ledger taken
    as it counts (scale 1). The scale is kept within [0.5, 2]: outside it the ledger does not
    describe the run, and a line through noise would extrapolate wildly."""
    if not points:
        raise ValueError("fit_memory needs at least one measured point")
    xs = [x for x, _ in points]
    if max(xs) - min(xs) < 1e-6 * max(1.0, max(xs)):
        return sum(y - x for x, y in points) / len(points), 1.0
    mx, my = sum(xs) / len(xs), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    slope = min(2.0, max(0.5, slope))
    return my - slope * mx, slope


def base_step_s(recompute_step_s: float, forward_flops: float, recompute_flops: float) -> float:
    """The step without recompute estimated from full recompute's measured step, when the
    plain step does not fit: a training step runs its forward FLOPs three times (forward,
    and twice that in backward), full recompute a fourth time for the covered layers."""
    total = 3 * forward_flops + recompute_flops
    return recompute_step_s * 3 * forward_flops / total if total > 0 else recompute_step_s


def flops_per_s(
    recompute_step_s: float,
    base_s: float | None,
    forward_flops: float,
    recompute_flops: float,
    microbatches: int,
) -> float:
    """The achieved FLOP rate: from the time full recompute adds over the plain step where
    both were measured, else from full recompute's whole step."""
    if base_s is not None and recompute_step_s > base_s and recompute_flops > 0:
        return microbatches * recompute_flops / (recompute_step_s - base_s)
    work = microbatches * (3 * forward_flops + recompute_flops)
    return work / recompute_step_s if recompute_step_s > 0 else float("inf")


def offload_scale(
    measured_step_s: float, removed: Removal, calibration: Calibration
) -> float | None:
    """How many times the calibration's offload overhead (:func:`offload_overhead_s`: hooks'
    host time and copy pressure) a measured offload run shows beyond the rest of the model
    (None: the run hooked nothing, or the calibration puts no overhead on it). One scale for
    both terms: a run or two cannot tell host time from copy pressure apart (the plans that
    hook more also copy more), so the priors' mix stays and the measurements set its size."""
    overhead = offload_overhead_s(removed, calibration)
    if removed.hooks <= 0 or overhead <= 0:
        return None
    without = step_time_s(removed, replace(calibration, host_s_per_hook=0.0, copy_pressure=0.0))
    return max(0.0, (measured_step_s - without) / (calibration.microbatches * overhead))
