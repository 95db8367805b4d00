"""Full recompute with each recomputed segment's input on the host (``offload_modules:
[layer_input]``, the name Megatron-LM PR 5218 gives the same feature).

Under full recompute each segment's input is what stays on the GPU, growing with length and
layers; :class:`LayerInputOffloader` moves it to the host in forward and brings it back ahead of
the segment's recompute. The Megatron code relied on is hashed in :data:`FINGERPRINTS`. How:
docs/offloading.md.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from nemo_rl_offload.offload import owned


def same_layout(
    tensor: torch.Tensor, device: torch.device, *, pin_memory: bool = False
) -> torch.Tensor:
    """An empty tensor with ``tensor``'s sizes, strides and dtype on ``device``. A segment input
    of one sequence ([s, 1, h]) is contiguous whatever its batch dimension's stride, and the
    block's input comes from a transpose (batch stride s * h) where a plain ``empty`` gives h:
    the recompute, and the gradient it returns for the input, must see the layout the forward
    saw, or kernels that read strides may take another path and change the gradient's bits."""
    return torch.empty_strided(
        tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device, pin_memory=pin_memory
    )


@dataclass
class Counters:
    """What went through the offload path: tensors and bytes each way, since the last reset."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    reloaded_tensors: int = 0
    reloaded_bytes: int = 0

    def reset(self) -> None:
        self.offloaded_tensors = self.offloaded_bytes = 0
        self.reloaded_tensors = self.reloaded_bytes = 0


@dataclass
class _Chain:
    """The segment inputs of one block forward, in forward order (weakly: each is owned by the
    autograd graph that saved it, and freed with it)."""

    handles: list[weakref.ref[_Offloaded]] = field(default_factory=list)


class _Offloaded:
    """A segment input on the host, and its copy back to the device once started."""

    def __init__(
        self, host: torch.Tensor, device: torch.device, event: Any, chain: _Chain, index: int
    ) -> None:
        self.host = host
        self.device = device
        self.offload_event = event  # None on CPU
        self.chain = chain
        self.index = index
        self.reloaded: torch.Tensor | None = None
        self.reload_event: Any = None


class LayerInputOffloader:
    """Saved-tensor hooks that move each full-recompute segment's input to the host in forward
    and back in backward (see docs/offloading.md)."""

    def __init__(self) -> None:
        self.counters = Counters()
        self._streams: tuple[Any, Any] | None = None
        # While a block's forward runs: the tensors its layers received inside Megatron's
        # checkpoint (by id, weakly: each is freed as soon as the forward lets it go).
        self._marked: dict[int, weakref.ref[torch.Tensor]] | None = None

    def _cuda_streams(self) -> tuple[Any, Any]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def mark(self, hidden_states: Any) -> None:
        """A layer's input, seen as the layer starts: a segment input when Megatron's
        checkpoint runs the segment's forward (``is_checkpointing()``, without gradients).
        The checkpoint saves its inputs only after that forward has returned, when
        ``is_checkpointing()`` is false again, so the hook recognises them by identity."""
        if (
            self._marked is not None
            and isinstance(hidden_states, torch.Tensor)
            and is_checkpointing()
            and not torch.is_grad_enabled()
        ):
            self._marked[id(hidden_states)] = weakref.ref(hidden_states)

    @contextlib.contextmanager
    def segment_inputs(self, shape: torch.Size, dtype: torch.dtype) -> Iterator[None]:
        """While the body runs a block's forward whose input has ``shape`` and ``dtype``,
        offload every segment input Megatron's checkpoint saves (the layers report their
        inputs through :meth:`mark`)."""
        chain = _Chain()
        marked: dict[int, weakref.ref[torch.Tensor]] = {}

        def pack(tensor: torch.Tensor) -> Any:
            ref = marked.get(id(tensor))
            if (
                ref is not None
                and ref() is tensor
                and tensor.shape == shape
                and tensor.dtype == dtype
                and tensor.is_contiguous()
            ):
                del marked[id(tensor)]
                return self._offload(tensor, chain)
            return tensor

        def unpack(saved: Any) -> torch.Tensor:
            return self._reload(saved) if isinstance(saved, _Offloaded) else saved

        outer, self._marked = self._marked, marked
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._marked = outer

    def _offload(self, tensor: torch.Tensor, chain: _Chain) -> _Offloaded:
        event = None
        if tensor.is_cuda:
            d2h, _ = self._cuda_streams()
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                host = same_layout(tensor, torch.device("cpu"), pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record(d2h)
            tensor.record_stream(d2h)
        else:
            host = same_layout(tensor, tensor.device).copy_(tensor.detach())
        handle = _Offloaded(host, tensor.device, event, chain, len(chain.handles))
        chain.handles.append(weakref.ref(handle))
        self.counters.offloaded_tensors += 1
        self.counters.offloaded_bytes += tensor.nbytes
        return handle

    def _start_reload(self, handle: _Offloaded) -> None:
        """Begin ``handle``'s copy back to its device (on the host-to-device stream)."""
        if handle.offload_event is None:
            handle.reloaded = same_layout(handle.host, handle.device).copy_(handle.host)
            return
        _, h2d = self._cuda_streams()
        compute = torch.cuda.current_stream()
        device = same_layout(handle.host, handle.device)
        h2d.wait_stream(compute)  # the allocated memory's earlier users on the compute stream
        h2d.wait_event(handle.offload_event)  # the host copy is complete
        with torch.cuda.stream(h2d):
            device.copy_(handle.host, non_blocking=True)
            handle.reload_event = torch.cuda.Event()
            handle.reload_event.record(h2d)
        device.record_stream(h2d)  # freed early (a failed backward): the copy still ends first
        handle.reloaded = device

    def _reload(self, handle: _Offloaded) -> torch.Tensor:
        if handle.reloaded is None:
            self._start_reload(handle)
        tensor = handle.reloaded
        assert tensor is not None
        if handle.reload_event is not None:
            torch.cuda.current_stream().wait_event(handle.reload_event)
        # Autograd owns the returned tensor from here (freed after this segment's backward);
        # the host copy stays for a second backward through a retained graph.
        handle.reloaded = None
        handle.reload_event = None
        self.counters.reloaded_tensors += 1
        self.counters.reloaded_bytes += tensor.nbytes
        if handle.index > 0:
            previous = handle.chain.handles[handle.index - 1]()
            if previous is not None and previous.reloaded is None:
                self._start_reload(previous)  # the next segment backward runs
        return tensor


# --- the Megatron code relied on -------------------------------------------------------------

# (module, qualified name) -> source hash (owned.fingerprint) in owned.CHECKED_MEGATRON_VERSION.
FINGERPRINTS: dict[tuple[str, str], str] = {
    ("megatron.core.tensor_parallel.random", "CheckpointFunction.forward"): "d9146db1735a3150",
    ("megatron.core.tensor_parallel.random", "is_checkpointing"): "ffab40106eb79215",
    ("megatron.core.recompute", "checkpointed_forward"): "55bd58bd6fbff211",
    ("megatron.core.transformer.transformer_block", "TransformerBlock.forward"): "8bac43f65e586611",
}


def installed_fingerprints() -> dict[tuple[str, str], str | None]:
    """Each :data:`FINGERPRINTS` entry's hash in the installed megatron-core (None: missing)."""
    import importlib

    digests: dict[tuple[str, str], str | None] = {}
    for module_name, qualname in FINGERPRINTS:
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            digests[(module_name, qualname)] = owned.fingerprint(obj)
        except (ImportError, AttributeError, OSError, TypeError, SyntaxError):
            digests[(module_name, qualname)] = None
    return digests


def drift() -> str | None:
    """One line refusing ``layer_input`` when the Megatron code it relies on changed since it
    was checked, else None."""
    installed = installed_fingerprints()
    changed = [key[1] for key, digest in FINGERPRINTS.items() if installed[key] != digest]
    if not changed:
        return None
    return (
        f"the layer_input offload relies on megatron-core's {', '.join(changed)}, which changed "
        f"since megatron-core {owned.CHECKED_MEGATRON_VERSION} ({owned._installed_version()} is "
        f"installed); remove layer_input from offload_modules or pin "
        f"megatron-core=={owned.CHECKED_MEGATRON_VERSION}"
    )
