"""The activation ledger: every tensor autograd saves in a training step, per layer, and the
ways to remove it.

A plan has to know where the bytes are before it picks what to offload or recompute. This
module is the ledger's data (:class:`Ledger`), what removes each entry, how entries come from
two measurements (:func:`entries`) and the table (:func:`format_ledger`);
:mod:`nemo_rl_offload.planning.ledger_run` measures. How: docs/design/planner.md.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.megatron_settings import EffectiveSettings, Setting
from nemo_rl_offload.config.model_shape import MOE

MODEL = "embedding, output, loss (once per model)"
DEFAULT_LENGTHS = (32, 64)
LAYER_PREFIX = re.compile(r"^decoder\.layers\.\d+(?:\.|$)")
LAYER_ITSELF = "(layer)"  # saved by the transformer layer's own forward (residual adds)

# Owner (a module path inside a layer) -> megatron-core's offload module whose region saves
# what that module saves (megatron/core/transformer: transformer_layer.py wraps the two norms,
# attention.py the qkv linear, the core attention and the output projection, moe/experts.py
# the grouped experts' fc1 and their activation).
OFFLOAD_BY_OWNER = (
    (re.compile(r"^input_layernorm$"), "attn_norm"),
    (re.compile(r"^self_attention\.linear_qkv$"), "qkv_linear"),
    (re.compile(r"^self_attention\.core_attention$"), "core_attn"),
    (re.compile(r"^self_attention\.linear_proj$"), "attn_proj"),
    (re.compile(r"^pre_mlp_layernorm$"), "mlp_norm"),
    (re.compile(r"^mlp\.experts\.linear_fc1$"), "expert_fc1"),
    (re.compile(r"^mlp\.experts$"), "moe_act"),
)
# Owner in a dense layer -> this package's MLP offload module (models/mlp_offload.py): fc1's
# input, what the activation saves (fc1's output), fc2's input.
DENSE_MLP_OFFLOAD_BY_OWNER = (
    (re.compile(r"^mlp\.linear_fc1$"), "mlp_fc1"),
    (re.compile(r"^mlp$"), "mlp_act"),
    (re.compile(r"^mlp\.linear_fc2$"), "mlp_fc2"),
)
# Owner -> the cheapest selective recompute module that frees what it saves (recompute_modules;
# ``layernorm`` and ``mlp_act`` through models/local_recompute.py on the local spec). A norm's
# output is saved by the linear after it (qkv, fc1), and the activation's by fc2; the norms'
# own saved tensors (their input, the layer's residual) stay under every selective option.
RECOMPUTE_BY_OWNER = (
    (re.compile(r"^self_attention\.linear_qkv$"), "layernorm"),
    (re.compile(r"^self_attention\.core_attention$"), "core_attn"),
    # The experts' activation: moe_act frees what it saves besides its input (fc1's output,
    # which the recompute reads) and fc2's input (its output).
    (re.compile(r"^mlp\.experts$"), "moe_act"),
    (re.compile(r"^mlp\.experts\.linear_fc2$"), "moe_act"),
)
# The same for a dense layer's MLP: fc1's input is the pre-MLP norm's output; what the
# activation saves (fc1's output) goes only with the whole MLP.
DENSE_MLP_RECOMPUTE_BY_OWNER = (
    (re.compile(r"^mlp\.linear_fc1$"), "layernorm"),
    (re.compile(r"^mlp\.linear_fc2$"), "mlp_act"),
    (re.compile(r"^mlp$"), "mlp"),
)


@dataclass(frozen=True)
class Entry:
    """What one module of a layer (or of the model) saves for backward, in one dtype.

    Bytes at ``tokens`` tokens: ``bytes_per_token * tokens + fixed_bytes``. Lifetime: saved in
    the owner's forward, freed when the owner's backward runs; ``order`` is the forward order
    (saved first, freed last). ``offload``: the offload module that moves it today, or None.
    ``recompute``: the selective recompute module that removes it, else ``full`` (whole-layer
    recompute) or None (outside the layers); ``recompute_flops_per_token``: the forward FLOPs
    that recompute runs again per token; ``note``: why an option does not work today."""

    owner: str
    dtype: str
    bytes_per_token: float
    fixed_bytes: float
    tensors: int
    shapes: list[list[int]]
    order: int
    offload: str | None
    recompute: str | None
    recompute_flops_per_token: float | None
    note: str = ""
    # Other modules that saved the same storage (a linear's input that is the previous
    # module's output): their offload regions reach it too.
    shared_with: list[str] = field(default_factory=list)

    @property
    def lifetime(self) -> str:
        """Saved in the owner's forward, freed when the owner's backward has run (a module
        that saved the same storage later runs its backward earlier)."""
        return f"forward of {self.owner} -> backward of {self.owner}"

    def bytes_at(self, tokens: int) -> float:
        return self.bytes_per_token * tokens + self.fixed_bytes


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer (or the model's own modules: ``layers`` 1) and what it saves."""

    kind: str
    layers: int
    entries: list[Entry]

    def bytes_at(self, tokens: int) -> float:
        """One such layer's saved bytes at ``tokens`` tokens."""
        return sum(e.bytes_at(tokens) for e in self.entries)

    def offloadable_at(self, tokens: int) -> float:
        return sum(e.bytes_at(tokens) for e in self.entries if e.offload)


@dataclass(frozen=True)
class Ledger:
    model: str
    dtype: str
    tokens_per_microbatch: int
    tokens_source: str
    lengths: tuple[int, int]
    kinds: list[LayerKind] = field(default_factory=list)
    # What the ledger does not show of the recipe (its parallel sizes divide it per rank).
    notes: list[str] = field(default_factory=list)

    def total_bytes(self, tokens: int | None = None) -> float:
        """Saved bytes of one micro-batch of ``tokens`` tokens (the recipe's by default)."""
        tokens = self.tokens_per_microbatch if tokens is None else tokens
        return sum(k.layers * k.bytes_at(tokens) for k in self.kinds)

    def offloadable_bytes(self, tokens: int | None = None) -> float:
        """The part of :meth:`total_bytes` today's offload modules can move."""
        tokens = self.tokens_per_microbatch if tokens is None else tokens
        return sum(k.layers * k.offloadable_at(tokens) for k in self.kinds)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["total_bytes_per_microbatch"] = self.total_bytes()
        data["offloadable_bytes_per_microbatch"] = self.offloadable_bytes()
        for kind, out in zip(self.kinds, data["kinds"], strict=True):
            out["bytes_per_layer"] = kind.bytes_at(self.tokens_per_microbatch)
            for entry, entry_out in zip(kind.entries, out["entries"], strict=True):
                entry_out["lifetime"] = entry.lifetime
        return data


def _first(table: tuple[tuple[re.Pattern[str], str], ...], owner: str) -> str | None:
    return next((name for pattern, name in table if pattern.match(owner)), None)


def removal(owner: str, kind: str, chunked: bool) -> tuple[str | None, str | None, str]:
    """(offload module, recompute option, note) for what ``owner`` saves in a ``kind``."""
    if kind == MODEL:
        note = ""
        if owner == "<model>" and not chunked:
            # The loss's logits (and their float32 softmax without a chunk size); the chunked
            # output layer keeps only the final hidden states and the labels.
            note = (
                "policy.logprob_chunk_size keeps the logits without a float32 copy; with "
                "policy.megatron_cfg.chunked_output_layer, recomputed a chunk at a time"
            )
        return None, None, note
    offload = _first(OFFLOAD_BY_OWNER, owner)
    recompute = _first(RECOMPUTE_BY_OWNER, owner)
    if kind != MOE:
        offload = offload or _first(DENSE_MLP_OFFLOAD_BY_OWNER, owner)
        recompute = recompute or _first(DENSE_MLP_RECOMPUTE_BY_OWNER, owner)
    if recompute is None and owner.startswith("mlp") and kind == MOE:
        recompute = "moe"
    return offload, recompute or "full", ""


def recompute_flops_per_token(option: str | None, effective: EffectiveSettings, seq: int) -> float:
    """Forward FLOPs per token that ``option`` runs again in backward (matrix products; the
    norms and activations are counted as a few operations per element: they are memory-bound,
    and cheap against the layer)."""
    if option is None:
        return 0.0
    v = effective.value
    hidden = v("hidden_size")
    heads = v("num_attention_heads")
    head_dim = v("kv_channels") or hidden // heads
    q_dim, kv_dim = heads * head_dim, (v("num_query_groups") or heads) * head_dim
    gated = 2 if v("gated_linear_unit") else 1
    norm = 4 * hidden
    attention = 2 * seq * q_dim  # causal: half of QK^T and PV over the sequence
    ffn = v("ffn_hidden_size") or 4 * hidden
    mlp = 2 * hidden * ffn * gated + 2 * ffn * hidden + 4 * ffn * gated
    if effective.is_moe:
        topk, expert_ffn = v("moe_router_topk") or 2, v("moe_ffn_hidden_size") or ffn
        moe = topk * (2 * hidden * expert_ffn * gated + 2 * expert_ffn * hidden)
        moe += 2 * hidden * v("num_moe_experts")  # the router
        moe_act = topk * 4 * expert_ffn * gated
    else:
        moe = moe_act = 0
    full = 2 * norm + 2 * hidden * (q_dim + 2 * kv_dim) + attention + 2 * q_dim * hidden
    full += moe if effective.is_moe else mlp
    return float(
        {
            "layernorm": 2 * norm,
            "core_attn": attention,
            "mlp": mlp,
            "moe": moe,
            "moe_act": moe_act,
            "mlp_act": 4 * ffn * gated,
            "full": full,
        }[option]
    )


def tokens_per_microbatch(section: dict[str, Any], where: str = "policy") -> tuple[int, str]:
    """Tokens one training micro-batch holds on one GPU, and the keys that say so."""
    from nemo_rl_offload.config.batching_settings import BatchingSettings

    batching = BatchingSettings.from_policy(section, where=where)
    cp = int((section.get("megatron_cfg") or {}).get("context_parallel_size") or 1)
    if batching.mode == "packing":
        tokens = batching.pack_length()
        source = f"{where}.sequence_packing.train_mb_tokens"
    elif batching.mode == "dynamic":
        tokens = batching.train_tokens
        source = f"{where}.dynamic_batching.train_mb_tokens"
    else:
        seq = int(section.get("max_total_sequence_length") or 0)
        tokens = batching.train_rows * seq
        source = (
            f"{where}.train_micro_batch_size {batching.train_rows} x "
            f"{where}.max_total_sequence_length {seq}"
        )
    if cp > 1:
        source += f" / {where}.megatron_cfg.context_parallel_size {cp}"
    return tokens // cp, source


# Settings a ledger layer is built without: it measures what a plan starts from.
_NOT_MEASURED = (*megatron_settings.RECOMPUTE_KEYS, *megatron_settings.FGO_KEYS)


def one_layer_settings(
    effective: EffectiveSettings, overrides: dict[str, Any]
) -> EffectiveSettings:
    """``effective`` for a one-layer model of one layer kind, on one rank, without offloading
    or recompute."""
    settings = {k: s for k, s in effective.settings.items() if k not in _NOT_MEASURED}
    for name, value in {
        **megatron_settings.SINGLE_RANK_LAYOUT,
        "num_layers": 1,
        **overrides,
    }.items():
        settings[name] = Setting(value, "ledger")
    return EffectiveSettings(settings, [], [])


def _owner(name: str) -> tuple[bool, str]:
    """(inside a layer, the owner's name there) of a module path of the measured model."""
    while name.startswith("module."):  # the precision wrapper's child
        name = name.removeprefix("module.")
    if name == "module":
        name = "<model>"
    if LAYER_PREFIX.match(name):
        inner = LAYER_PREFIX.sub("", name)
        return True, inner or LAYER_ITSELF
    return False, name


def _grouped(recorder: Any) -> dict[tuple[bool, str, str, tuple[str, ...]], list[Any]]:
    """Saved storages by (in a layer, owner, dtype, the other owners that saved them too):
    storages another module also saved are an entry of their own, since they leave the GPU
    only when every module that saved them offloads them."""
    groups: dict[tuple[bool, str, str, tuple[str, ...]], list[Any]] = {}
    for item in recorder.saved:
        in_layer, owner = _owner(item.owner)
        sharers = tuple(sorted({_owner(o)[1] for o in item.also} - {owner}))
        groups.setdefault((in_layer, owner, item.dtype, sharers), []).append(item)
    return groups


FUSED_ATTENTION_NOTE = (
    "core_attn recompute keeps these: q, k, v are its checkpoint's inputs and the output is "
    "attn_proj's input; a fused attention kernel saves nothing else but its softmax statistics"
)


def _kept_by_attention_checkpoint(
    short: list[Any], long: list[Any], lengths: tuple[int, int]
) -> bool:
    """Whether what the core attention saved is kept under its selective recompute, from its
    saved tensors at the two measuring lengths (in forward order): a fused kernel (torch's
    SDPA) saves no [.., s, s] probabilities (a tensor with two dimensions that grow with the
    length), only its inputs (q, k, v: [batch, heads, s, head dim]), which the checkpoint
    keeps, its output, which the output projection saves, and its softmax statistics (3-D),
    which go. Tensors that cannot be paired across the lengths count as kept (the estimate
    then errs high, not low). Measured on two H100s: plans with core_attn recompute held all
    of it (see docs/design/planner.md)."""
    if len(short) != len(long) or any(
        len(a.shape) != len(b.shape) for a, b in zip(short, long, strict=True)
    ):
        return True

    def growing(a: Any, b: Any) -> int:
        return sum(
            1
            for x, y in zip(a.shape, b.shape, strict=True)
            if x != y and y * lengths[0] == x * lengths[1]  # grows as the tokens do
        )

    quadratic = any(growing(a, b) >= 2 for a, b in zip(short, long, strict=True))
    return not quadratic and any(len(b.shape) >= 4 for b in long)


def entries(
    short: Any,
    long: Any,
    lengths: tuple[int, int],
    *,
    in_layer: bool,
    kind: str,
    effective: EffectiveSettings,
    seq: int,
    chunked: bool,
) -> list[Entry]:
    """Ledger entries from two measurements at ``lengths`` tokens, in forward order."""
    a, b = _grouped(short), _grouped(long)
    out = []
    for key in sorted(set(a) | set(b), key=lambda k: min(i.order for i in (b.get(k) or a[k]))):
        if key[0] != in_layer:
            continue
        _, owner, dtype, shared = key
        small = sum(i.nbytes for i in a.get(key, []))
        large = sum(i.nbytes for i in b.get(key, []))
        per_token = (large - small) / (lengths[1] - lengths[0])
        offload, recompute, note = removal(owner, kind, chunked)
        items = b.get(key) or a[key]
        if recompute == "core_attn" and _kept_by_attention_checkpoint(
            a.get(key, []), b.get(key, []), lengths
        ):
            recompute, note = "full", FUSED_ATTENTION_NOTE
        if offload is None:  # reached through another module that saved the same storage
            offload = next(
                (m for o in shared if (m := removal(o, kind, chunked)[0]) is not None), None
            )
        out.append(
            Entry(
                owner=owner,
                dtype=dtype,
                bytes_per_token=per_token,
                fixed_bytes=small - per_token * lengths[0],
                tensors=len(items),
                shapes=[list(i.shape) for i in items],
                order=min(i.order for i in items),
                offload=offload,
                recompute=recompute,
                recompute_flops_per_token=(
                    recompute_flops_per_token(recompute, effective, seq) if recompute else None
                ),
                note=note,
                shared_with=list(shared),
            )
        )
    return out


def parallel_notes(effective: EffectiveSettings) -> list[str]:
    """How the recipe's parallel sizes change what one rank holds, which the ledger (of a
    full layer on one rank) does not show."""
    notes = []
    tp = int(effective.value("tensor_model_parallel_size") or 1)
    if tp > 1:
        sp = (
            " and, with sequence_parallel, of the norms"
            if effective.value("sequence_parallel")
            else ""
        )
        notes.append(
            f"tensor_model_parallel_size {tp}: each rank holds about 1/{tp} of the attention "
            f"and MLP entries{sp}"
        )
    pp = int(effective.value("pipeline_model_parallel_size") or 1)
    if pp > 1:
        notes.append(
            f"pipeline_model_parallel_size {pp}: each stage holds its own layers, for as many "
            "micro-batches as are in flight on it"
        )
    ep = int(effective.value("expert_model_parallel_size") or 1)
    if ep > 1:
        notes.append(
            f"expert_model_parallel_size {ep}: each rank holds the expert entries of the "
            "tokens routed to its experts"
        )
    return notes


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_ledger(ledger: Ledger, out: TextIO) -> None:
    """The ledger as a table per layer kind, then the total per micro-batch and the share
    today's offload modules reach."""
    tokens = ledger.tokens_per_microbatch
    print(
        f"activation ledger: {ledger.model} ({ledger.dtype}), {tokens} tokens per micro-batch "
        f"({ledger.tokens_source}); measured on the CPU at {ledger.lengths[0]} and "
        f"{ledger.lengths[1]} tokens, one layer per kind, no offloading or recompute",
        file=out,
    )
    for kind in ledger.kinds:
        count = "" if kind.kind == MODEL else f" x {kind.layers}"
        print(f"\n{kind.kind}{count}: {_size(kind.bytes_at(tokens))} each", file=out)
        print(
            f"  {'owner':<32} {'dtype':<9} {'B/token':>9} {'fixed B':>8} {'n':>2} "
            f"{'per micro-batch':>15}  {'offload':<10} {'recompute':<10} {'MFLOP/token':>11}",
            file=out,
        )
        for e in kind.entries:
            flops = (
                "-"
                if e.recompute_flops_per_token is None
                else (f"{e.recompute_flops_per_token / 1e6:.2f}")
            )
            notes = [e.note] if e.note else []
            if e.shared_with:
                notes.append("also saved by " + ", ".join(e.shared_with))
            print(
                f"  {e.owner:<32} {e.dtype:<9} {e.bytes_per_token:>9.1f} {e.fixed_bytes:>8.0f} "
                f"{e.tensors:>2} {_size(e.bytes_at(tokens)):>15}  {e.offload or '-':<10} "
                f"{e.recompute or '-':<10} {flops:>11}"
                + (f"  ({'; '.join(notes)})" if notes else ""),
                file=out,
            )
    for note in ledger.notes:
        print(f"note: {note}", file=out)
    total, reach = ledger.total_bytes(), ledger.offloadable_bytes()
    share = 100 * reach / total if total else 0.0
    print(
        f"\ntotal saved per micro-batch: {_size(total)}; today's offload modules reach "
        f"{_size(reach)} ({share:.0f}%)",
        file=out,
    )
