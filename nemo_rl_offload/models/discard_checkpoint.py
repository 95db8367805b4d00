"""Output-discarding recompute on public torch APIs, for the local layer spec's cheap selective
recompute (the norms, the dense MLP's activation).

:class:`DiscardingCheckpoint` frees an elementwise function's output once the forward no longer
reads it and rebuilds it in backward. megatron-core 0.19's ``CheckpointWithoutOutput`` does the
same but cannot run without Transformer Engine. Why, and how values are put back:
docs/offloading.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel import CheckpointWithoutOutput


class _Forward(torch.autograd.Function):
    """The function's forward without its graph, its tensor inputs saved; the backward runs
    the graph that :meth:`DiscardingCheckpoint._rebuild` recorded."""

    @staticmethod
    def forward(
        ctx: Any, run: Callable[..., torch.Tensor], owner: DiscardingCheckpoint, *args: Any
    ):
        with torch.no_grad():
            output = run(*args)
        ctx.save_for_backward(*args)
        ctx.rebuilt = None
        owner._ctx = ctx
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.rebuilt is None:
            raise RuntimeError(
                "a discarded output was not rebuilt before its backward: the hook tensor of "
                "discard_output_and_register_recompute must get its gradient first"
            )
        output, inputs = ctx.rebuilt
        ctx.rebuilt = None
        torch.autograd.backward(output, grad)
        return (None, None, *(t.grad if isinstance(t, torch.Tensor) else None for t in inputs))


class DiscardingCheckpoint:
    """One use of output-discarding recompute: :meth:`checkpoint` runs ``run(*args)`` and
    returns its output (one tensor; ``args`` are tensors or None), then
    :meth:`discard_output_and_register_recompute` frees the output's memory and rebuilds it when
    ``hook_tensor``'s gradient is computed. Without gradients (forward-only passes, or inputs
    that need none) the function just runs and nothing is discarded, so parameters inside
    ``run`` never lose their gradient."""

    def __init__(self) -> None:
        self._run: Callable[..., torch.Tensor] | None = None
        self._ctx: Any = None
        self._output: torch.Tensor | None = None
        self._nbytes = 0

    def checkpoint(self, run: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return run(*args)
        self._run = run
        output = _Forward.apply(run, self, *args)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"output-discarding recompute needs one output tensor, got {output!r}")
        self._output = output
        return output

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's memory now; rebuild it when ``hook_tensor``'s gradient arrives
        (a tensor computed after every use of the output in the forward, whose gradient is
        computed before the output's first use in backward)."""
        output = self._output
        if self._ctx is None or output is None:
            return  # ran without a graph: nothing is kept for backward
        if not hook_tensor.requires_grad:
            raise ValueError("the hook tensor of an output-discarding recompute needs a gradient")
        storage = output.untyped_storage()
        if output.storage_offset() or storage.nbytes() != output.numel() * output.element_size():
            raise ValueError("output-discarding recompute needs an output that owns its storage")
        self._nbytes = storage.nbytes()
        storage.resize_(0)
        hook_tensor.register_hook(self._rebuild)

    def _rebuild(self, _grad: torch.Tensor) -> None:
        ctx, output, run = self._ctx, self._output, self._run
        self._ctx = self._output = self._run = None
        if ctx is None or output is None or run is None:
            return  # rebuilt already (a hook tensor used twice)
        inputs = tuple(
            t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in ctx.saved_tensors
        )
        kept: set[int] = set()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            kept.add(tensor.untyped_storage().data_ptr())
            return tensor

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _same):
            rebuilt = run(*inputs)
        if rebuilt.shape != output.shape or rebuilt.dtype != output.dtype:
            raise RuntimeError(
                f"the recomputed output ({rebuilt.dtype}, {tuple(rebuilt.shape)}) differs from the "
                f"forward's ({output.dtype}, {tuple(output.shape)})"
            )
        storage = output.untyped_storage()
        storage.resize_(self._nbytes)
        with torch.no_grad():
            # A new tensor over the same storage: the copy moves no saved tensor's version.
            alias = output.new_empty(0).set_(storage, 0, output.shape, output.stride())
            alias.copy_(rebuilt)
        kept.update(t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor))
        if rebuilt.untyped_storage().data_ptr() not in kept:
            rebuilt.untyped_storage().resize_(0)  # its graph does not read it: free the copy
        ctx.rebuilt = (rebuilt, inputs)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class OwnCheckpoint:
    """A module attribute that Megatron assigns a ``CheckpointWithoutOutput`` to and that holds
    a :class:`DiscardingCheckpoint` in its place (any other value is kept as given): the seam a
    subclass of Megatron's module declares so that Megatron's forward runs unchanged."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = f"_own_{name}"

    def __get__(self, layer: Any, owner: type | None = None) -> Any:
        if layer is None:
            return self
        try:
            return layer.__dict__[self._key]
        except KeyError:
            raise AttributeError(self._key.removeprefix("_own_")) from None

    def __set__(self, layer: Any, value: Any) -> None:
        if isinstance(value, CheckpointWithoutOutput):
            value = DiscardingCheckpoint()
        layer.__dict__[self._key] = value
