"""The module names a recipe may list in ``offload_modules`` and ``recompute_modules``: Megatron's
own (by megatron-core version) and the ones this package adds through its own seams."""

from __future__ import annotations

# offload_modules accepted by each megatron-core minor version (from its TransformerConfig).
OFFLOAD_MODULES_BY_VERSION: dict[str, frozenset[str]] = {
    "0.15": frozenset(
        {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"}
    ),
    "0.19": frozenset(
        {
            "attn_norm",
            "qkv_linear",
            "core_attn",
            "attn_proj",
            "mlp_norm",
            "expert_fc1",
            "moe_act",
            "fused_group_mlp",
        }
    ),
}
MOE_OFFLOAD_MODULES = frozenset({"expert_fc1", "moe_act", "fused_group_mlp"})
# offload_modules this package adds to Megatron's (models.mlp_offload): the dense MLP's saved
# tensors, which megatron-core 0.19 reaches only through Transformer Engine. Named as Megatron
# names its points (the block, then the op whose saved tensors the group holds) and kept out of
# TransformerConfig, which refuses names it does not know (config.megatron_settings).
MLP_OFFLOAD_MODULES = frozenset({"mlp_fc1", "mlp_act", "mlp_fc2"})
# The offload module name of each full-recompute segment's input (offload.layer_input), as
# Megatron-LM PR 5218 names it; kept out of TransformerConfig too.
LAYER_INPUT = "layer_input"
# recompute_modules this package adds to Megatron's (models.local_recompute): the dense MLP's
# activation alone, named as Megatron names the experts' one (moe_act) and kept out of
# TransformerConfig, which refuses names it does not know (config.megatron_settings).
PROJECT_RECOMPUTE_MODULES = frozenset({"mlp_act"})
# Selective recompute that runs on the local spec through this package's seams
# (models.local_recompute; the grouped experts' models.grouped_linear.LocalGroupedMLP), with the
# Megatron code they rely on fingerprinted.
LOCAL_RECOMPUTE_MODULES = frozenset({"layernorm", "mlp_act", "moe_act"})
