"""One host copy per saved storage: two offload groups that save the same bytes move them once.

Two modules can save views of one storage (SDPA's output, ``linear_proj``'s input), and
Megatron's offload groups copy per saved tensor. :class:`SharedCopies` copies such a storage
once, and a storage marked :func:`keep_on_gpu` not at all. The cases: docs/offloading.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
from torch import Tensor


def is_dense_permutation(tensor: Any) -> bool:
    """Whether the tensor's elements fill its memory span exactly, in some order of its
    dimensions (a transpose or permute of a contiguous tensor), so that its bytes can be copied
    as one block. Dimensions of size 1 have no meaningful stride and are skipped."""
    if tensor.is_contiguous():  # the identity order (the offload hooks ask this per tensor)
        return True
    expected = 1
    laid_out = zip(tensor.shape, tensor.stride(), strict=True)
    for stride, size in sorted((stride, size) for size, stride in laid_out if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def is_storage_image(tensor: Tensor) -> bool:
    """Whether ``tensor``'s elements are exactly its storage's bytes (from its first byte, no
    gaps, no overlap, in some order of its dimensions): then a host copy with its strides is
    a byte image of the storage, and any other such view of it can be read from that copy."""
    nbytes = tensor.untyped_storage().nbytes()
    return (
        tensor.storage_offset() == 0
        and tensor.numel() * tensor.element_size() == nbytes
        and is_dense_permutation(tensor)
    )


@dataclass(eq=False)
class SharedCopy:
    """The one host copy of a storage that several offloaded tensors view, and its GPU copy
    once the first of them is reloaded (dropped when the last one is)."""

    device: torch.device
    host: Tensor  # the first saver's host copy, laid out as its GPU bytes
    use_cpu_pool: bool
    views: int = 0
    gpu: Tensor | None = None

    def materialize(self, pool: Any, non_blocking: bool | None) -> Tensor:
        """The GPU copy: made (one copy from the host; the host buffer goes back to the
        pool) by the first view reloaded, on the stream current then."""
        if self.gpu is None:
            host = self.host
            if non_blocking is None:
                non_blocking = host.is_pinned()
            gpu = torch.empty_strided(
                host.shape, host.stride(), dtype=host.dtype, device=self.device
            )
            gpu.copy_(host, non_blocking=non_blocking)
            if self.use_cpu_pool:
                pool.free(host)
            self.gpu = gpu
        return self.gpu


class SharedView(tuple):
    """An offloaded tensor that views a :class:`SharedCopy`: a tuple, as Megatron's offloaded
    states are (its hooks reload any tuple), of (copy, shape, stride)."""

    __slots__ = ()

    def __new__(cls, copy: SharedCopy, tensor: Tensor) -> SharedView:
        copy.views += 1
        return super().__new__(cls, (copy, tuple(tensor.shape), tuple(tensor.stride())))

    @property
    def copy(self) -> SharedCopy:
        return self[0]

    def moved_bytes(self) -> int:
        """Bytes its reload copies: the storage's, if it is the first view reloaded."""
        copy = self.copy
        return 0 if copy.gpu is not None else copy.host.numel() * copy.host.element_size()

    def reload(self, pool: Any, non_blocking: bool | None = None) -> Tensor:
        copy, shape, stride = self
        gpu = copy.materialize(pool, non_blocking)
        copy.views -= 1
        if copy.views == 0:
            copy.gpu = None  # the views handed out hold it now
        return gpu.as_strided(shape, stride, gpu.storage_offset())


@dataclass
class _Offloaded:
    """A noted first saver: its group and tag (to turn its state into a view) and state."""

    group: Any
    tag: Any
    state: tuple


def found_dtype(found: _Offloaded | SharedCopy) -> torch.dtype:
    return (found.state[1] if isinstance(found, _Offloaded) else found.host).dtype


class _ByStorage:
    """A map keyed by storage object identity, held weakly: an entry goes when its storage
    is freed, so a new storage at the same address never matches it (torch keeps one Python
    object per live storage)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, storage: Any) -> Any:
        item = self._items.get(id(storage))
        return item[1] if item is not None and item[0]() is storage else None

    def put(self, storage: Any, value: Any) -> None:
        key = id(storage)
        items = self._items

        def forget(ref: weakref.ref) -> None:
            if key in items and items[key][0] is ref:
                del items[key]

        items[key] = (weakref.ref(storage, forget), value)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class SharedCopies:
    """One micro-batch handler's record of the storages it offloaded and of those to keep."""

    _offloaded: _ByStorage = field(default_factory=_ByStorage)
    _kept: _ByStorage = field(default_factory=_ByStorage)

    def keep(self, tensor: Tensor) -> None:
        """Never offload ``tensor``'s storage in this micro-batch (another module holds it)."""
        storage = tensor.untyped_storage()
        self._kept.put(storage, True)

    def kept(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s storage was marked; no storage lookup while none is (the offload
        check asks this of every saved tensor)."""
        return bool(self._kept) and self._kept.get(tensor.untyped_storage()) is not None

    def view_of(self, tensor: Tensor) -> SharedView | None:
        """A view of the copy already made of ``tensor``'s storage in this micro-batch (the
        first saver's state becomes a view too), or None: it must be copied. ``tensor`` is a
        storage image (:func:`is_storage_image`, which the caller checks once for this and
        :meth:`note`)."""
        found = self._offloaded.get(tensor.untyped_storage())
        if found is None or found_dtype(found) != tensor.dtype:
            return None
        if isinstance(found, _Offloaded):  # the second saver: the first's state becomes a view
            if found.group._tensors.get(found.tag) is not found.state:
                return None  # reloaded or replaced since: not a copy to share any more
            device, host, use_cpu_pool = found.state
            copy = SharedCopy(device, host, use_cpu_pool)
            found.group._tensors[found.tag] = SharedView(copy, host)
            self._offloaded.put(tensor.untyped_storage(), copy)
            found = copy
        return SharedView(found, tensor)

    def note(self, group: Any, tag: Any, tensor: Tensor, state: Any) -> None:
        """``tensor``, a storage image (as for :meth:`view_of`), was offloaded as ``state``:
        later savers of its storage can share it when the host copy has its strides."""
        if type(state) is tuple and len(state) == 3 and state[1].stride() == tensor.stride():
            self._offloaded.put(tensor.untyped_storage(), _Offloaded(group, tag, state))

    def __len__(self) -> int:
        """Storages noted and still alive."""
        return len(self._offloaded) + len(self._kept)


def keep_on_gpu(tensor: Tensor) -> None:
    """Mark ``tensor``'s storage as not to be offloaded by the micro-batch being run forward,
    when this package's offload runtime runs it (a module that knows a later module keeps the
    same bytes on the GPU calls this: copying them out would free nothing)."""
    manager = fgo.PipelineOffloadManager.OFFLOAD_MGR
    chunk = getattr(manager, "_cur_forward_chunk", None) if manager is not None else None
    shared = getattr(chunk, "shared_copies", None)
    if isinstance(shared, SharedCopies):
        shared.keep(tensor)
