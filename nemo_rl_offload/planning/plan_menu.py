"""The planner's menu: every activation-memory setting the rules allow for a recipe, as
candidates, and the cost model's view of the recipe's layers.

Why apart from :mod:`nemo_rl_offload.planning.planner`: what can be tried (offload sets, fractions,
selective recompute sets, full recompute of all or some layers, with or without the layer
inputs offloaded) is one job; measuring and choosing is another. Each candidate is checked by
:func:`nemo_rl_offload.preflight.check_policy`, the rules every recipe passes, so the
planner never proposes settings a job would refuse. Checking is lazy (:func:`frontier`):
only candidates that could be chosen (faster than every valid one with a lower predicted
peak) are checked.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nemo_rl_offload.config.module_names import LAYER_INPUT
from nemo_rl_offload.planning import cost_model
from nemo_rl_offload.planning.activation_bytes import (
    BLOCK,
    UNIFORM,
    ActivationSettings,
    ActivationTable,
    covered,
)
from nemo_rl_offload.planning.cost_model import LayerCosts

# A settings patch: recipe keys nested as in the recipe, merged onto a loaded recipe.
Patch = dict[str, Any]

DENSE_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
# This package's dense MLP offload points, in the layer's order after Megatron's.
DENSE_MLP_MODULES = ("mlp_fc1", "mlp_act", "mlp_fc2")
EXPERT_MODULES = ("expert_fc1", "moe_act")
FRACTIONS = (1.0, 0.5)
# Selective recompute options searched: Megatron's and this package's (models.local_recompute).
DENSE_RECOMPUTE = ("layernorm", "core_attn", "mlp_act", "mlp")
MOE_RECOMPUTE = ("layernorm", "core_attn", "moe_act", "moe")
# Full recompute of only the first N layers (recompute_method: block): N in steps of this
# share of the layers.
BLOCK_STEPS = 8
# The recompute options whose FLOPs the cost model needs per layer kind.
FLOP_OPTIONS = ("layernorm", "core_attn", "mlp", "mlp_act", "moe", "moe_act", "full")
# The policy.logprob_chunk_size the planner proposes for a recipe without one (the loss keeps
# its logits in their precision, no float32 copy: what it saves and costs at 8k was measured
# on an H100, see docs/design/planner.md).
LEAN_LOSS_CHUNK = 1024


def megatron_patch(settings: dict[str, Any]) -> Patch:
    """``settings`` placed under ``policy.megatron_cfg`` (no settings: an empty patch)."""
    return {"policy": {"megatron_cfg": settings}} if settings else {}


@dataclass
class Candidate:
    """One activation-memory setting: offload ``modules`` (``fraction`` of them), selective
    ``recompute_modules``, or full recompute (of ``recompute_num_layers`` layers with the block
    method, else of every layer), with what the cost model predicted and the runs measured."""

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
    recompute_modules: tuple[str, ...] = ()  # selective recompute
    recompute_num_layers: int | None = None  # full recompute of the first N layers only
    predicted_fwd_bwd_s: float | None = None
    # policy.logprob_chunk_size the candidate sets (None: the recipe's loss as it is)
    logprob_chunk: int | None = None
    # (module, fraction) pairs in place of ``fraction`` for those modules
    # (activation_offload_fraction_by_module)
    fraction_by_module: tuple[tuple[str, float], ...] = ()
    # the output layer in the loss's chunks too (policy.megatron_cfg.chunked_output_layer)
    output_chunked: bool = False
    # the share of the optimizer state on the host (optimizer_cpu_offload with this
    # optimizer_offload_fraction: :mod:`nemo_rl_offload.planning.plan_optimizer`), None: on the GPU
    host_optimizer: float | None = None
    # what the host optimizer added to the step (measured, and predicted), seconds
    optimizer_extra_s: float | None = None
    predicted_optimizer_extra_s: float | None = None

    @property
    def measured_cost_s(self) -> float | None:
        """The measured forward-backward plus what a host optimizer added to the step: what
        plans are ranked by (the rest of the step is the same whatever the plan)."""
        if self.measured_fwd_bwd_s is None:
            return None
        return self.measured_fwd_bwd_s + (self.optimizer_extra_s or 0.0)

    @property
    def predicted_cost_s(self) -> float | None:
        """:attr:`measured_cost_s`, predicted."""
        if self.predicted_fwd_bwd_s is None:
            return None
        return self.predicted_fwd_bwd_s + (self.predicted_optimizer_extra_s or 0.0)

    @property
    def failed(self) -> str | None:
        """The failure as one line, or None."""
        from nemo_rl_offload.planning.failures import Failure

        return Failure.from_dict(self.failure).summary() if self.failure else None

    @functools.cached_property
    def name(self) -> str:
        chunks = f" of {self.logprob_chunk}" if self.logprob_chunk else ""
        loss = f", log-softmax in chunks{chunks}" if self.logprob_chunk else ""
        if self.output_chunked:  # in the recipe's own chunks when the candidate sets none
            loss = f", output layer and log-softmax in chunks{chunks}"
        if self.full_recompute:
            name = "full recompute"
            if self.recompute_num_layers is not None:
                name += f" of {self.recompute_num_layers} layers"
            modules = " + " + "+".join(self.modules) if self.modules else ""
            return name + modules + loss + self._host_optimizer_name()
        parts = []
        if self.recompute_modules:
            parts.append("recompute " + "+".join(self.recompute_modules))
        if self.modules:
            suffix = "" if self.fraction == 1.0 else f" x{self.fraction:g}"
            own = "".join(f" ({module} x{share:g})" for module, share in self.fraction_by_module)
            parts.append("+".join(self.modules) + suffix + own)
        return (", ".join(parts) or "no offload") + loss + self._host_optimizer_name()

    def with_host_optimizer(self, share: float) -> Candidate:
        """This plan with ``share`` of the optimizer state on the host: a candidate of its own,
        not yet predicted or measured."""
        return dataclasses.replace(
            self,
            host_optimizer=share,
            predicted_peak_gib=None,
            predicted_fwd_bwd_s=None,
            predicted_optimizer_extra_s=None,
            measured_peak_gib=None,
            measured_fwd_bwd_s=None,
            optimizer_extra_s=None,
            measurements=1,
            failure=None,
        )

    def _host_optimizer_name(self) -> str:
        if self.host_optimizer is None:
            return ""
        return f", optimizer state x{self.host_optimizer:g} on the host"

    def settings(self) -> ActivationSettings:
        """The candidate as the activation arithmetic reads it: what :meth:`patch` sets (full
        recompute of every layer is Megatron's uniform method, one layer a segment)."""
        lean = self.logprob_chunk is not None
        if self.full_recompute:
            if self.recompute_num_layers is None:
                return ActivationSettings(
                    offload=frozenset(self.modules),
                    full=UNIFORM,
                    lean_loss=lean,
                    output_chunked=self.output_chunked,
                )
            return ActivationSettings(
                offload=frozenset(self.modules),
                full=BLOCK,
                num_layers=self.recompute_num_layers,
                lean_loss=lean,
                output_chunked=self.output_chunked,
            )
        return ActivationSettings(
            frozenset(self.modules),
            self.fraction,
            frozenset(self.recompute_modules),
            fraction_by_module=self.fraction_by_module,
            lean_loss=lean,
            output_chunked=self.output_chunked,
        )

    def patch(self) -> Patch:
        """The candidate's settings as a patch of the policy's megatron_cfg: every switch it
        depends on set, so that a recipe's own recompute or offload settings do not mix in."""
        settings: dict[str, Any] = {"fine_grained_activation_offloading": bool(self.modules)}
        if self.modules:
            settings["offload_modules"] = list(self.modules)
            if self.fraction != 1.0:
                settings["activation_offload_fraction"] = self.fraction
            if self.fraction_by_module:
                settings["activation_offload_fraction_by_module"] = dict(self.fraction_by_module)
        if self.full_recompute:
            settings.update(activation_checkpointing=True, recompute_granularity="full")
            if self.recompute_num_layers is not None:
                settings.update(
                    recompute_method="block", recompute_num_layers=self.recompute_num_layers
                )
        elif self.recompute_modules:
            settings.update(
                activation_checkpointing=True,
                recompute_granularity="selective",
                recompute_modules=list(self.recompute_modules),
            )
        else:
            settings["activation_checkpointing"] = False
        if self.output_chunked:
            settings["chunked_output_layer"] = True
        if self.host_optimizer is not None:
            settings["optimizer"] = {
                "optimizer_cpu_offload": True,
                "optimizer_offload_fraction": self.host_optimizer,
                "use_precision_aware_optimizer": True,
            }
        patch = megatron_patch(settings)
        if self.logprob_chunk is not None:
            patch["policy"]["logprob_chunk_size"] = self.logprob_chunk
        return patch


def offloadable_modules(is_moe: bool) -> tuple[str, ...]:
    """Offload modules in a layer's order: Megatron's attention and norms, then the MLP's
    (the experts' on a MoE model, this package's dense points otherwise)."""
    return DENSE_MODULES + (EXPERT_MODULES if is_moe else DENSE_MLP_MODULES)


def _subsets(items: tuple[str, ...]) -> Iterable[tuple[str, ...]]:
    for size in range(len(items) + 1):
        yield from itertools.combinations(items, size)


def live_modules(
    table: ActivationTable, recompute: tuple[str, ...], modules: tuple[str, ...]
) -> tuple[str, ...]:
    """The offload modules in ``modules`` that still have bytes to move once ``recompute``
    has freed what it frees (offloading nothing only adds a hook)."""
    removed = covered(frozenset(recompute))
    live = {
        r.offload
        for r in table.rows
        if r.offload and r.movable and r.recompute not in removed and r.nbytes > 0
    }
    return tuple(m for m in modules if m in live)


def one_module_shares(modules: tuple[str, ...]) -> list[tuple[tuple[str, float], ...]]:
    """The per-module fractions searched for an offload set of two or more modules: one module
    at each fraction below 1 of :data:`FRACTIONS`, the others whole (a set's bytes between its
    subsets', where the copies of the whole set would not hide behind the compute). Not
    ``attn_proj`` beside ``core_attn``: core_attn's groups copy the projection's input on every
    layer (the rules refuse that pair)."""
    if len(modules) < 2:
        return []
    return [
        ((module, share),)
        for module in modules
        if not (module == "attn_proj" and "core_attn" in modules)
        for share in FRACTIONS
        if share < 1.0
    ]


def menu(table: ActivationTable, is_moe: bool, dtensor: bool) -> list[Candidate]:
    """Every candidate the planner considers, before the rules: with each selective recompute
    set, each subset of the offload modules that still have bytes to move, at each fraction,
    and with one of its modules at a fraction of its own (:func:`one_module_shares`);
    full recompute of every layer, with and without the layer inputs offloaded, and of the
    first N layers. Where the table knows the bytes of the loss's log-softmax in chunks (a
    recipe without a ``logprob_chunk_size``), every candidate sets one
    (:data:`LEAN_LOSS_CHUNK`): the cost model times the loss the same either way and the
    chunked one keeps less, so a candidate without it could never be chosen. Where the table
    knows the bytes with the output layer in the loss's chunks too (the recipe's or those), each
    candidate also comes with that (no logits kept, the output layer's forward run again in the
    backward). A DTensor policy
    reads one recompute switch (full recompute) and so gets no selective, block or
    chunked-loss candidates."""
    layers = table.stage_layers
    recompute_sets = (
        [()] if dtensor else list(_subsets(MOE_RECOMPUTE if is_moe else DENSE_RECOMPUTE))
    )
    out = []
    for recompute in recompute_sets:
        for modules in _subsets(live_modules(table, recompute, offloadable_modules(is_moe))):
            for fraction in FRACTIONS if modules else (1.0,):
                out.append(Candidate(modules, fraction, None, recompute_modules=recompute))
            out.extend(
                Candidate(modules, 1.0, None, recompute_modules=recompute, fraction_by_module=own)
                for own in one_module_shares(modules)
            )
    out.append(Candidate((), 1.0, None, full_recompute=True))
    if not dtensor:
        out.append(Candidate((LAYER_INPUT,), 1.0, None, full_recompute=True))
        step = max(1, layers // BLOCK_STEPS)
        for covered in range(step, layers, step):
            out.append(Candidate((), 1.0, None, full_recompute=True, recompute_num_layers=covered))
    if dtensor:
        return out
    if table.lean_model is not None:
        out = [dataclasses.replace(c, logprob_chunk=LEAN_LOSS_CHUNK) for c in out]
    if table.chunked_model is not None:
        out += [dataclasses.replace(c, output_chunked=True) for c in out]
    return out


def frontier(
    candidates: list[Candidate],
    predicted: Callable[[Candidate], tuple[float, float]],
    valid: Callable[[Candidate], bool],
) -> list[Candidate]:
    """The valid candidates no other valid one beats on both predicted peak and time (the
    only ones worth measuring for some budget), fastest first. ``predicted``: (peak, time);
    ``valid``: whether the rules accept it, asked only of candidates that would join."""
    out: list[Candidate] = []
    lowest = float("inf")
    for candidate in sorted(candidates, key=lambda c: (predicted(c)[1], predicted(c)[0])):
        peak = predicted(candidate)[0]
        if peak < lowest and valid(candidate):
            out.append(candidate)
            lowest = peak
    return out


def layer_costs(
    effective: Any,
    ledger: Any,
    flops_per_token: Callable[[str, str], float],
    activation_bytes: int,
    lean_ledger: Any = None,
    chunked_ledger: Any = None,
    output_flops: float = 0.0,
) -> LayerCosts:
    """The cost model's view of a recipe from its effective settings and activation ledger
    (:class:`planning.ledger.Ledger`) at its tokens per micro-batch: the activation table
    (:class:`planning.activation_bytes.ActivationTable`, the bytes ``validate``'s estimate
    counts too) and each layer kind's recompute FLOPs. ``flops_per_token(kind, option)``:
    forward FLOPs per token of a recompute option in a layer of that kind. ``lean_ledger``:
    the same recipe's ledger with a ``logprob_chunk_size`` (its loss's bytes), for the
    chunked-loss candidates; None offers none. ``chunked_ledger``: the recipe's ledger with a
    chunk size and ``chunked_output_layer``, for the chunked-output candidates;
    ``output_flops``: one micro-batch's output-layer forward FLOPs on a rank, which they run
    again."""
    table = ActivationTable.of(effective, ledger, activation_bytes=activation_bytes)
    if lean_ledger is not None:
        table = table.with_lean_loss(lean_ledger, effective)
    if chunked_ledger is not None:
        table = table.with_chunked_output(chunked_ledger, effective)
    flops = {
        kind: {o: flops_per_token(kind, o) * table.tokens for o in FLOP_OPTIONS}
        for kind in table.layers_of()
    }
    return LayerCosts(table, flops, output_flops)


def predictor(
    costs: LayerCosts, calibration: cost_model.Calibration
) -> Callable[[Candidate], tuple[float, float]]:
    """(peak GiB, step s) of a candidate under ``calibration``, memoised by name."""
    cache: dict[str, tuple[float, float]] = {}

    def predict(candidate: Candidate) -> tuple[float, float]:
        if candidate.name not in cache:
            p = cost_model.predict(costs, candidate.settings(), calibration)
            cache[candidate.name] = (p.peak_bytes / 2**30, p.step_s)
        return cache[candidate.name]

    return predict
