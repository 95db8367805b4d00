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

from nemo_rl_offload.config.megatron_settings import EffectiveSettings
from nemo_rl_offload.config.model_shape import DENSE, MOE, layer_kinds, layer_weights

# Dense bfloat16 peak of one GPU (FLOP/s), by a name its CUDA device name contains: NVIDIA's
# H100 SXM and H200 data sheets (989.4 TFLOP/s without sparsity), the peak NeMo-RL divides by.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def peak_bf16_flops(device_name: str) -> float:
    """The dense bf16 peak of a GPU named ``device_name`` (FLOP/s); 0.0 when not known."""
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in device_name), 0.0)


def forward_flops_per_token(effective: EffectiveSettings, vocab_size: int) -> float:
    """Forward matrix-product FLOPs per token of the whole model (all ranks), attention's
    sequence-length term excluded (:func:`training_flops` adds it)."""
    weights = layer_weights(effective)
    counts = {kind: count for kind, count, _ in layer_kinds(effective)}
    per_token = counts.get(DENSE, 0) * (weights.attention + weights.dense_mlp)
    if counts.get(MOE):
        topk = int(effective.value("moe_router_topk") or 1)
        routed = topk * weights.expert + weights.shared_experts + weights.router
        per_token += counts[MOE] * (weights.attention + routed)
    return 2.0 * (per_token + vocab_size * int(effective.value("hidden_size")))


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
