"""The shape arithmetic of a model from its effective settings: which kinds of layer it has
and each layer part's matrix weights, shared by the memory estimate, the activation ledger and
the model FLOPs so they never disagree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_rl_offload.config.megatron_settings import EffectiveSettings

DENSE = "dense layer"
MOE = "MoE layer"


def layer_kinds(effective: EffectiveSettings) -> list[tuple[str, int, dict[str, Any]]]:
    """(kind, how many layers of it, settings that build one layer of it)."""
    layers = int(effective.value("num_layers"))
    if not effective.is_moe:
        return [(DENSE, layers, {})]
    freq = effective.value("moe_layer_freq", 1)
    if isinstance(freq, int):
        moe = sum(1 for index in range(layers) if index % freq == 0)
    else:
        moe = sum(1 for flag in freq if flag)
    kinds = [(MOE, moe, {"moe_layer_freq": 1})]
    if layers > moe:
        kinds.append((DENSE, layers - moe, {"num_moe_experts": None, "moe_layer_freq": 1}))
    return kinds


@dataclass(frozen=True)
class LayerWeights:
    """The matrix weights of a layer's parts at full width (no biases, no norms): what the
    parameter counts and the model FLOPs (models/flops.py) are both built from."""

    attention: int  # qkv and output projections
    dense_mlp: int  # fc1 (both halves when gated) and fc2
    expert: int  # one routed expert's fc1 and fc2
    shared_experts: int
    router: int


def layer_weights(effective: EffectiveSettings) -> LayerWeights:
    """Each part's matrix weights, from the effective settings."""
    v = effective.value
    hidden, heads = int(v("hidden_size")), int(v("num_attention_heads"))
    head_dim = int(v("kv_channels") or hidden // heads)
    q_dim, kv_dim = heads * head_dim, int(v("num_query_groups") or heads) * head_dim
    gated = 2 if v("gated_linear_unit") else 1
    ffn = int(v("ffn_hidden_size") or 4 * hidden)
    expert_ffn = int(v("moe_ffn_hidden_size") or ffn)
    experts = int(v("num_moe_experts") or 0) if effective.is_moe else 0
    return LayerWeights(
        attention=hidden * (q_dim + 2 * kv_dim) + q_dim * hidden,
        dense_mlp=hidden * ffn * (gated + 1),
        expert=hidden * expert_ffn * (gated + 1),
        shared_experts=hidden * int(v("moe_shared_expert_intermediate_size") or 0) * (gated + 1),
        router=hidden * experts,
    )
