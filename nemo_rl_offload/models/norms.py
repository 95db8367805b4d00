"""Torch norms for megatron-core's local layer spec that also run under sequence parallelism.

Megatron-core 0.19's ``WrappedTorchNorm`` refuses sequence parallelism; :class:`LocalNorm`
builds the same torch norm and marks its parameters ``sequence_parallel``, so that their partial
gradients are summed over the tensor-parallel group. Why: docs/design/local_layer_spec.md.
"""

from __future__ import annotations

from typing import Any

import torch


class LocalNorm:
    """``WrappedTorchNorm`` without its sequence-parallel refusal: a ``torch.nn.LayerNorm`` or
    ``torch.nn.RMSNorm`` (``config.normalization``) whose parameters carry
    ``sequence_parallel = config.sequence_parallel``, so their gradients are summed over the
    tensor-parallel ranks that each normalised part of the sequence."""

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        # The same refusals as WrappedTorchNorm, except sequence parallelism; like it, the
        # config (not the unused keyword arguments) decides.
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero_centered_gamma is not supported by torch's norms")
        if config.persist_layer_norm:
            raise ValueError("persist_layer_norm is not supported by torch's norms")
        if config.memory_efficient_layer_norm:
            raise ValueError("memory_efficient_layer_norm is not supported by torch's norms")
        norms: dict[str, type[torch.nn.Module]] = {
            "LayerNorm": torch.nn.LayerNorm,
            "RMSNorm": torch.nn.RMSNorm,
        }
        if config.normalization not in norms:
            raise ValueError(
                f"normalization {config.normalization!r}: the local spec's norms are "
                f"{', '.join(norms)}"
            )
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
