"""Megatron's TransformerBlock with each full-recompute segment's input offloaded
(:mod:`nemo_rl_offload.offload.layer_input`).

GPTModel builds its decoder as ``TransformerBlock`` by name, with no spec or argument to choose
another class, so :func:`offload_layer_inputs` turns the built decoder into an instance of
:class:`LayerInputOffloadBlock`: a subclass whose forward is Megatron's inside the offloader's
saved-tensor hooks; a forward pre-hook on each of its layers reports the layer's input, which
is how a segment input is recognised when the checkpoint saves it. Only that model's decoder
changes; Megatron's classes are untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_block import TransformerBlock

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.offload import layer_input
from nemo_rl_offload.offload.layer_input import LayerInputOffloader


class LayerInputOffloadBlock(TransformerBlock):
    """TransformerBlock whose training forward under full recompute offloads every segment's
    input through :attr:`layer_input_offloader`."""

    layer_input_offloader: LayerInputOffloader

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if hidden is None:  # a later pipeline stage: the input came through set_input_tensor
            hidden = self.input_tensor
        if not (
            self.training
            and torch.is_grad_enabled()
            and self.config.recompute_granularity == "full"
            and isinstance(hidden, torch.Tensor)
        ):
            return super().forward(*args, **kwargs)
        with self.layer_input_offloader.segment_inputs(hidden.shape, hidden.dtype):
            return super().forward(*args, **kwargs)


def require_checked_megatron() -> None:
    """Refuse (UserInputError, one line) when the Megatron code the offload relies on changed."""
    line = layer_input.drift()
    if line is not None:
        raise UserInputError(line)


def offload_layer_inputs(model: Any, offloader: LayerInputOffloader | None = None) -> Any:
    """Make ``model``'s decoder (a GPTModel's TransformerBlock) offload its full-recompute
    segment inputs; returns the offloader (whose counters say what moved)."""
    require_checked_megatron()
    decoder = model.decoder
    if type(decoder) is not TransformerBlock:
        raise UserInputError(
            f"policy.megatron_cfg.offload_modules: layer_input needs Megatron's TransformerBlock "
            f"as the decoder, and this model's is {type(decoder).__name__}; remove layer_input"
        )
    decoder.__class__ = LayerInputOffloadBlock
    decoder.layer_input_offloader = offloader or LayerInputOffloader()
    for layer in decoder.layers:
        layer.register_forward_pre_hook(
            _mark_input(decoder.layer_input_offloader), with_kwargs=True
        )
    return decoder.layer_input_offloader


def layer_input_offloader(model: Any) -> LayerInputOffloader | None:
    """The offloader of ``model``'s decoder (a GPTModel, wrapped or not) when its segment
    inputs are offloaded, else None: what the worker reads its per-step bytes from."""
    from megatron.core.utils import unwrap_model

    decoder = getattr(unwrap_model(model), "decoder", None)
    return decoder.layer_input_offloader if isinstance(decoder, LayerInputOffloadBlock) else None


def _mark_input(offloader: LayerInputOffloader) -> Any:
    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        offloader.mark(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    return hook
