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
# A candidate's peak and step time from the activation ledger (offload.ledger) and a few
# measured steps. Peak: the resident state (weights, gradients, optimizer) plus one
# micro-batch's activations as the ledger counts them, minus what the candidate removes;
# the resident part and the ledger's scale are fitted to the measured peaks (transient
# buffers such as the logits are in neither the ledger nor the resident state, so the fit
# carries them). Time: the step without offloading or recompute, plus recompute at the
# measured FLOP rate (or memory bandwidth for elementwise recompute), plus the copy floor,
# plus each offload hook's host time.

# Selective recompute options that also free what a cheaper option frees: recomputing the
# whole (dense or expert) MLP reruns its activation too.
RECOMPUTE_COVERS = {"mlp": frozenset({"mlp", "mlp_act"}), "moe": frozenset({"moe", "moe_act"})}
# Recompute options whose cost is memory traffic, not matrix products: a norm or an
# activation function reads its input and writes its output once more.
ELEMENTWISE_RECOMPUTE = frozenset({"layernorm", "mlp_act", "moe_act"})


@dataclass(frozen=True)
class Saved:
    """What one module of a layer saves for backward in one micro-batch (bytes), and what
    removes it: an offload module, a selective recompute option (``full``: only whole-layer
    recompute)."""

    nbytes: float
    offload: str | None
    recompute: str | None


@dataclass(frozen=True)
class LayerCost:
    """One kind of layer in one micro-batch: how many there are, what each saves, the bytes
    of its input (what full recompute keeps), and the forward FLOPs of each recompute option
    (``full``: the whole layer)."""

    layers: int
    saved: tuple[Saved, ...]
    input_bytes: float
    flops: dict[str, float]

    @property
    def nbytes(self) -> float:
        return sum(s.nbytes for s in self.saved)


@dataclass(frozen=True)
class MemoryPlan:
    """A candidate's activation settings, as the cost model reads them. ``full_layers``: None
    without full recompute, else how many layers full recompute covers (all of them for
    ``uniform``; fewer for ``block``); ``offload`` then holds only ``layer_input``."""

    offload: frozenset[str] = frozenset()
    fraction: float = 1.0
    recompute: frozenset[str] = frozenset()
    full_layers: int | None = None


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


def covered(recompute: frozenset[str]) -> frozenset[str]:
    """The recompute options whose saved tensors ``recompute`` frees."""
    out: set[str] = set()
    for option in recompute:
        out |= RECOMPUTE_COVERS.get(option, frozenset({option}))
    return frozenset(out)


def removal(kinds: list[LayerCost], model_bytes: float, plan: MemoryPlan) -> Removal:
    """One micro-batch's activations under ``plan``; ``model_bytes``: what the embedding,
    output layer and loss save, which no plan removes.

    Without pipeline parallelism one micro-batch is live at a time, so its activations are
    the peak's part that plans change. Offloading a fraction f of a module's bytes removes f
    of them from the peak. Full recompute keeps each covered layer's input, the other layers
    whole, and one layer re-materialised during its backward (the peak when every layer is
    covered; otherwise the uncovered layers' activations are larger and freed first)."""
    layers = sum(k.layers for k in kinds)
    if plan.full_layers is not None:
        recomputed = min(plan.full_layers, layers)
        layer_bytes = max((k.nbytes for k in kinds), default=0.0)
        average = sum(k.layers * k.nbytes for k in kinds) / max(1, layers)
        inputs = sum(k.layers * k.input_bytes for k in kinds) / max(1, layers)
        offloaded = recomputed * inputs if "layer_input" in plan.offload else 0.0
        kept_inputs = recomputed * inputs - offloaded
        if offloaded:
            kept_inputs = min(recomputed, 2) * inputs  # the one being saved, the one reloaded
        uncovered = (layers - recomputed) * average
        return Removal(
            activation_bytes=model_bytes + kept_inputs + max(uncovered, layer_bytes),
            offloaded_bytes=offloaded,
            recompute_flops=sum(k.layers * k.flops.get("full", 0.0) for k in kinds)
            * recomputed
            / max(1, layers),
            recompute_traffic_bytes=0.0,
            hooks=float(recomputed) if offloaded else 0.0,
        )
    removed_by = covered(plan.recompute)
    kept = offloaded = traffic = hooks = 0.0
    flops = 0.0
    for kind in kinds:
        for saved in kind.saved:
            if saved.recompute in removed_by:
                # An elementwise option's cost is its traffic, unless a larger recompute
                # that covers it (whose FLOPs count) runs it.
                if saved.recompute in ELEMENTWISE_RECOMPUTE & plan.recompute:
                    traffic += kind.layers * 2 * saved.nbytes
                continue
            kept += kind.layers * saved.nbytes
            if saved.offload in plan.offload:
                offloaded += kind.layers * saved.nbytes * plan.fraction
        present = {s.offload for s in kind.saved if s.offload in plan.offload}
        hooks += kind.layers * len(present) * plan.fraction
        flops += kind.layers * sum(
            kind.flops.get(o, 0.0) for o in plan.recompute if o not in ELEMENTWISE_RECOMPUTE
        )
    return Removal(model_bytes + kept - offloaded, offloaded, flops, traffic, hooks)


@dataclass(frozen=True)
class Calibration:
    """What a few measured steps say about this recipe on this machine. Peak bytes =
    ``resident_bytes + activation_scale x`` activation bytes; ``base_step_s``: a step without
    offloading or recompute, of ``microbatches`` micro-batches."""

    resident_bytes: float
    activation_scale: float
    base_step_s: float
    microbatches: int
    flops_per_s: float
    hbm_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_s_per_hook: float = 0.0


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
    extra += removed.hooks * c.host_s_per_hook
    return c.base_step_s + c.microbatches * extra


def predict(
    kinds: list[LayerCost], model_bytes: float, plan: MemoryPlan, calibration: Calibration
) -> Prediction:
    removed = removal(kinds, model_bytes, plan)
    peak = peak_bytes(
        calibration.resident_bytes, removed.activation_bytes, calibration.activation_scale
    )
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


def host_s_per_hook(
    measured_step_s: float, removed: Removal, calibration: Calibration
) -> float | None:
    """The host time per offload hook a measured offload run shows beyond the rest of the
    model (None: the run hooked nothing)."""
    if removed.hooks <= 0:
        return None
    without = step_time_s(removed, replace(calibration, host_s_per_hook=0.0))
    return max(0.0, (measured_step_s - without) / (calibration.microbatches * removed.hooks))
