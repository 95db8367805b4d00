"""Decode steps of a mixture-of-experts model without host synchronisation: every token through
every local expert, each weighted by its routing probability.

Megatron's MoE layer permutes a step's tokens by expert, which needs the count of tokens per
expert on the host (a synchronisation in every layer of every decode step), so a decode step
can be neither run ahead by the host nor captured as a CUDA graph. A decode step has one token
per row: sending each token through all local experts reads every expert's weights once, as the
permuted path does, and costs more arithmetic only where there is little (a few tokens). The
router is Megatron's; a token's probability is 0 for an expert it was not routed to, which
scales that expert's intermediate activation (Megatron's ``per_token_scale``) to 0, so the
experts' outputs summed equal the routed ones'.

Used only inside :func:`experts_for_every_token` (the sampler's decode steps) and only where
the layout allows it (:func:`dense_usable`); everywhere else Megatron's path runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

__all__ = [
    "DenseDecodeMoELayer",
    "dense_usable",
    "experts_for_every_token",
    "with_dense_decode",
]

_ACTIVE = {"on": False}


@contextlib.contextmanager
def experts_for_every_token() -> Iterator[None]:
    """Within: the MoE layers that can (:func:`dense_usable`) take the dense decode path."""
    previous = _ACTIVE["on"]
    _ACTIVE["on"] = True
    try:
        yield
    finally:
        _ACTIVE["on"] = previous


def dense_usable(layer: Any) -> bool:
    """Whether ``layer`` can run its experts densely: Megatron's MoE layer with sequential or
    grouped experts (not Transformer Engine's fused ones) all on this rank (no expert or tensor
    parallelism), probabilities applied in the experts (not on their input), no token
    dropping, no latent projections, no quantized arithmetic and no shared-expert overlap."""
    config = layer.config
    experts = getattr(layer, "experts", None)
    grouped = isinstance(experts, TEGroupedMLP) and not getattr(experts, "_with_fused_impl", False)
    return (
        isinstance(layer, MoELayer)
        and (isinstance(experts, SequentialMLP) or grouped)
        and layer.num_local_experts == config.num_moe_experts
        and layer.tp_group.size() == 1
        and not config.moe_apply_probs_on_input
        and config.moe_expert_capacity_factor is None
        and not config.moe_latent_size
        and not config.moe_router_padding_for_quantization
        and not (config.fp8 or config.fp4)
        and not layer.shared_expert_overlap
    )


class DenseDecodeMoELayer(MoELayer):
    """Megatron's MoE layer, with a dense path for the sampler's decode steps."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> Any:
        dense = (
            _ACTIVE["on"]
            and not self.training
            and intermediate_tensors is None
            and padding_mask is None
            and dense_usable(self)
        )
        if not dense:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        shared = self.shared_experts_compute(hidden_states)
        probs, _ = self.route(hidden_states)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        output = self._every_expert(tokens, probs).view(hidden_states.shape)
        if shared is not None:
            output = output + shared
        return output, None

    def _every_expert(self, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The sum over the local experts of each expert's output on every token, its
        intermediate activation scaled by the token's probability for it."""
        if isinstance(self.experts, SequentialMLP):
            output = torch.zeros_like(tokens)
            for index, expert in enumerate(self.experts.local_experts):
                contribution, bias = expert(tokens, probs[:, index])
                assert bias is None, "an expert's bias is added inside, scaled per token"
                output = output + contribution
            return output
        # Grouped experts: every token once per expert, expert after expert; equal counts
        # (made on the host, so nothing is read back from the device).
        experts = self.num_local_experts
        counts = torch.full((experts,), tokens.shape[0], dtype=torch.long)
        repeated = tokens.repeat(experts, 1)
        output, bias = self.experts(repeated, counts, probs.t().reshape(-1))
        assert bias is None, "grouped experts add their bias inside, scaled per token"
        return output.view(experts, *tokens.shape).sum(dim=0)


def with_dense_decode(mlp_spec: Any) -> Any:
    """``mlp_spec`` (Megatron's MoE spec: ``partial(MoELayer, ...)``) building
    :class:`DenseDecodeMoELayer`; another spec is returned unchanged."""
    if isinstance(mlp_spec, functools.partial) and mlp_spec.func is MoELayer:
        return functools.partial(DenseDecodeMoELayer, *mlp_spec.args, **mlp_spec.keywords)
    return mlp_spec
