"""Model FLOPs of a training step, for NeMo-RL's throughput metrics (``train_flops_per_gpu``,
``train_fp_utilization``: model FLOPs utilization).

Model FLOPs count what the model needs, not what a plan re-runs: recompute adds time, not
model FLOPs, so a plan that recomputes shows a lower utilization for the same work. Per token
the forward runs two FLOPs per weight of every matrix it multiplies (each layer's attention
projections and MLP, for a MoE layer its router, shared experts and ``moe_router_topk``
experts; the output layer; not the embedding lookup), and per sequence of ``s`` tokens causal
attention's two products take ``2 s^2`` FLOPs per query feature and layer (half of
``QK^T`` and ``PV``). Backward takes twice the forward.
"""

from __future__ import annotations

from collections.abc import Iterable

from nemo_rl_offload.offload.apply import EffectiveSettings
from nemo_rl_offload.offload.ledger import DENSE, MOE, layer_kinds

# Dense bfloat16 peak of one GPU (FLOP/s), by a name its CUDA device name contains: NVIDIA's
# H100 SXM and H200 data sheets (989.4 TFLOP/s without sparsity), the peak NeMo-RL divides by.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def peak_bf16_flops(device_name: str) -> float:
    """The dense bf16 peak of a GPU named ``device_name`` (FLOP/s); 0.0 when not known."""
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in device_name), 0.0)


def forward_flops_per_token(effective: EffectiveSettings, vocab_size: int) -> float:
    """Forward matrix-product FLOPs per token of the whole model (all ranks), attention's
    sequence-length term excluded (:func:`training_flops` adds it)."""
    v = effective.value
    hidden, heads = int(v("hidden_size")), int(v("num_attention_heads"))
    head_dim = int(v("kv_channels") or hidden // heads)
    q_dim, kv_dim = heads * head_dim, int(v("num_query_groups") or heads) * head_dim
    gated = 2 if v("gated_linear_unit") else 1
    ffn = int(v("ffn_hidden_size") or 4 * hidden)
    attention = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden
    dense_mlp = hidden * ffn * gated + ffn * hidden
    counts = {kind: count for kind, count, _ in layer_kinds(effective)}
    moe_layers = counts.get(MOE, 0)
    per_layer = counts.get(DENSE, 0) * (attention + dense_mlp)
    if moe_layers:
        experts = int(v("num_moe_experts"))
        expert_ffn = int(v("moe_ffn_hidden_size") or ffn)
        active = int(v("moe_router_topk") or 1) * (
            hidden * expert_ffn * gated + expert_ffn * hidden
        )
        shared_ffn = int(v("moe_shared_expert_intermediate_size") or 0)
        shared = shared_ffn * hidden * (gated + 1)
        per_layer += moe_layers * (attention + hidden * experts + active + shared)
    return 2.0 * (per_layer + vocab_size * hidden)


def training_flops(effective: EffectiveSettings, vocab_size: int, lengths: Iterable[int]) -> float:
    """Model FLOPs of one training step (forward and backward) over sequences of ``lengths``
    tokens (their own lengths: padding is not work), over all ranks."""
    v = effective.value
    hidden, heads = int(v("hidden_size")), int(v("num_attention_heads"))
    q_dim = heads * int(v("kv_channels") or hidden // heads)
    layers = int(v("num_layers"))
    per_token = forward_flops_per_token(effective, vocab_size)
    lengths = list(lengths)
    forward = per_token * sum(lengths) + sum(2.0 * s * s * q_dim * layers for s in lengths)
    return 3.0 * forward
