"""How many activation bytes a plan keeps on one GPU per training micro-batch, and how many it
moves to the host: the one place this arithmetic lives.

One owner, so that ``validate``'s estimate (:mod:`.memory_estimate`) and the planner's cost
model (:mod:`.cost_model`) never disagree about the same settings' bytes: both build an
:class:`ActivationTable` once and evaluate settings (:class:`ActivationSettings`) against it.
The rules it knows: docs/design/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from nemo_rl_offload.config.megatron_settings import EffectiveSettings
from nemo_rl_offload.config.module_names import LAYER_INPUT
from nemo_rl_offload.planning.ledger import MODEL, Ledger

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "uint8": 1,
    "fp8": 1,
}
# Ledger owners whose bytes tensor parallelism splits only with sequence_parallel (the norms
# and the residual stream, replicated on every tensor-parallel rank otherwise).
_REPLICATED_OWNERS = ("input_layernorm", "pre_mlp_layernorm", "(layer)")
# A selective recompute option also frees what the cheaper options inside it free.
RECOMPUTE_COVERS = {"mlp": frozenset({"mlp", "mlp_act"}), "moe": frozenset({"moe", "moe_act"})}
MEGATRON_DEFAULT_RECOMPUTE = ("core_attn",)
DEFAULT_MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024
UNIFORM, BLOCK = "uniform", "block"


def dtype_bytes(name: Any, default: int = 4) -> int:
    """Bytes per element of a recipe dtype name (``bfloat16``, ``fp32``, ``torch.float16``)."""
    text = str(name or "").removeprefix("torch.")
    return _DTYPE_BYTES.get(text, default)


def parallel_sizes(effective: EffectiveSettings) -> dict[str, int]:
    """The model-parallel sizes of the effective settings (at least 1 each)."""
    v = effective.value
    return {
        name: max(1, int(v(name) or 1))
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
        )
    }


def stage_layer_counts(effective: EffectiveSettings) -> dict[str, int]:
    """Layers of each kind on the largest pipeline stage."""
    from nemo_rl_offload.config.model_shape import layer_kinds

    pp = parallel_sizes(effective)["pipeline_model_parallel_size"]
    return {kind: math.ceil(n / pp) if n else 0 for kind, n, _ in layer_kinds(effective)}


def tp_share(owner: str, effective: EffectiveSettings) -> float:
    """The share of a ledger owner's bytes one tensor-parallel rank holds."""
    s = parallel_sizes(effective)
    if owner.startswith("mlp.experts"):
        return 1 / s["expert_tensor_parallel_size"]
    if owner in _REPLICATED_OWNERS and not effective.value("sequence_parallel"):
        return 1.0
    return 1 / s["tensor_model_parallel_size"]


def covered(recompute: frozenset[str]) -> frozenset[str]:
    """The recompute options whose saved tensors ``recompute`` frees."""
    out: set[str] = set()
    for option in recompute:
        out |= RECOMPUTE_COVERS.get(option, frozenset({option}))
    return frozenset(out)


@dataclass(frozen=True)
class ActivationSettings:
    """The settings that remove activation bytes, as the arithmetic reads them: offload
    modules (with ``LAYER_INPUT`` under full recompute) and the fraction moved, selective
    recompute options as named, and full recompute (``full``: ``uniform`` or ``block``;
    ``num_layers``: the segment's layers for uniform, the covered layers for block)."""

    offload: frozenset[str] = frozenset()
    fraction: float = 1.0
    recompute: frozenset[str] = frozenset()
    full: str | None = None
    num_layers: int = 1
    # (module, fraction) pairs in place of ``fraction`` for those modules.
    fraction_by_module: tuple[tuple[str, float], ...] = ()
    # The loss's log-softmax in chunks (policy.logprob_chunk_size) where the recipe's ledger
    # has the plain loss: the table's ``lean_model`` bytes in place of its ``model``.
    lean_loss: bool = False
    # The output layer in those chunks too (policy.megatron_cfg.chunked_output_layer) where
    # the recipe's ledger has it whole: the table's ``chunked_model`` bytes.
    output_chunked: bool = False

    def fraction_of(self, module: str | None) -> float:
        """The share of ``module``'s groups offloaded."""
        return dict(self.fraction_by_module).get(module or "", self.fraction)

    @classmethod
    def of(cls, effective: EffectiveSettings) -> ActivationSettings:
        """A recipe's settings, from its effective settings (Megatron's defaults filled in)."""
        v = effective.value
        offload = frozenset(effective.offload_modules)
        fraction = v("activation_offload_fraction", 1.0)
        granularity = v("recompute_granularity")
        recompute: frozenset[str] = frozenset()
        if granularity == "selective":
            modules = v("recompute_modules")
            recompute = frozenset(
                modules if isinstance(modules, list) else MEGATRON_DEFAULT_RECOMPUTE
            )
        full = None
        if granularity == "full":
            full = BLOCK if v("recompute_method") == BLOCK else UNIFORM
        return cls(
            offload=offload,
            fraction=1.0 if fraction is None else float(fraction),
            fraction_by_module=effective.fraction_by_module,
            recompute=recompute,
            full=full,
            num_layers=max(1, int(v("recompute_num_layers") or 1)),
        )


@dataclass(frozen=True)
class Row:
    """One ledger entry on one rank of the largest stage: ``nbytes`` per layer (this rank's
    share) over ``layers`` layers of its ``kind``; ``movable``: the offload manager moves its
    tensors (not under ``min_offloaded_tensor_size``, and more layers than the last one)."""

    owner: str
    kind: str
    layers: int
    nbytes: float
    offload: str | None
    recompute: str | None
    movable: bool = True
    # The offload modules of the other modules that saved the same storage (None: one that
    # has none): its bytes leave the GPU only when all of them are offloaded too.
    also_needs: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class ModuleBytes:
    """One ledger owner's saved bytes over the stage's layers for one micro-batch on one rank:
    as measured (``saved``) and after the settings (``kept``; ``removed_by`` says which setting
    removed the rest)."""

    module: str
    saved: float
    kept: float
    removed_by: str = ""


@dataclass(frozen=True)
class ActivationEstimate:
    """What a training step's activations hold at their peak on one rank, and what one
    micro-batch moves to the host (``offloaded``, each way)."""

    tokens: int
    tokens_source: str
    in_flight: int  # micro-batches whose activations one pipeline stage holds at once
    modules: list[ModuleBytes]
    layer_inputs: float = 0.0  # full recompute: the checkpointed segment inputs kept
    recomputed_segment: float = 0.0  # full recompute: one segment's activations in backward
    model: float = 0.0  # the ledger's embedding / output / loss entries (logits)
    offloaded: float = 0.0  # bytes one micro-batch copies to the host (and back)

    @property
    def saved(self) -> float:
        """Without any offload or recompute setting."""
        return self.in_flight * sum(m.saved for m in self.modules) + self.model

    @property
    def total(self) -> float:
        kept = sum(m.kept for m in self.modules) + self.layer_inputs + self.recomputed_segment
        return self.in_flight * kept + self.model

    def removed_by(self) -> dict[str, float]:
        """Bytes each setting removes (per micro-batch in flight, all layers)."""
        out: dict[str, float] = {}
        for m in self.modules:
            if m.removed_by:
                out[m.removed_by] = out.get(m.removed_by, 0.0) + m.saved - m.kept
        return out


def _merge(parts: list[ModuleBytes]) -> list[ModuleBytes]:
    """One row per owner (an owner saves in several dtypes), in forward order."""
    rows: dict[str, ModuleBytes] = {}
    for p in parts:
        old = rows.get(p.module)
        if old is None:
            rows[p.module] = p
        else:
            rows[p.module] = ModuleBytes(
                p.module, old.saved + p.saved, old.kept + p.kept, old.removed_by or p.removed_by
            )
    return list(rows.values())


@dataclass(frozen=True)
class ActivationTable:
    """A recipe's activation bytes on one rank of its largest stage, ready to evaluate any
    settings (:meth:`estimate`): ``rows`` from the ledger, ``layer_input`` one checkpoint
    input's bytes, ``model`` the embedding / output / loss entries no setting removes."""

    tokens: int
    tokens_source: str
    in_flight: int
    rows: tuple[Row, ...]
    layer_input: float
    model: float
    stage_layers: int
    # ``model`` with the loss's log-softmax in chunks (:meth:`with_lean_loss`); None: unknown.
    lean_model: float | None = None
    # ``model`` with the output layer in those chunks too (:meth:`with_chunked_output`).
    chunked_model: float | None = None

    def with_lean_loss(self, lean_ledger: Ledger, effective: EffectiveSettings) -> ActivationTable:
        """This table with ``lean_model`` from the ledger of the same recipe with a
        ``logprob_chunk_size`` (its model entries: the logits kept in their precision)."""
        return replace(self, lean_model=_model_bytes(lean_ledger, self.tokens, effective))

    def with_chunked_output(
        self, chunked_ledger: Ledger, effective: EffectiveSettings
    ) -> ActivationTable:
        """This table with ``chunked_model`` from the ledger of the same recipe with a
        ``logprob_chunk_size`` and ``chunked_output_layer`` (its model entries: the final
        hidden states and the labels, no logits)."""
        return replace(self, chunked_model=_model_bytes(chunked_ledger, self.tokens, effective))

    @classmethod
    def of(
        cls, effective: EffectiveSettings, ledger: Ledger, *, activation_bytes: int
    ) -> ActivationTable:
        """The table of a recipe's shape and parallel settings (its offload and recompute
        settings play no part: they are evaluated later)."""
        from nemo_rl_offload.planning.ledger import removal

        tokens = ledger.tokens_per_microbatch
        sizes = parallel_sizes(effective)
        tp, pp = sizes["tensor_model_parallel_size"], sizes["pipeline_model_parallel_size"]
        counts = stage_layer_counts(effective)
        minimum = effective.value("min_offloaded_tensor_size", DEFAULT_MIN_OFFLOADED_TENSOR_SIZE)
        rows: list[Row] = []
        model = _model_bytes(ledger, tokens, effective)
        for kind in ledger.kinds:
            if kind.kind == MODEL:
                continue
            layers = counts.get(kind.kind, 0)
            for e in kind.entries:
                nbytes = e.bytes_at(tokens) * tp_share(e.owner, effective)
                per_tensor = nbytes / max(1, e.tensors) / dtype_bytes(e.dtype)
                movable = per_tensor >= (minimum or 0) and layers > 1
                needs = tuple(removal(o, kind.kind, chunked=False)[0] for o in e.shared_with)
                rows.append(
                    Row(e.owner, kind.kind, layers, nbytes, e.offload, e.recompute, movable, needs)
                )
        sp = tp if effective.value("sequence_parallel") else 1
        layer_input = int(effective.value("hidden_size")) * tokens * activation_bytes / sp
        return cls(
            tokens=tokens,
            tokens_source=ledger.tokens_source,
            in_flight=pp,
            rows=tuple(rows),
            layer_input=layer_input,
            model=model,
            stage_layers=sum(counts.values()),
        )

    def layers_of(self) -> dict[str, int]:
        """Layers of each kind (on the largest stage)."""
        return {row.kind: row.layers for row in self.rows}

    def largest_layer(self) -> float:
        """One layer's saved bytes, of the largest kind."""
        per_kind: dict[str, float] = {}
        for row in self.rows:
            per_kind[row.kind] = per_kind.get(row.kind, 0.0) + row.nbytes
        return max(per_kind.values(), default=0.0)

    def recomputed_layers(self, settings: ActivationSettings) -> int:
        """Layers full recompute re-runs (0 without it)."""
        if settings.full is None:
            return 0
        if settings.full == BLOCK:
            return min(settings.num_layers, self.stage_layers)
        return self.stage_layers

    def checkpoints(self, settings: ActivationSettings) -> int:
        """Checkpointed segments under full recompute, each keeping its input (0 without)."""
        if settings.full is None:
            return 0
        if settings.full == BLOCK:
            return self.recomputed_layers(settings)
        return math.ceil(self.stage_layers / min(settings.num_layers, max(1, self.stage_layers)))

    def _row(self, row: Row, settings: ActivationSettings, freed: frozenset[str]) -> ModuleBytes:
        saved = row.nbytes * row.layers
        if row.recompute in freed:
            return ModuleBytes(row.owner, saved, 0.0, f"recompute {row.recompute}")
        offloaded = settings.offload
        if (
            row.offload in offloaded
            and row.movable
            and all(needed in offloaded for needed in row.also_needs)
        ):
            moved = saved * settings.fraction_of(row.offload) * (row.layers - 1) / row.layers
            return ModuleBytes(row.owner, saved, saved - moved, f"offload {row.offload}")
        return ModuleBytes(row.owner, saved, saved)

    def estimate(self, settings: ActivationSettings) -> ActivationEstimate:
        """The activations ``settings`` keep at the peak and move per micro-batch."""
        freed = covered(settings.recompute)
        modules = _merge([self._row(row, settings, freed) for row in self.rows])
        moved = sum(m.saved - m.kept for m in modules if m.removed_by.startswith("offload"))
        model = self.model
        if settings.output_chunked and self.chunked_model is not None:
            model = self.chunked_model
        elif settings.lean_loss and self.lean_model is not None:
            model = self.lean_model
        common: dict[str, Any] = {
            "tokens": self.tokens,
            "tokens_source": self.tokens_source,
            "in_flight": self.in_flight,
            "model": model,
        }
        if settings.full is None:
            return ActivationEstimate(modules=modules, offloaded=moved, **common)
        checkpoints = self.checkpoints(settings)
        largest = self.largest_layer()
        if LAYER_INPUT in settings.offload:
            inputs = min(checkpoints, 2) * self.layer_input
            moved_inputs = checkpoints * self.layer_input
        else:
            inputs, moved_inputs = checkpoints * self.layer_input, 0.0
        if settings.full == BLOCK:
            # The uncovered layers keep what they save (offloaded as set); backward re-runs one
            # covered layer at a time, after the uncovered layers' activations are freed.
            stage = self.stage_layers
            share = (stage - checkpoints) / stage if stage else 0.0
            modules = [
                ModuleBytes(m.module, m.saved, m.kept * share, m.removed_by or "full recompute")
                for m in modules
            ]
            kept = sum(m.kept for m in modules)
            return ActivationEstimate(
                modules=modules,
                layer_inputs=inputs,
                recomputed_segment=max(0.0, largest - kept),
                offloaded=moved * share + moved_inputs,
                **common,
            )
        segment = min(settings.num_layers, self.stage_layers)
        return ActivationEstimate(
            modules=[ModuleBytes(m.module, m.saved, 0.0, "full recompute") for m in modules],
            layer_inputs=inputs,
            recomputed_segment=segment * largest,
            offloaded=moved_inputs,
            **common,
        )


def _model_bytes(ledger: Ledger, tokens: int, effective: EffectiveSettings) -> float:
    """The ledger's embedding, output and loss entries at ``tokens`` on one tensor-parallel
    rank."""
    tp = parallel_sizes(effective)["tensor_model_parallel_size"]
    return (
        sum(e.bytes_at(tokens) for kind in ledger.kinds if kind.kind == MODEL for e in kind.entries)
        / tp
    )


def activations(
    effective: EffectiveSettings, ledger: Ledger, *, activation_bytes: int
) -> ActivationEstimate:
    """A recipe's training activations on one rank of its largest pipeline stage."""
    table = ActivationTable.of(effective, ledger, activation_bytes=activation_bytes)
    return table.estimate(ActivationSettings.of(effective))
