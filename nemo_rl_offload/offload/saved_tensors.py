"""What autograd keeps for the backward pass of one forward, per owning module.

The ledger (:mod:`nemo_rl_offload.planning.ledger`) is derived from a real forward rather than
from formulas: what a norm, an attention kernel or a loss keeps depends on the kernels torch
and Megatron pick, and only running them says which. Each tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``) is attributed to the innermost module whose
forward is running (forward pre- and post-hooks keep the stack), and counted once per
storage: a tensor saved by two operations, or several views of one buffer (q, k and v split
from one projection), hold that memory once. Parameters and buffers are not activations and
are left out, as are storages that alias them (a transposed weight).

Saved tensors are kept referenced until the recorder is dropped, so that a storage freed and
reused during the forward is never mistaken for one already seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

ROOT = "<model>"  # tensors saved by the top module itself, outside any submodule's forward


@dataclass
class SavedStorage:
    """One storage autograd kept: who saved it first, in which order, its size, and which
    other modules saved it too (``also``: their offload regions cover it as well)."""

    owner: str
    order: int
    dtype: str
    nbytes: int
    shape: tuple[int, ...]
    also: list[str] = field(default_factory=list)


@dataclass
class Recorder:
    """The storages saved while :func:`record` was active, in the order they were saved."""

    saved: list[SavedStorage] = field(default_factory=list)
    _seen: dict[int, tuple[torch.Tensor, SavedStorage]] = field(default_factory=dict)

    def by_owner(self) -> dict[tuple[str, str], list[SavedStorage]]:
        """Saved storages grouped by (owner, dtype), in forward order."""
        groups: dict[tuple[str, str], list[SavedStorage]] = {}
        for item in self.saved:
            groups.setdefault((item.owner, item.dtype), []).append(item)
        return groups

    @property
    def total_bytes(self) -> int:
        return sum(item.nbytes for item in self.saved)


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, meta)
        return None
    return storage.data_ptr() if storage.nbytes() else None


@contextlib.contextmanager
def record(model: torch.nn.Module) -> Iterator[Recorder]:
    """Record what autograd saves while the body runs ``model``'s forward (grad enabled)."""
    recorder = Recorder()
    names = {module: name for name, module in model.named_modules()}
    stack: list[str] = []
    excluded = {
        key
        for tensor in [*model.parameters(), *model.buffers()]
        if (key := _storage_key(tensor)) is not None
    }

    def push(module: torch.nn.Module, args: Any) -> None:
        stack.append(names.get(module, ROOT) or ROOT)

    def pop(module: torch.nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key is None or key in excluded:
            return tensor
        owner = stack[-1] if stack else ROOT
        if key in recorder._seen and not recorder._seen[key][0].untyped_storage().nbytes():
            # The storage seen at this address was released since (an output-discarding
            # recompute frees it while it is still referenced): this is a new one.
            recorder._seen.pop(key)[1].nbytes = 0
        if key in recorder._seen:
            first = recorder._seen[key][1]
            if owner != first.owner and owner not in first.also:
                first.also.append(owner)
            return tensor
        item = SavedStorage(
            owner=owner,
            order=len(recorder.saved),
            dtype=str(tensor.dtype).removeprefix("torch."),
            nbytes=tensor.untyped_storage().nbytes(),
            shape=tuple(tensor.shape),
        )
        # The tensor is kept referenced: its storage's address cannot be reused meanwhile.
        recorder._seen[key] = (tensor, item)
        recorder.saved.append(item)
        return tensor

    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield recorder
    finally:
        for handle in handles:
            handle.remove()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def saved_bytes(model: torch.nn.Module, forward: Callable[[], Any]) -> Recorder:
    """Run ``forward()`` under :func:`record` and return what it saved and still holds when
    the forward ends (the autograd graph is dropped before returning)."""
    with record(model) as recorder:
        output = forward()
    # What is held until backward: a storage the forward released after it was saved (an
    # output-discarding recompute frees a norm's output once the next linear saved it) holds
    # nothing, and is left out.
    for tensor, item in recorder._seen.values():
        item.nbytes = tensor.untyped_storage().nbytes()
    recorder.saved = [item for item in recorder.saved if item.nbytes]
    del output
    recorder._seen.clear()
    return recorder
