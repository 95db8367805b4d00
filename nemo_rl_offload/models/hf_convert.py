"""Hugging Face checkpoints <-> the state dict of our Megatron-core GPTModel, per tensor-parallel
rank, for the dense Llama, Qwen2, Qwen3 and the MoE Qwen3-MoE and Mixtral families.

Pure functions on state dicts: reading and writing the shards belongs to the caller. The names
and layouts mapped, and why: docs/hf_models.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nemo_rl_offload.config.model_presets import HF_MODEL_TYPES as MODEL_TYPES
from nemo_rl_offload.config.model_presets import Architecture
from nemo_rl_offload.errors import UserInputError

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# MoE tensor names inside ``model.layers.{i}.``: router, expert gate, up, down.
_MOE_HF_NAMES = {
    "qwen3_moe": (
        "mlp.gate.weight",
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
    "mixtral": (
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
}
# HF tensors that are not weights (computed RoPE buffers some older checkpoints saved).
_HARMLESS_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_EXTRA_STATE_SUFFIX = "_extra_state"
_MAX_LISTED = 5

Shape = tuple[int, ...]


@dataclass(frozen=True)
class _Dims:
    """The sizes and switches of an architecture that decide names and shapes."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int  # 0 for a dense model
    moe_ffn: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool

    @classmethod
    def of(cls, architecture: Architecture) -> _Dims:
        t = architecture.transformer
        _check_supported(architecture)
        heads = t["num_attention_heads"]
        experts = t.get("num_moe_experts") or 0
        ffn = t.get("ffn_hidden_size") or 4 * t["hidden_size"]
        return cls(
            layers=t["num_layers"],
            hidden=t["hidden_size"],
            heads=heads,
            groups=t.get("num_query_groups") or heads,
            head_dim=t.get("kv_channels") or t["hidden_size"] // heads,
            ffn=ffn,
            vocab=architecture.vocab_size,
            experts=experts,
            moe_ffn=(t.get("moe_ffn_hidden_size") or ffn) if experts else 0,
            qkv_bias=bool(t.get("add_qkv_bias", False)),
            qk_norm=bool(t.get("qk_layernorm", False)),
            tied=architecture.share_embeddings_and_output_weights,
        )


def _check_supported(architecture: Architecture) -> None:
    """Refuse architectures whose weights these families cannot express."""
    t = architecture.transformer
    wanted = {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation": "silu",
        "add_bias_linear": False,
    }
    problems = [
        f"{name}={t.get(name)!r} (needs {value!r})"
        for name, value in wanted.items()
        if t.get(name) != value
    ]
    groups = t.get("num_query_groups") or t["num_attention_heads"]
    if t["num_attention_heads"] % groups:
        problems.append(
            f"num_attention_heads={t['num_attention_heads']} not a multiple of {groups}"
        )
    if t.get("moe_shared_expert_intermediate_size"):
        problems.append("moe_shared_expert_intermediate_size (shared experts)")
    if t.get("moe_layer_freq", 1) != 1:
        problems.append(f"moe_layer_freq={t['moe_layer_freq']!r} (dense layers between MoE ones)")
    if problems:
        raise UserInputError(
            f"{architecture.name}: not convertible to Hugging Face Llama/Qwen/Mixtral weights: "
            + "; ".join(problems)
        )


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _listed(names: Sequence[str]) -> str:
    """The first few names, and how many more."""
    more = len(names) - _MAX_LISTED
    return ", ".join(names[:_MAX_LISTED]) + (f" (and {more} more)" if more > 0 else "")


# --------------------------------------------------------------------------------------------
# The parameter table: one entry per Megatron tensor, shared by import and export.


@dataclass(frozen=True)
class _Param:
    """One Megatron tensor: the HF tensors it is made of, how they are fused into the whole
    (tp = 1) tensor, and how that is split over tensor-parallel ranks.

    ``fuse``: "one" (same tensor), "qkv" (q, k, v grouped per query group), "gated"
    ([gate; up]).
    ``shard``: "replicated", "column" (dim 0), "row" (dim 1), "gated" ([gate_r; up_r]).
    """

    key: str
    hf_names: tuple[str, ...]
    hf_shapes: tuple[Shape, ...]
    fuse: str = "one"
    shard: str = "replicated"


def _attention_params(i: int, d: _Dims, fused_layernorm: bool) -> list[_Param]:
    hf, mg = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
    q_rows, kv_rows = d.heads * d.head_dim, d.groups * d.head_dim
    norm_key = (
        f"{mg}linear_qkv.layer_norm_weight"
        if fused_layernorm
        else f"decoder.layers.{i}.input_layernorm.weight"
    )
    params = [
        _Param(norm_key, (f"model.layers.{i}.input_layernorm.weight",), ((d.hidden,),)),
        _Param(
            f"{mg}linear_qkv.weight",
            tuple(f"{hf}{p}_proj.weight" for p in "qkv"),
            ((q_rows, d.hidden), (kv_rows, d.hidden), (kv_rows, d.hidden)),
            "qkv",
            "column",
        ),
    ]
    if d.qkv_bias:
        params.append(
            _Param(
                f"{mg}linear_qkv.bias",
                tuple(f"{hf}{p}_proj.bias" for p in "qkv"),
                ((q_rows,), (kv_rows,), (kv_rows,)),
                "qkv",
                "column",
            )
        )
    if d.qk_norm:
        params += [
            _Param(f"{mg}{p}_layernorm.weight", (f"{hf}{p}_norm.weight",), ((d.head_dim,),))
            for p in "qk"
        ]
    params.append(
        _Param(
            f"{mg}linear_proj.weight",
            (f"{hf}o_proj.weight",),
            ((d.hidden, q_rows),),
            shard="row",
        )
    )
    return params


def _dense_mlp_params(i: int, d: _Dims, fused_layernorm: bool) -> list[_Param]:
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    norm_key = (
        f"{mg}mlp.linear_fc1.layer_norm_weight"
        if fused_layernorm
        else f"{mg}pre_mlp_layernorm.weight"
    )
    return [
        _Param(norm_key, (f"{hf}post_attention_layernorm.weight",), ((d.hidden,),)),
        _Param(
            f"{mg}mlp.linear_fc1.weight",
            (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"),
            ((d.ffn, d.hidden), (d.ffn, d.hidden)),
            "gated",
            "gated",
        ),
        _Param(
            f"{mg}mlp.linear_fc2.weight",
            (f"{hf}mlp.down_proj.weight",),
            ((d.hidden, d.ffn),),
            shard="row",
        ),
    ]


def _expert_keys(prefix: str, e: int, grouped_experts: bool) -> tuple[str, str]:
    """Megatron keys of expert ``e``'s fc1 and fc2 weights."""
    if grouped_experts:
        return (
            f"{prefix}mlp.experts.linear_fc1.weight{e}",
            f"{prefix}mlp.experts.linear_fc2.weight{e}",
        )
    local = f"{prefix}mlp.experts.local_experts.{e}."
    return f"{local}linear_fc1.weight", f"{local}linear_fc2.weight"


def _moe_params(i: int, d: _Dims, family: str, grouped_experts: bool) -> list[_Param]:
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    router, gate, up, down = (hf + name for name in _MOE_HF_NAMES[family])
    params = [
        # MoE layers keep a separate pre-MLP norm in TE's spec too (the router reads its output).
        _Param(
            f"{mg}pre_mlp_layernorm.weight",
            (f"{hf}post_attention_layernorm.weight",),
            ((d.hidden,),),
        ),
        _Param(f"{mg}mlp.router.weight", (router,), ((d.experts, d.hidden),)),
    ]
    for e in range(d.experts):
        fc1, fc2 = _expert_keys(mg, e, grouped_experts)
        params += [
            _Param(
                fc1,
                (gate.format(e=e), up.format(e=e)),
                ((d.moe_ffn, d.hidden), (d.moe_ffn, d.hidden)),
                "gated",
                "gated",
            ),
            _Param(fc2, (down.format(e=e),), ((d.hidden, d.moe_ffn),), shard="row"),
        ]
    return params


def _params(
    d: _Dims, moe_family: str | None, *, grouped_experts: bool, fused_layernorm: bool
) -> list[_Param]:
    """Every tensor of the model, in state-dict order."""
    params = [
        _Param(
            "embedding.word_embeddings.weight",
            ("model.embed_tokens.weight",),
            ((d.vocab, d.hidden),),
            "one",
            "column",
        )
    ]
    for i in range(d.layers):
        params += _attention_params(i, d, fused_layernorm)
        if d.experts:
            assert moe_family is not None
            params += _moe_params(i, d, moe_family, grouped_experts)
        else:
            params += _dense_mlp_params(i, d, fused_layernorm)
    params.append(_Param("decoder.final_layernorm.weight", ("model.norm.weight",), ((d.hidden,),)))
    if not d.tied:
        params.append(
            _Param(
                "output_layer.weight",
                ("lm_head.weight",),
                ((d.vocab, d.hidden),),
                "one",
                "column",
            )
        )
    return params


# --------------------------------------------------------------------------------------------
# Fusing HF tensors into whole Megatron tensors, and back.


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, d: _Dims) -> Tensor:
    """[q; k; v] rows -> rows grouped per query group: [group's q heads, its k, its v]."""
    rest = q.shape[1:]
    per_group = d.heads // d.groups
    grouped = torch.cat(
        [
            q.reshape(d.groups, per_group * d.head_dim, *rest),
            k.reshape(d.groups, d.head_dim, *rest),
            v.reshape(d.groups, d.head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape(-1, *rest)


def _split_qkv(qkv: Tensor, d: _Dims) -> list[Tensor]:
    """The inverse of :func:`_fuse_qkv`."""
    rest = qkv.shape[1:]
    per_group = d.heads // d.groups
    grouped = qkv.reshape(d.groups, (per_group + 2) * d.head_dim, *rest)
    parts = grouped.split([per_group * d.head_dim, d.head_dim, d.head_dim], dim=1)
    return [_owned(p.reshape(-1, *rest)) for p in parts]


def _fuse(p: _Param, tensors: list[Tensor], d: _Dims) -> Tensor:
    if p.fuse == "qkv":
        return _fuse_qkv(*tensors, d)
    if p.fuse == "gated":
        return torch.cat(tensors)
    return tensors[0]


def _unfuse(p: _Param, full: Tensor, d: _Dims) -> list[Tensor]:
    if p.fuse == "qkv":
        return _split_qkv(full, d)
    if p.fuse == "gated":
        return [_owned(half) for half in full.chunk(2)]
    return [full]


def _owned(t: Tensor) -> Tensor:
    """``t`` as a contiguous tensor sharing no memory with another output (safetensors refuses
    to write tensors that share storage)."""
    return t.clone(memory_format=torch.contiguous_format) if t._base is not None else t.contiguous()


# --------------------------------------------------------------------------------------------
# Splitting whole tensors over tensor-parallel ranks, and gathering them back.


def _shard(kind: str, full: Tensor, rank: int, size: int) -> Tensor:
    if kind == "replicated" or size == 1:
        return full
    if kind == "column":
        return _owned(full.chunk(size, dim=0)[rank])
    if kind == "row":
        return _owned(full.chunk(size, dim=1)[rank])
    gate, up = full.chunk(2)
    return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])


def _gather(kind: str, pieces: list[Tensor]) -> Tensor:
    if kind == "replicated" or len(pieces) == 1:
        return pieces[0]
    if kind == "column":
        return torch.cat(pieces, dim=0)
    if kind == "row":
        return torch.cat(pieces, dim=1)
    halves = [piece.chunk(2) for piece in pieces]
    return torch.cat([gate for gate, _ in halves] + [up for _, up in halves])


def _check_tp(d: _Dims, rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tp_rank {rank} is not a rank of tensor-parallel size {size}")
    split = {
        "num_attention_heads": d.heads,
        "num_query_groups": d.groups,
        "vocabulary rows": d.vocab,
        "ffn_hidden_size": 0 if d.experts else d.ffn,
        "moe_ffn_hidden_size": d.moe_ffn,
    }
    bad = [f"{name} {n}" for name, n in split.items() if n % size]
    if bad:
        raise UserInputError(
            f"tensor_model_parallel_size {size}: does not divide {', '.join(bad)} "
            "(each rank needs an equal share)"
        )


# --------------------------------------------------------------------------------------------
# Import: HF -> one tensor-parallel rank.


class _HFSource:
    """An HF state dict that checks every tensor taken against config.json and remembers which
    ones were used."""

    def __init__(self, state: Mapping[str, Tensor]) -> None:
        self.state = state
        self.used: set[str] = set()

    def take(self, name: str, shape: Shape) -> Tensor:
        tensor = self.state.get(name)
        if tensor is None:
            raise UserInputError(
                f"{name}: missing, expected shape {_shape(shape)} from config.json"
            )
        if tuple(tensor.shape) != shape:
            raise UserInputError(
                f"{name}: shape {_shape(tensor.shape)}, expected {_shape(shape)} from config.json"
            )
        self.used.add(name)
        return tensor

    def check_tied_head(self, d: _Dims) -> None:
        """A tied model's HF state dict may repeat the embedding as lm_head.weight: accept it
        only when it is the embedding."""
        if not d.tied or "lm_head.weight" not in self.state:
            return
        head = self.take("lm_head.weight", (d.vocab, d.hidden))
        embedding = self.state["model.embed_tokens.weight"]
        if head.is_meta or embedding.is_meta:  # a names-and-shapes check: no data to compare
            return
        if not torch.equal(head, embedding):
            raise UserInputError(
                "lm_head.weight: differs from model.embed_tokens.weight, but config.json ties "
                "them (tie_word_embeddings: true)"
            )

    def check_all_used(self) -> None:
        unused = sorted(
            name for name in self.state if name not in self.used and not _HARMLESS_HF.search(name)
        )
        if unused:
            raise UserInputError(f"unexpected tensors for this config.json: {_listed(unused)}")


def _moe_family(hf_state: Mapping[str, Tensor], d: _Dims) -> str | None:
    """Which MoE naming the checkpoint uses, read from its tensor names (None for a dense
    model)."""
    if not d.experts:
        return None
    mixtral = any(".block_sparse_moe." in name for name in hf_state)
    return "mixtral" if mixtral else "qwen3_moe"


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    architecture: Architecture,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    grouped_experts: bool = False,
    fused_layernorm: bool = False,
) -> dict[str, Tensor]:
    """This tensor-parallel rank's GPTModel state dict (weights only, no ``_extra_state``)
    from a whole Hugging Face state dict. Meta tensors work too (a names-and-shapes check that
    reads no data; the result is then meta tensors).

    The MoE naming (Qwen3-MoE or Mixtral) is read from the tensor names. Raises
    :class:`UserInputError` with one line for a missing tensor, a shape that disagrees with
    config.json, or unused tensors.
    """
    d = _Dims.of(architecture)
    _check_tp(d, tp_rank, tp_size)
    source = _HFSource(hf_state)
    params = _params(
        d,
        _moe_family(hf_state, d),
        grouped_experts=grouped_experts,
        fused_layernorm=fused_layernorm,
    )
    out: dict[str, Tensor] = {}
    for p in params:
        named = zip(p.hf_names, p.hf_shapes, strict=True)
        tensors = [source.take(name, shape) for name, shape in named]
        out[p.key] = _shard(p.shard, _fuse(p, tensors, d), tp_rank, tp_size)
    source.check_tied_head(d)
    source.check_all_used()
    return out


# --------------------------------------------------------------------------------------------
# Export: all tensor-parallel ranks -> HF.


def _check_model_type(model_type: str, architecture: Architecture, d: _Dims) -> None:
    """Refuse a model_type whose Hugging Face model cannot hold this architecture's weights
    or would route tokens differently."""
    if model_type not in MODEL_TYPES:
        raise UserInputError(
            f"model_type '{model_type}': not supported; one of {', '.join(MODEL_TYPES)}"
        )
    t = architecture.transformer
    problems = []
    if bool(d.experts) != (model_type in MOE_MODEL_TYPES):
        problems.append(
            "a MoE model needs qwen3_moe or mixtral"
            if d.experts
            else "a dense model has no experts"
        )
    if d.qkv_bias != (model_type == "qwen2"):
        problems.append("only qwen2 has q/k/v biases (and it always has them)")
    if d.qk_norm != (model_type in ("qwen3", "qwen3_moe")):
        problems.append("only qwen3 and qwen3_moe have q/k norms (and they always have them)")
    if d.experts:
        if t.get("moe_router_score_function", "softmax") != "softmax":
            problems.append("HF routers use a softmax score function")
        if t.get("moe_router_topk_scaling_factor") not in (None, 1, 1.0):
            problems.append("HF routers have no top-k scaling factor")
        if model_type == "mixtral" and t.get("moe_router_pre_softmax", False):
            problems.append("Mixtral renormalises the top-k probabilities (moe_router_pre_softmax)")
    if problems:
        raise UserInputError(
            f"{architecture.name}: cannot be written as model_type '{model_type}': "
            + "; ".join(problems)
        )


def _shard_pieces(shards: Sequence[Mapping[str, Tensor]], key: str) -> list[Tensor]:
    pieces = []
    for rank, shard in enumerate(shards):
        tensor = shard.get(key)
        if tensor is None:
            raise UserInputError(
                f"{key}: missing from the state dict of tensor-parallel rank {rank}"
            )
        pieces.append(tensor)
    return pieces


def _without_tied_head(shard: Mapping[str, Tensor], rank: int) -> Mapping[str, Tensor]:
    """A tied model's state dict without ``output_layer.weight``: with pipeline parallelism
    the last stage keeps its own copy of the embedding (merged in by
    ``hf_checkpoint.merge_pipeline_stages``), which must equal it."""
    if "output_layer.weight" not in shard:
        return shard
    head, embedding = shard["output_layer.weight"], shard.get("embedding.word_embeddings.weight")
    if embedding is not None and not torch.equal(head, embedding):
        raise UserInputError(
            f"tensor-parallel rank {rank}: output_layer.weight differs from "
            "embedding.word_embeddings.weight, but the architecture ties them"
        )
    return {key: value for key, value in shard.items() if key != "output_layer.weight"}


def _check_no_unexpected(shards: Sequence[Mapping[str, Tensor]], params: list[_Param]) -> None:
    known = {p.key for p in params}
    for rank, shard in enumerate(shards):
        unexpected = sorted(
            key for key in shard if key not in known and not key.endswith(_EXTRA_STATE_SUFFIX)
        )
        if unexpected:
            raise UserInputError(
                f"tensor-parallel rank {rank}: unexpected tensors {_listed(unexpected)} "
                "(check grouped_experts and fused_layernorm)"
            )


def _whole_shape(p: _Param, d: _Dims) -> Shape:
    """The tp = 1 Megatron shape of ``p`` (fusing meta tensors: no memory)."""
    metas = [torch.empty(shape, device="meta") for shape in p.hf_shapes]
    return tuple(_fuse(p, metas, d).shape)


def _check_whole_shape(p: _Param, full: Tensor, d: _Dims, tp_size: int) -> None:
    expected = _whole_shape(p, d)
    found = tuple(full.shape)
    if found != expected:
        raise UserInputError(
            f"{p.key}: shape {_shape(found)} over {tp_size} tensor-parallel rank(s), "
            f"expected {_shape(expected)} from the architecture"
        )


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    architecture: Architecture,
    *,
    grouped_experts: bool = False,
    fused_layernorm: bool = False,
    model_type: str,
) -> dict[str, Tensor]:
    """A Hugging Face ``model_type`` state dict from every tensor-parallel rank's GPTModel
    state dict (``shards[r]`` is rank r's). ``_extra_state`` entries are ignored; a tied model
    gets no ``lm_head.weight`` (as ``save_pretrained`` writes it)."""
    if not shards:
        raise ValueError("megatron_to_hf: no shards")
    d = _Dims.of(architecture)
    _check_model_type(model_type, architecture, d)
    params = _params(
        d,
        model_type if d.experts else None,
        grouped_experts=grouped_experts,
        fused_layernorm=fused_layernorm,
    )
    if d.tied:
        shards = [_without_tied_head(shard, rank) for rank, shard in enumerate(shards)]
    _check_no_unexpected(shards, params)
    out: dict[str, Tensor] = {}
    for p in params:
        full = _gather(p.shard, _shard_pieces(shards, p.key))
        _check_whole_shape(p, full, d, len(shards))
        out.update(zip(p.hf_names, _unfuse(p, full, d), strict=True))
    return out


def hf_config_for(
    architecture: Architecture, model_type: str, *, torch_dtype: str = "bfloat16"
) -> dict[str, Any]:
    """A Hugging Face config.json for the weights :func:`megatron_to_hf` writes."""
    d = _Dims.of(architecture)
    _check_model_type(model_type, architecture, d)
    t = architecture.transformer
    rope_theta = float(architecture.rotary_base)
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "intermediate_size": d.moe_ffn if model_type == "mixtral" else d.ffn,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.groups,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": architecture.max_position_embeddings,
        "rms_norm_eps": t.get("layernorm_epsilon", 1e-5),
        # Both spellings: transformers < 5 and config readers read rope_theta, 5.x prefers
        # rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": d.tied,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = False
    if model_type == "llama":
        config["mlp_bias"] = False
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        config["use_sliding_window"] = False
    if d.experts:
        config.update(_moe_config(t, d, model_type))
    return config


def _moe_config(t: Mapping[str, Any], d: _Dims, model_type: str) -> dict[str, Any]:
    moe = {
        "num_experts_per_tok": t["moe_router_topk"],
        "router_aux_loss_coef": t.get("moe_aux_loss_coeff", 0.0),
        "output_router_logits": False,
    }
    if model_type == "mixtral":
        return {**moe, "num_local_experts": d.experts}
    return {
        **moe,
        "num_experts": d.experts,
        "moe_intermediate_size": d.moe_ffn,
        # Megatron without pre-softmax renormalises the top-k (softmax over the chosen
        # logits); with it, it keeps the full softmax's probabilities, as Qwen3-MoE does
        # without norm_topk_prob.
        "norm_topk_prob": not t.get("moe_router_pre_softmax", False),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
