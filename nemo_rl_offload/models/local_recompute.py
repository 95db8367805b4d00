"""Selective recompute of the norms (``layernorm``) and of the dense MLP's activation alone
(``mlp_act``) on megatron-core's local layer spec, without Transformer Engine.

Both are output-discarding recompute (:mod:`.discard_checkpoint`), through
:class:`RecomputeNormsLayer` and :class:`RecomputeActMLP`; validate and the spec refuse them
when the installed Megatron code differs from the checked one. How: docs/offloading.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_geglu import bias_geglu_impl
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.transformer.transformer_layer import TransformerLayer

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models.discard_checkpoint import DiscardingCheckpoint, OwnCheckpoint
from nemo_rl_offload.models.mlp_offload import OffloadingMLP, offloading_mlp_builder
from nemo_rl_offload.offload.owned import recompute_drift

MLP_ACT = "mlp_act"


def require_checked_recompute(modules: frozenset[str]) -> None:
    """Refuse ``modules`` (UserInputError, one line) when the Megatron code they rely on is not
    the checked one (``owned.recompute_drift``; validate refuses them the same way first)."""
    drift = recompute_drift(modules)
    if drift:
        raise UserInputError(f"policy.megatron_cfg.recompute_modules: {drift}")


class RecomputeNormsLayer(TransformerLayer):
    """Megatron's TransformerLayer whose ``layernorm`` recompute runs without Transformer
    Engine (any other behaviour, and every other recompute option, is Megatron's)."""

    input_layernorm_checkpoint = OwnCheckpoint()
    pre_mlp_norm_checkpoint = OwnCheckpoint()


class RecomputeActMLP(OffloadingMLP):
    """Megatron's dense MLP with its activation under output-discarding recompute (and the
    MLP's offload points of :class:`OffloadingMLP`, when some are on)."""

    def forward(self, hidden_states: Any, per_token_scale: Any = None, **kwargs: Any) -> Any:
        if per_token_scale is not None or self.config.use_te_activation_func:
            raise ValueError(
                "mlp_act recompute covers the dense MLP without a per-token scale or "
                "Transformer Engine's activation"
            )
        try:
            intermediate, bias = self.linear_fc1(hidden_states)
            checkpoint = DiscardingCheckpoint()
            activated = checkpoint.checkpoint(self._activation, intermediate, bias)
            output, output_bias = self.linear_fc2(activated)
            checkpoint.discard_output_and_register_recompute(output)
            return output, output_bias
        finally:
            self._close()

    def _activation(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The activation step of Megatron's ``MLP.forward`` for a dense MLP (no per-token
        scale, no Transformer Engine activation): the same kernels, in the same order."""
        config = self.config
        gated = config.gated_linear_unit
        if config.bias_activation_fusion:
            if self.activation_func == F.gelu:
                if gated:
                    return bias_geglu_impl(x, bias)
                if bias is None:
                    raise ValueError("bias_activation_fusion with gelu needs add_bias_linear")
                return bias_gelu_impl(x, bias)
            if self.activation_func == F.silu and gated:
                return bias_swiglu_impl(x, bias, config.activation_func_fp8_input_store, False)
            raise ValueError("bias_activation_fusion supports gelu and swiglu only")
        if bias is not None:
            x = x + bias
        if not gated:
            return self.activation_func(x)
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)


def recomputes_norms(config: Any) -> bool:
    """Whether ``config`` asks for Megatron's selective ``layernorm`` recompute."""
    return config.recompute_granularity == "selective" and "layernorm" in (
        config.recompute_modules or []
    )


def with_local_recompute(
    spec: Any, config: Any, recompute_modules: frozenset[str], mlp_offload_modules: frozenset[str]
) -> Any:
    """The local layer ``spec`` with :class:`RecomputeNormsLayer` when ``config`` recomputes
    ``layernorm``, and :class:`RecomputeActMLP` (with ``mlp_offload_modules``) when
    ``recompute_modules`` (this package's names, kept out of TransformerConfig) has
    ``mlp_act``."""
    wanted = frozenset(recompute_modules) | ({"layernorm"} if recomputes_norms(config) else set())
    if not wanted:
        return spec
    require_checked_recompute(wanted)
    if "layernorm" in wanted:
        if spec.module is not TransformerLayer:
            raise ValueError(
                f"layernorm recompute replaces Megatron's TransformerLayer, not {spec.module!r}"
            )
        spec.module = RecomputeNormsLayer
    if MLP_ACT in wanted:
        spec.submodules.mlp = offloading_mlp_builder(
            spec.submodules.mlp, mlp_offload_modules, mlp_class=RecomputeActMLP
        )
    return spec
