"""The offload runtime's own subclasses of Megatron-core 0.19's offload classes.

The runtime (:mod:`.runtime`) installs an :class:`OwnedOffloadManager` as Megatron's singleton;
it makes :class:`OwnedChunkHandler` handlers that share one :class:`OwnedHostPool`, and
:class:`PlanChoices` picks per plan what differs from Megatron. No Megatron class is replaced;
every Megatron function relied on is hashed in :data:`FINGERPRINTS`. The choices:
docs/offloading.md.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import functools
import hashlib
import importlib.metadata
import inspect
import io
import math
import textwrap
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.offload.shared_copies import (
    SharedCopies,
    SharedView,
    is_dense_permutation,
    is_storage_image,
)

# The megatron-core release whose offload code the subclasses below were checked against.
CHECKED_MEGATRON_VERSION = "0.19.2"
FRACTION_PLACEMENTS = ("spread", "earliest")


class CopyTimer:
    """Time and bytes of the offload (device-to-host) and reload (host-to-device) copies.

    Megatron issues each group's copies on a side stream; CUDA events recorded on that stream
    just before them (after the stream's waits) and just after them bound the copies. The sum
    of those intervals is the time the copy streams spent on the step's copies (on a step that
    records a plan it includes allocating the pinned buffers); bytes over that time is the
    bandwidth achieved. Events are read after the step, when they have completed, so the timing
    adds no synchronisation to the step itself. Not recorded while a CUDA graph is captured."""

    def __init__(self) -> None:
        self._pending: dict[str, list[tuple[Any, Any, int]]] = {"d2h": [], "h2d": []}
        self._spare: list[Any] = []  # events read by collect(), recorded again next step

    def event(self) -> Any:
        """A timing event to record: one read already, or a new one."""
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def record(self, direction: str, start: Any, end: Any, nbytes: int) -> None:
        self._pending[direction].append((start, end, nbytes))

    def collect(self) -> dict[str, float]:
        """Totals since the last call: seconds, GiB and GB/s per direction."""
        metrics: dict[str, float] = {}
        for direction, intervals in self._pending.items():
            seconds = sum(start.elapsed_time(end) for start, end, _ in intervals) / 1e3
            nbytes = sum(count for *_, count in intervals)
            metrics[f"{direction}_time_s"] = seconds
            metrics[f"{direction}_gib"] = nbytes / 2**30
            metrics[f"{direction}_gb_per_s"] = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            self._spare.extend(event for start, end, _ in intervals for event in (start, end))
            intervals.clear()
        return metrics


@dataclass(frozen=True)
class PlanChoices:
    """What a plan's manager, handlers and pool do differently from Megatron's own classes.
    Every default is Megatron's behaviour; the runtime sets them (:class:`.runtime.OffloadRuntime`).

    - ``reload_waits_for_offload``: :meth:`OwnedChunkHandler.tensor_pop`;
    - ``strided_copies``: :meth:`OwnedChunkHandler.offload` and ``reload``;
    - ``fraction_placement``: ``"spread"`` or ``"earliest"`` (Megatron's),
      :meth:`OwnedOffloadManager.post_warmup_callback`;
    - ``fraction_by_module``: (module, fraction) pairs that take the place of the plan's
      fraction for those modules' groups (spread placement only);
    - ``pool_expert_groups``: :meth:`OwnedOffloadManager.post_warmup_callback`;
    - ``pool_every_group``: :meth:`OwnedChunkHandler.offload` (the pool serves any size);
    - ``lean_hooks``: the hooks of :class:`OwnedChunkHandler`;
    - ``one_copy_per_storage``: the offload check (kept storages) and the lean offload (shared
      copies; :mod:`.shared_copies`);
    - ``copy_timer``: where the copies' CUDA events go (None: the copies are not timed).
    """

    reload_waits_for_offload: bool = False
    strided_copies: bool = False
    fraction_placement: str = "earliest"
    fraction_by_module: tuple[tuple[str, float], ...] = ()
    pool_expert_groups: bool = False
    pool_every_group: bool = False
    lean_hooks: bool = False
    one_copy_per_storage: bool = False
    copy_timer: CopyTimer | None = None

    def __post_init__(self) -> None:
        if self.fraction_placement not in FRACTION_PLACEMENTS:
            raise ValueError(
                f"fraction_placement {self.fraction_placement!r}: one of {FRACTION_PLACEMENTS}"
            )
        if self.fraction_by_module and self.fraction_placement != "spread":
            raise ValueError("fraction_by_module: needs the spread fraction placement")


def _state_bytes(state: Any) -> int:
    """Bytes an offloaded tensor's reload copies (Megatron keeps (device, host tensor, pooled);
    a view of a shared copy moves the storage once)."""
    if isinstance(state, SharedView):
        return state.moved_bytes()
    host = state[1]
    return host.numel() * host.element_size()


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream: never before CUDA is
    initialised (a cheaper first test than ``torch.cuda.is_available()``, which reads the
    environment on every call)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _timing_wanted() -> bool:
    """Copies are timed except while a CUDA graph is captured (its events would be captured)."""
    return not torch.cuda.is_current_stream_capturing()


def spread_choice(count: int, fraction: float) -> list[bool]:
    """Which of ``count`` offload groups (in forward order) to offload: as many as Megatron's
    fraction rule keeps (it turns off ``int(count * (1 - fraction))``), evenly spaced."""
    kept = count - int(count * (1 - fraction))
    return [(index * kept) % count < kept for index in range(count)]


def _summary_bytes(manager: Any) -> dict[str, int]:
    """Offloaded bytes per module as Megatron's own summary counts them (the groups set to
    offload, up to the first chunk whose backward runs first)."""
    totals: dict[str, int] = {}
    for chunk in manager._cached_chunks_forward:
        for group in chunk.offload_groups:
            if group.offload:
                totals[group._name] = totals.get(group._name, 0) + group.total_offload_bytes
        if chunk is manager._cached_chunks_backward[0]:
            break
    return totals


class _Streams:
    """The current CUDA stream without building a ``torch.cuda.Stream`` per call, and stream
    switches without ``torch.cuda.stream``'s context manager (benchmarks/host_primitives.py
    measures both); Megatron 0.19's hook code makes seven such calls per offloaded group (eight
    with tensors to release). One ``Stream`` object is kept per stream seen (a handful)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int, int], Any] = {}

    def current(self) -> Any:
        key = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
        stream = self._known.get(key)
        if stream is None:
            stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._known[key] = stream
        return stream

    def use(self, stream: Any) -> None:
        """Make ``stream`` current (on its device, which is the current one here)."""
        torch._C._cuda_setStream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )


_STREAMS = _Streams()
_WAITED: dict[int, Any] = {}  # one reused event per waiting stream (keyed by its id)
_STRAY_TYPES = (FakeTensor, FunctionalTensor)


def _wait_for(stream: Any, producer: Any) -> None:
    """``stream`` waits for the work issued so far on ``producer`` (through one reused event
    per waiting stream, instead of ``wait_stream``'s new event per call)."""
    event = _WAITED.get(id(stream))
    if event is None:
        event = _WAITED[id(stream)] = torch.cuda.Event()
    event.record(producer)
    stream.wait_event(event)


SIZE_CLASS_STEPS = 16  # size classes per doubling: a buffer exceeds its request by < 1/16
_CLASS_SHIFT = SIZE_CLASS_STEPS.bit_length() - 1
PAGE = 4096
# The pool rebuilds its buffers when it holds more than this many times its largest plan's need.
POOL_SLACK = 1.25


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` gets when the pool makes a new buffer: rounded up
    to a multiple of a sixteenth of its power of two (and of a page), so that a buffer exceeds
    its request by less than a sixteenth while nearby requests share a class."""
    if nbytes <= PAGE:
        return PAGE
    granule = max(PAGE, 1 << (nbytes.bit_length() - 1 - _CLASS_SHIFT))
    return -(-nbytes // granule) * granule


def _best_fit_sizes(steps: list[list[tuple[int, int]]], given: list[int]) -> list[int]:
    """The buffer sizes the pool's own rule (best fit, else a new buffer of the request's
    class) adds to the buffers ``given`` so that every recorded step, each starting with every
    buffer free, is served without a new buffer: the steps are replayed in order, and again
    while a pass adds a buffer (a buffer added for a later step can change what best fit picks
    in an earlier one). A step is a list of (handle, bytes) events: bytes > 0 draws a buffer
    for ``handle``, 0 returns it."""
    added: list[int] = []
    grew = True
    while grew:
        grew = False
        for events in steps:
            free = sorted(given + added)
            held: dict[int, int] = {}
            for handle, nbytes in events:
                if nbytes == 0:
                    if handle in held:
                        bisect.insort(free, held.pop(handle))
                    continue
                index = bisect.bisect_left(free, nbytes)
                if index < len(free):
                    held[handle] = free.pop(index)
                else:
                    size = size_class(nbytes)
                    added.append(size)
                    held[handle] = size
                    grew = True
    return added


def _power_of_two(nbytes: int) -> int:
    return 1 << (max(1, nbytes) - 1).bit_length()


def pack_slabs(sizes: list[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Buffers of ``sizes`` laid out in slabs whose sizes are powers of two: (slab size,
    [(offset, size)]) per slab. Torch's caching host allocator rounds every pinned allocation
    up to a power of two, so a slab of one pins what it says. Each slab is the largest power of
    two within the bytes left to place (at least the largest buffer's), filled largest buffer
    first; the waste is at most the last, smallest slabs' slack."""
    remaining = sorted(sizes, reverse=True)
    slabs: list[tuple[int, list[tuple[int, int]]]] = []
    while remaining:
        total = sum(remaining)
        capacity = max(_power_of_two(remaining[0]), 1 << (total.bit_length() - 1))
        placed: list[tuple[int, int]] = []
        rest: list[int] = []
        used = 0
        for size in remaining:
            if used + size <= capacity:
                placed.append((used, size))
                used += size
            else:
                rest.append(size)
        slabs.append((capacity, placed))
        remaining = rest
    return slabs


class _Buffer:
    """One buffer of the pool: ``data``, bytes of its slab (a pinned uint8 tensor whose size is
    a power of two, from torch's caching host allocator, so that a CUDA graph may capture copies
    to it: torch refuses memory it does not know as pinned), at its offset."""

    __slots__ = ("data", "size", "slab")

    def __init__(self, slab: torch.Tensor, offset: int, size: int) -> None:
        self.slab = slab
        self.size = size
        self.data = slab[offset : offset + size]


class OwnedHostPool(fgo.OffloadTensorPool):
    """The pinned host buffers every plan of a runtime shares, by size rather than by shape.

    Megatron's pool keeps buffers per exact (shape, dtype): every step shape adds its own set,
    so a runtime with many shapes pins the sum of their needs though one step at a time uses
    them. Here a buffer is bytes of a size class (:func:`size_class`); a request takes the
    smallest free buffer that holds it (best fit), viewed as the requested dtype and shape,
    contiguous (a strided copy views that as its strides: a dense permutation spans exactly its
    elements), or else a new buffer. Buffers are live only within a step: an
    offload in the forward pass draws one, its reload in the backward returns it, and the
    manager's reset at the end of the step (Megatron's schedules call it) makes every buffer
    free again, so a smaller step shape runs in the buffers of a larger one.

    Accounting: per plan (:attr:`plan`, set by the runtime before each step) its *need*, the
    most requested bytes live at once in its steps, and the draws of its latest step. After a
    step, :meth:`settle` rebuilds the buffers when the pool holds more than
    :data:`POOL_SLACK` times the largest kept plan's need (shapes that came smallest first leave
    buffers too small for later ones): it replays the kept plans' recorded steps, largest need
    first, under the same best-fit rule (:func:`_best_fit_sizes`), and makes the pool those
    buffers. Where every plan's live buffers fit in the largest plan's (one model's layers at
    shorter lengths or fewer micro-batches), that is the largest plan's own set: its need plus
    less than a sixteenth (the classes) and the slack of the slabs.

    CUDA graphs: a graph captured with offloading writes to the buffers its capture drew on
    every replay, with no Python to draw them again. Those buffers stay reserved for the plan
    (kept through rebuilds, dropped only when the plan is released, and the runtime's
    ``on_release`` drops its graphs with it); between its steps other plans may use them, as
    nothing lives in them across a step's end, and steps run one at a time.

    Pinned memory comes from torch's caching host allocator, which rounds each allocation up to
    a power of two and keeps it cached when freed: buffers lie in slabs of powers of two
    (:func:`pack_slabs`; a buffer made during a step is a slab of its own, until the next
    rebuild packs it), :meth:`pinned_bytes` counts the slabs, and a rebuild that drops slabs
    empties torch's host cache, so that ``torch.cuda.host_memory_stats`` counts only what is
    held."""

    def __init__(self, *, device: str = "cpu", pin_memory: bool = True):
        super().__init__(device=device, pin_memory=pin_memory)
        self.plan: Hashable = None  # the plan whose step draws buffers now
        self._buffers: dict[int, _Buffer] = {}  # by address
        self._free: list[tuple[int, int]] = []  # (size, address), sorted
        self._live: dict[int, int] = {}  # address of a drawn buffer: the bytes requested
        self._live_bytes = 0
        self.need_by_plan: dict[Hashable, int] = {}
        self.reserved_by_plan: dict[Hashable, set[int]] = {}  # drawn under graph capture
        # Per plan: its latest step's events, (handle, bytes drawn) or (handle, 0) for a return.
        self._steps: dict[Hashable, list[tuple[int, int]]] = {}
        self._stepping: set[Hashable] = set()  # plans whose step is being recorded
        self._handles = 0
        self._handle_of: dict[int, int] = {}  # address of a drawn buffer: its event handle
        # (address, bytes, dtype, shape): the view allocate lent for it (dropped with buffers)
        self._views: dict[tuple[int, int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self.grew = False  # a buffer was made since the last settle

    # --- accounting -------------------------------------------------------------------------

    def pinned_bytes(self) -> int:
        """Bytes of the slabs the pool's buffers lie in (pinned, on a GPU host)."""
        slabs = {id(buffer.slab): buffer.slab for buffer in self._buffers.values()}
        return sum(slab.numel() for slab in slabs.values())

    def _slab_buffers(self, sizes: list[int]) -> list[_Buffer]:
        """New buffers of ``sizes``, in new slabs (:func:`pack_slabs`)."""
        buffers = []
        for capacity, placed in pack_slabs(sizes):
            slab = torch.empty(
                capacity, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory
            )
            buffers.extend(_Buffer(slab, offset, size) for offset, size in placed)
        return buffers

    def _drop(self, addresses: list[int]) -> None:
        """Forget the (free) buffers at ``addresses``, and give torch's host cache back when
        pinned: their slabs would stay cached there (and counted) otherwise."""
        if not addresses:
            return
        for address in addresses:
            self._buffers.pop(address, None)
        dropped = set(addresses)
        self._views = {key: v for key, v in self._views.items() if key[0] not in dropped}
        if self.pin_memory and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no copy of the last step still uses a dropped slab
            torch._C._host_emptyCache()

    def largest_need(self) -> int:
        """The largest need (most bytes live at once in a step) of a kept plan."""
        return max(self.need_by_plan.values(), default=0)

    def in_use(self) -> int:
        """Buffers drawn and not returned."""
        return len(self._live)

    # --- Megatron's interface ---------------------------------------------------------------

    def allocate(self, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A free buffer of at least the request's bytes (the smallest), or a new one of its
        size class, viewed as ``shape`` and ``dtype``; the draw is noted for :attr:`plan`.

        Stands in for: no upstream issue (Megatron keys buffers by exact shape, so pinned
        memory grows with the sum over step shapes).
        Remove when: Megatron's pool shares buffers across shapes and bounds its pinned bytes
        (then ``FINGERPRINTS`` loses its entry)."""
        numel = shape.numel() if isinstance(shape, torch.Size) else math.prod(map(int, shape))
        nbytes = numel * dtype.itemsize
        self._stats["allocation_requests"] += 1
        index = bisect.bisect_left(self._free, (nbytes, -1))
        if index < len(self._free):
            _, address = self._free.pop(index)
            self._stats["pool_hits"] += 1
        else:  # a slab of its own, all of it lendable, until a rebuild packs it
            buffer = self._slab_buffers([_power_of_two(size_class(nbytes))])[0]
            address = buffer.data.data_ptr()
            self._buffers[address] = buffer
            self.grew = True
            self._stats["total_allocated"] += 1
            self._stats["pool_misses"] += 1
        self._stats["current_in_use"] += 1
        self._live[address] = nbytes
        self._live_bytes += nbytes
        plan = self.plan
        if self._live_bytes > self.need_by_plan.get(plan, 0):
            self.need_by_plan[plan] = self._live_bytes
        if plan not in self._stepping:  # the plan's first draw of this step
            self._stepping.add(plan)
            self._steps[plan] = []
        self._handles += 1
        self._handle_of[address] = self._handles
        self._steps[plan].append((self._handles, nbytes))
        if _capturing():
            self.reserved_by_plan.setdefault(plan, set()).add(address)
        # A step's draws recur in the next step (same buffer, dtype and shape): the typed view
        # is made once per buffer and request, not per draw.
        key = (address, nbytes, dtype, tuple(shape))
        view = self._views.get(key)
        if view is None:
            data = self._buffers[address].data[:nbytes]
            view = self._views[key] = data.view(dtype).view(shape)
        return view

    def free(self, tensor: torch.Tensor) -> None:
        """Return the buffer ``tensor`` views (the tensor :meth:`allocate` gave, or any view
        of its memory from its first byte, as a strided copy's base).

        Stands in for: as :meth:`allocate`. Remove when: as :meth:`allocate`."""
        address = tensor.data_ptr()
        nbytes = self._live.pop(address, None)
        if nbytes is None:
            raise ValueError(f"free of memory the pool did not lend (address {address:#x})")
        self._stats["free_requests"] += 1
        self._stats["current_in_use"] -= 1
        self._live_bytes -= nbytes
        bisect.insort(self._free, (self._buffers[address].size, address))
        handle = self._handle_of.pop(address)
        events = self._steps.get(self.plan)
        if events is not None:
            events.append((handle, 0))

    def reset(self) -> None:
        """Every buffer free again: the step ended (the manager's reset, from Megatron's
        schedules), so nothing lives in them; the next draws start a new step's record.

        Stands in for: as :meth:`allocate`. Remove when: as :meth:`allocate`."""
        self._live.clear()
        self._handle_of.clear()
        self._live_bytes = 0
        self._stepping.clear()
        self._free = sorted((buffer.size, address) for address, buffer in self._buffers.items())
        self._stats["current_in_use"] = 0

    def clear(self) -> None:
        """Drop every buffer (unpinning it).

        Stands in for: as :meth:`allocate`. Remove when: as :meth:`allocate`."""
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone
            self._drop(list(self._buffers))
        self._buffers.clear()
        self._views.clear()
        self._free.clear()
        self._live.clear()
        self._handle_of.clear()
        self._live_bytes = 0
        self._stats["current_in_use"] = 0

    # --- the runtime's interface ------------------------------------------------------------

    def release(self, plan: Hashable) -> None:
        """Forget ``plan`` (its need, record and reserved buffers), then :meth:`settle`, which
        drops what the kept plans no longer need."""
        self.need_by_plan.pop(plan, None)
        self.reserved_by_plan.pop(plan, None)
        self._steps.pop(plan, None)
        self._stepping.discard(plan)
        self.settle(force=True)

    def settle(self, *, force: bool = False) -> None:
        """After a step: when buffers were made since the last settle and the pool holds more
        than :data:`POOL_SLACK` times the largest kept plan's need (or ``force``, after a
        release), rebuild it: the slabs holding buffers reserved by graphs (or still drawn)
        stay, and the buffers the kept plans' recorded steps need besides, under the pool's
        own rule with the largest need first (:func:`_best_fit_sizes`), are made anew in
        packed slabs, in place of the others; only where that holds fewer bytes. A plan's next
        step then draws what its recorded one did, so the pool does not grow again for it."""
        grew, self.grew = self.grew, False
        if not force and (not grew or self.pinned_bytes() <= POOL_SLACK * self.largest_need()):
            return
        reserved = set().union(*self.reserved_by_plan.values()) | set(self._live)
        kept_slabs = {id(self._buffers[a].slab) for a in reserved if a in self._buffers}
        kept = [b for b in self._buffers.values() if id(b.slab) in kept_slabs]
        order = sorted(self._steps, key=lambda plan: -self.need_by_plan.get(plan, 0))
        wanted = _best_fit_sizes([self._steps[plan] for plan in order], [b.size for b in kept])
        kept_bytes = sum({id(b.slab): b.slab.numel() for b in kept}.values())
        new_bytes = sum(capacity for capacity, _ in pack_slabs(wanted))
        if kept_bytes + new_bytes >= self.pinned_bytes():
            return
        self._drop([a for a, b in self._buffers.items() if id(b.slab) not in kept_slabs])
        for buffer in self._slab_buffers(wanted):
            self._buffers[buffer.data.data_ptr()] = buffer
        self._free = sorted(
            (buffer.size, address)
            for address, buffer in self._buffers.items()
            if address not in self._live
        )


class OwnedChunkHandler(fgo.ChunkOffloadHandler):
    """Megatron's handler of one micro-batch's offloads, with its plan's :class:`PlanChoices`."""

    def __init__(
        self,
        min_offloaded_tensor_size: int,
        cpu_tensor_pool: Any,
        max_inflight_offloads: int | None = None,
        *,
        choices: PlanChoices,
    ) -> None:
        self.choices = choices
        self.shared_copies = SharedCopies()
        super().__init__(
            min_offloaded_tensor_size, cpu_tensor_pool, max_inflight_offloads=max_inflight_offloads
        )

    def _lean_now(self) -> bool:
        """Lean hooks apply: the plan wants them and no CUDA graph is being captured (a capture
        runs once and records what every replay does: there Megatron's code runs)."""
        return self.choices.lean_hooks and not torch.cuda.is_current_stream_capturing()

    # --- Megatron-LM issue 7398 -------------------------------------------------------------

    def tensor_pop(self, tensor_tag: Any) -> Any:
        """Make a synchronous reload wait for its offload copy (``reload_waits_for_offload``).

        Megatron-LM issue 7398: during the warm-up step every group is offloaded, including the
        last one, whose tensors backward needs at once, before any bulk reload. Then Megatron's
        ``tensor_pop`` reloads them on the current stream from pinned memory that the
        device-to-host copy on the side stream may not have finished writing, so the warm-up
        step computes with partly stale activations (step-1 gradients differ from an identical
        model without offload; later steps, which keep that group on the GPU, are bitwise
        equal). The fix: before such a reload, the current stream waits for the group's offload
        event, which the group records after its copies. Such reloads run on the compute stream,
        outside the bulk reloads the copy timing covers, so they are timed here (every reload of
        a MoE warm-up step goes this way).

        A tensor a bulk reload brought back is used only after that reload: Megatron waits for
        a group's reload at the group's backward commit, but a group that encloses others (a
        norm group opened before the attention or MLP groups and committed after them) is used
        by the norm's backward before its commit in the step that records the plan, so here the
        compute stream waits for a reload still pending (``_reloading_group``) before handing
        its tensor out. Megatron's commit still waits and forgets the group as before.

        Stands in for: Megatron-LM issue 7398 (the offload wait); no upstream issue (the reload
        wait of enclosing groups).
        Remove when: the installed megatron-core's ``tensor_pop`` waits for the group's offload
        event itself, and for a pending reload of the group."""
        choices = self.choices
        if isinstance(tensor_tag, torch.Tensor):
            return super().tensor_pop(tensor_tag)
        group = self.offload_groups[tensor_tag[0] - 1]
        state = group._tensors.get(tensor_tag)
        if not isinstance(state, tuple):  # on the GPU already, perhaps by a pending reload
            if not fgo.is_graph_capturing() and group in self._reloading_group:
                group.wait_reload_event(torch.cuda.current_stream())
            return super().tensor_pop(tensor_tag)
        stream = torch.cuda.current_stream()
        if choices.reload_waits_for_offload:
            group.wait_offload_event(stream)
        timer = choices.copy_timer
        if timer is None or not _timing_wanted():
            return super().tensor_pop(tensor_tag)
        start = timer.event()
        start.record(stream)
        result = super().tensor_pop(tensor_tag)
        end = timer.event()
        end.record(stream)
        timer.record("h2d", start, end, _state_bytes(state))
        return result

    # --- strided copies ---------------------------------------------------------------------

    def offload(self, src_tensor: Any, pin_memory: bool = True, use_cpu_pool: bool = True) -> Any:
        """Offload a permuted tensor as its bytes lie (``strided_copies``).

        Megatron's ``offload`` makes every non-contiguous tensor contiguous first: a copy kernel
        on the offload stream, which competes with the compute for the GPU, and the tensor comes
        back in a layout autograd did not save, so a backward kernel that wants the original
        layout converts it again. SDPA saves its query, key and output as permuted views of
        contiguous tensors. Here such a tensor (:func:`is_dense_permutation`) lands in a pinned
        buffer of the same strides (a view of a pooled buffer of its shape: one
        ``cudaMemcpyAsync``, no kernel), and :meth:`reload` brings it back into a GPU tensor of
        the same strides. Other non-contiguous tensors (slices of a larger tensor) keep
        Megatron's path. Chosen per model by ``megatron_settings.runtime_choices`` (where it
        was measured faster on an H100: see docs/offloading.md).

        Stands in for: no upstream issue (Megatron copies every non-contiguous tensor through
        ``contiguous()``).
        Remove when: Megatron offloads a dense permutation as it lies and reloads it with its
        strides.

        ``pool_every_group``: every group's host copy comes from the pool, the expert groups'
        too (Megatron gives those a fresh pinned tensor per offload, which torch's caching
        host allocator keeps, rounded up to a power of two, after the reload)."""
        use_cpu_pool = use_cpu_pool or self.choices.pool_every_group
        contiguous = src_tensor.is_contiguous()
        if contiguous and self.choices.lean_hooks:  # Megatron's copy, without its debug call
            return self._host_copy(src_tensor, use_cpu_pool, pin_memory, contiguous=True)
        if not self.choices.strided_copies or contiguous or not is_dense_permutation(src_tensor):
            return super().offload(src_tensor, pin_memory=pin_memory, use_cpu_pool=use_cpu_pool)
        return self._host_copy(src_tensor, use_cpu_pool, pin_memory, contiguous=False)

    def _host_copy(
        self, src_tensor: Any, use_cpu_pool: bool, pin_memory: bool, *, contiguous: bool
    ) -> tuple[Any, torch.Tensor, bool]:
        """``src_tensor`` copied (asynchronously, when pinned) into a host tensor of its shape
        and strides (a pooled buffer, or a new tensor): Megatron's offload state for it."""
        size = src_tensor.shape
        if use_cpu_pool:
            host = self.cpu_tensor_pool.allocate(size, dtype=src_tensor.dtype)
            if not contiguous:
                host = host.as_strided(size, src_tensor.stride())
        else:
            host = torch.empty_strided(
                size,
                src_tensor.stride(),
                dtype=src_tensor.dtype,
                device="cpu",
                pin_memory=pin_memory,
            )
        host.copy_(src_tensor, non_blocking=pin_memory)
        return (src_tensor.device, host, use_cpu_pool)

    def reload(self, state: Any, non_blocking: bool | None = None) -> Any:
        """Reload a tensor :meth:`offload` kept with its strides into a GPU tensor of the same
        strides; anything else is Megatron's reload.

        A view of a shared copy (``one_copy_per_storage``) is a strided view of the one GPU
        copy of its storage, which the first of its views to be reloaded makes.

        Stands in for: as :meth:`offload`. Remove when: as :meth:`offload`."""
        if isinstance(state, SharedView):
            return state.reload(self.cpu_tensor_pool, non_blocking)
        device, host, use_cpu_pool = state
        if host.is_contiguous():
            return super().reload(state, non_blocking=non_blocking)
        if non_blocking is None:
            non_blocking = host.is_pinned()
        tensor = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        tensor.copy_(host, non_blocking=non_blocking)
        if use_cpu_pool:
            self.cpu_tensor_pool.free(host)  # the pooled buffer this view begins
        return tensor

    # --- copy timing and lean hooks ---------------------------------------------------------

    def bulk_offload_group(self, group_to_offload: Any) -> Any:
        """Megatron's bulk offload with CUDA events around the group's copies (``copy_timer``),
        or its lean version (``lean_hooks``: fewer host calls, same operations, order and
        streams; see :meth:`on_group_commit_forward`).

        Stands in for: no upstream issue (copy timing; host time of the hooks).
        Remove when: Megatron times its copies and its hook code makes no more host calls
        than this one."""
        group = group_to_offload
        if self._lean_now():
            return self._lean_bulk_offload_group(group)
        timer = self.choices.copy_timer
        if timer is None or not _timing_wanted():
            return super().bulk_offload_group(group)
        start = timer.event()
        start.record(self.d2h_stream)
        result = super().bulk_offload_group(group)
        end = timer.event()
        end.record(self.d2h_stream)
        # What the group offloads: Megatron counts it while recording the plan (this very
        # call on that step), and every replay offloads the same tensors.
        timer.record("d2h", start, end, group.total_offload_bytes)
        return result

    def bulk_reload_group(self) -> Any:
        """Megatron's bulk reload with CUDA events around the group's copies (``copy_timer``),
        or its lean version (``lean_hooks``).

        Stands in for: as :meth:`bulk_offload_group`. Remove when: as
        :meth:`bulk_offload_group`."""
        if self._lean_now():
            return self._lean_bulk_reload_group()
        timer = self.choices.copy_timer
        if timer is None or not _timing_wanted():
            return super().bulk_reload_group()
        group = self._groups_to_reload[-1]
        moved = sum(_state_bytes(v) for v in group._tensors.values() if isinstance(v, tuple))
        # Megatron's reload waits for the offload first; waiting here keeps that wait out of
        # the timed interval.
        group.wait_offload_event(self.h2d_stream)
        start = timer.event()
        start.record(self.h2d_stream)
        result = super().bulk_reload_group()
        end = timer.event()
        end.record(self.h2d_stream)
        timer.record("h2d", start, end, moved)
        return result

    def on_group_commit_forward(self, name: str, forced_released_tensors: Any) -> Any:
        """Megatron's hook with ``lean_hooks``: the same operations, in the same order on the
        same streams, with fewer host calls (an eager step whose host is as busy as its GPU pays
        every microsecond of the hooks; docs/offloading.md, "Lean hooks"):

        - a stream waits for the compute stream through one reused event instead of
          ``wait_stream(torch.cuda.current_stream())`` (a new ``Stream`` object and a new event
          per call), when a group's offload or reload starts and when backward waits for a
          reload;
        - the copies switch streams directly (:class:`_Streams`) instead of through the context
          manager, and the copy timing's events are reused (:meth:`CopyTimer.event`);
        - a group's reload counts its bytes in the loop that reloads it, and waits for its
          offload once (the timing wrapper and Megatron each waited);
        - the pinned pool's allocate and free build no debug messages (:class:`OwnedHostPool`,
          whatever the choice);
        - the offload check looks its tensor types up once.

        Not while a CUDA graph is captured (a capture runs once, and records what every replay
        does): there Megatron's code runs.

        Stands in for: no upstream issue (host time of the hooks).
        Remove when: Megatron's hook code makes no more host calls than this one."""
        if not self._lean_now():
            return super().on_group_commit_forward(name, forced_released_tensors)
        if not self.do_offload:
            return None
        _wait_for(self.d2h_stream, _STREAMS.current())
        return self._lean_bulk_offload(name, forced_released_tensors)

    def _lean_bulk_offload(self, name: str, forced_released_tensors: Any) -> None:
        """Megatron's ``bulk_offload`` for the lean commit: no debug messages, and a released
        tensor waits for the compute stream without a new ``Stream`` object per call."""
        pending = self._groups_to_offload
        group = next((g for g in pending if g._name == name), None)
        assert group is not None, f"Group {name} not found in {pending}"
        if self.should_bulk_offload(group):
            self._groups_to_reload.append(group)
            self._lean_bulk_offload_group(group)
            if forced_released_tensors:
                current = _STREAMS.current()
                for released in forced_released_tensors:
                    if self.tensor_need_offloading_checker(released):
                        released.record_stream(current)
                        released.untyped_storage().resize_(0)
        pending.remove(group)

    def on_group_start_forward(self, name: str) -> Any:
        """Megatron's hook, lean with ``lean_hooks``: the same bookkeeping without formatting
        debug messages on every call (Megatron prints them only with its DEBUG flag). It
        records nothing on the GPU, so also under graph capture.

        Stands in for / remove when: as :meth:`on_group_commit_forward`."""
        if not self.choices.lean_hooks:
            return super().on_group_start_forward(name)
        if not self.do_offload:
            return None
        groups = self.offload_groups
        index = self._offloaded_group_index + 1
        if self.is_warmup:
            groups.append(fgo.OffloadTensorGroup(name))
            self._max_group_size = max(self._max_group_size, index)
        else:  # the next group of this name (Megatron's scan, without copying the list)
            while index <= len(groups) and groups[index - 1]._name != name:
                index += 1
        self._offloaded_group_index = index
        self._tensor_count_current_group = 0
        self._groups_to_offload.append(groups[index - 1])
        return None

    def tensor_push(self, tensor: Any) -> Any:
        """Megatron's saved-tensor hook, lean with ``lean_hooks``: a plain CUDA tensor is
        tagged and kept in the current group at once (anything else takes Megatron's path,
        which decides whether to manage it). Also under graph capture: it records nothing.

        Stands in for / remove when: as :meth:`on_group_commit_forward`."""
        if not self.choices.lean_hooks or type(tensor) is not torch.Tensor or not tensor.is_cuda:
            return super().tensor_push(tensor)
        index = self._offloaded_group_index
        tag = (index, self._tensor_count_current_group)
        self._tensor_count_current_group += 1
        self.offload_groups[index - 1]._tensors[tag] = tensor
        return tag

    def on_group_start_backward(self) -> Any:
        """Megatron's hook, lean with ``lean_hooks`` (:meth:`on_group_commit_forward`).

        Stands in for / remove when: as :meth:`on_group_commit_forward`."""
        if not self._lean_now():
            return super().on_group_start_backward()
        if not self.do_offload:
            return None
        _wait_for(self.h2d_stream, _STREAMS.current())
        return self.bulk_reload()

    def on_group_commit_backward(self, name: str) -> Any:
        """Megatron's hook, lean with ``lean_hooks`` (:meth:`on_group_commit_forward`).

        Stands in for / remove when: as :meth:`on_group_commit_forward`."""
        if not self._lean_now():
            return super().on_group_commit_backward(name)
        if not self.do_offload:
            return None
        manager = fgo.PipelineOffloadManager.get_instance()
        if manager.cur_backward_chunk() is not self:
            manager.pop_backward_chunk(name)
        assert manager.cur_backward_chunk() is self, "Chunk mismatch"
        if not fgo.is_graph_capturing():
            for group in self._reloading_group:
                if group._name == name:
                    group.wait_reload_event(_STREAMS.current())
                    self._reloading_group.remove(group)
                    break
        return None

    def tensor_need_offloading_checker(self, tensor: Any) -> bool:
        """Megatron's check with ``lean_hooks`` (also under graph capture: it records nothing),
        its tensor types looked up once, the same answers.

        With ``one_copy_per_storage``, a tensor whose storage the model marked as kept on the
        GPU (:func:`.shared_copies.keep_on_gpu`) is not offloaded.

        Stands in for / remove when: as :meth:`on_group_commit_forward`."""
        if self.choices.one_copy_per_storage and self.shared_copies.kept(tensor):
            return False
        if not self.choices.lean_hooks:
            return super().tensor_need_offloading_checker(tensor)
        if (
            isinstance(tensor, (torch.nn.Parameter, *_STRAY_TYPES))
            or tensor.device.type != "cuda"
            or fgo._te_do_not_offload(tensor)
            or tensor.numel() < self.min_offloaded_tensor_size
        ):
            return False
        return not getattr(tensor, "_do_not_offload", False)

    def _lean_bulk_offload_group(self, group: Any) -> None:
        timer = self.choices.copy_timer
        d2h, compute = self.d2h_stream, _STREAMS.current()
        fgo.nvtx_range_push("activation offloading " + group._name)
        if timer is not None:
            start = timer.event()
            start.record(d2h)
        shared = self.shared_copies if self.choices.one_copy_per_storage else None
        _STREAMS.use(d2h)
        try:
            tensors = group._tensors
            for tag, tensor in tensors.items():
                if not self.tensor_need_offloading_checker(tensor):
                    continue
                image = shared is not None and is_storage_image(tensor)
                if image:
                    view = shared.view_of(tensor)
                    if view is not None:  # its bytes were copied by an earlier saver
                        tensors[tag] = view
                        continue
                state = self.offload(tensor, use_cpu_pool=group.use_cpu_pool)
                if self.is_warmup:
                    group.update_offload_info(tensor)
                tensor.record_stream(d2h)
                tensors[tag] = state
                if image:
                    shared.note(group, tag, tensor, state)
            group.record_offload_event(d2h)
        finally:
            _STREAMS.use(compute)
        if timer is not None:
            end = timer.event()
            end.record(d2h)
        fgo.nvtx_range_pop("activation offloading " + group._name)
        if timer is not None:
            timer.record("d2h", start, end, group.total_offload_bytes)
        if self._max_inflight_offloads is not None:
            self._offload_pending_by_name[group._name].append(group._offload_event)
            self._drain_offload_pending(group._name)

    def _lean_bulk_reload_group(self) -> None:
        timer = self.choices.copy_timer
        group = self._groups_to_reload[-1]
        h2d, compute = self.h2d_stream, _STREAMS.current()
        fgo.nvtx_range_push("activation reloading " + group._name)
        group.wait_offload_event(h2d)
        if timer is not None:
            start = timer.event()
            start.record(h2d)
        moved = 0
        _STREAMS.use(h2d)
        try:
            for tag, state in group._tensors.items():
                if isinstance(state, tuple):
                    moved += _state_bytes(state)
                    group.push_tensor(tag, self.reload(state))
            group.record_reload_event(h2d)
        finally:
            _STREAMS.use(compute)
        if timer is not None:
            end = timer.event()
            end.record(h2d)
            timer.record("h2d", start, end, moved)
        self._groups_to_reload.pop()
        self._reloading_group.append(group)
        fgo.nvtx_range_pop("activation reloading " + group._name)


def _finished(chunk: Any, name: str | None) -> bool:
    """Megatron's ``ChunkOffloadHandler.finish_all_groups`` without its debug message: no
    group left to offload or reload, or none of ``name`` from the current index on."""
    index = chunk._offloaded_group_index
    if index > 0 and not chunk._groups_to_reload and not chunk._groups_to_offload:
        return True
    assert name is not None, "Name is required"
    return all(group._name != name for group in chunk.offload_groups[index:])


class OwnedOffloadManager(fgo.PipelineOffloadManager):
    """Megatron's offload manager for one plan (one step shape), with its :class:`PlanChoices`,
    handlers of class :class:`OwnedChunkHandler` and the runtime's shared :class:`OwnedHostPool`.
    The runtime installs it as Megatron's singleton (``PipelineOffloadManager.OFFLOAD_MGR``),
    which Megatron's layers ask for."""

    def __init__(self, choices: PlanChoices, pool: OwnedHostPool | None = None) -> None:
        self.choices = choices
        super().__init__()
        # Megatron's __init__ made a pool of its own (no buffers yet): the plans share ours.
        self._cpu_tensor_pool = pool if pool is not None else OwnedHostPool()

    def init_model_chunk_offload_handler(
        self,
        pp_rank: int,
        vp_size: int | None,
        vp_stage: int | None,
        min_offloaded_tensor_size: int = 1024 * 1024,
        delta_offload_bytes_across_pp_ranks: int = 0,
        activation_offload_fraction: float = 1.0,
        max_inflight_offloads: int | None = None,
    ) -> None:
        """Megatron's method, re-implemented to create an :class:`OwnedChunkHandler` (Megatron
        constructs ``ChunkOffloadHandler`` inside it; there is no narrower seam).

        Stands in for: no upstream issue (Megatron names its handler class inline).
        Remove when: Megatron lets a manager subclass choose the handler class (a factory
        method or class attribute): override that instead."""
        if not self._is_warmup:
            return
        vp_size = 1 if vp_size is None else vp_size
        if self._stages is None:
            self._vpp = vp_size
            self._stages = [[] for _ in range(vp_size)]
        self._delta_offload_bytes_across_pp_ranks = delta_offload_bytes_across_pp_ranks
        self._pp_rank = pp_rank
        self._activation_offload_fraction = activation_offload_fraction
        cur_vpp_rank = 0 if vp_stage is None else vp_stage
        if cur_vpp_rank == self._vpp - 1:
            self.flush()
        cur_chunk = OwnedChunkHandler(
            min_offloaded_tensor_size,
            self._cpu_tensor_pool,
            max_inflight_offloads=max_inflight_offloads,
            choices=self.choices,
        )
        self._stages[cur_vpp_rank].append(cur_chunk)
        if cur_vpp_rank == self._vpp - 1:
            self.push(cur_chunk)
            self.flush()
        self._cur_forward_chunk = cur_chunk
        cur_chunk.vpp_rank = cur_vpp_rank
        self._cached_chunks_forward.append(cur_chunk)

    def on_save_for_backward(self, tensor: torch.Tensor) -> Any:
        """Megatron's saved-tensor hook, lean with ``lean_hooks``: without formatting a debug
        message per saved tensor (:meth:`OwnedChunkHandler.tensor_push` does the rest).

        Stands in for / remove when: as :meth:`OwnedChunkHandler.on_group_commit_forward`."""
        if not self.choices.lean_hooks:
            return super().on_save_for_backward(tensor)
        assert self.inside_context, "Must be inside offload context"
        return self._cur_forward_chunk.tensor_push(tensor)

    def pop_forward_chunk(self, name: str | None = None) -> Any:
        """Megatron's method, lean with ``lean_hooks``: the same choice of the forward chunk
        without formatting debug messages (here and in the chunk's ``finish_all_groups``).

        Stands in for / remove when: as :meth:`OwnedChunkHandler.on_group_commit_forward`."""
        if not self.choices.lean_hooks:
            return super().pop_forward_chunk(name)
        chunk = self._cur_forward_chunk
        if not self.do_offload or self._is_warmup:
            return chunk
        chunks = self._cached_chunks_forward
        while chunk is None or _finished(chunk, name):
            if self._cached_chunks_index_forward >= len(chunks):
                chunk = None
                break
            chunk = chunks[self._cached_chunks_index_forward]
            self._cached_chunks_index_forward += 1
        self._cur_forward_chunk = chunk
        return chunk

    def post_warmup_callback(self) -> None:
        """Megatron's callback after the warm-up step, with the plan's fraction placement and
        pooled expert groups.

        ``fraction_placement="spread"`` (with a fraction below 1): the groups a fraction below 1
        offloads are spread evenly over the forward pass. Megatron keeps the earliest groups
        offloaded, for the longest relief (the fraction counts groups of all modules together).
        The peak, though, comes at the end of the forward pass, where every offloaded group
        counts the same, and the earliest groups put all of the copying in the first part of
        the forward. Spread, each module offloads the fraction of its own groups, evenly spaced
        over the layers, so the copies run beside the whole forward and every module gives up
        its share of bytes (a count over all modules together could pick one module only when
        two alternate). Megatron's callback computes its summary table from inside, so the spread
        case re-implements it (:meth:`_place_spread`); the table is kept off stdout either way.

        ``pool_expert_groups``: the MoE expert groups (``expert_fc1``, ``moe_act``) take pinned
        buffers from the pool once their plan is recorded, where their shapes are static.
        Megatron allocates a fresh pinned tensor for every offload of an expert group, as their
        row count follows the routing (a pool keyed by shape would fill with one-off sizes).
        With drop-and-pad dispatch (``moe_expert_capacity_factor`` with
        ``moe_pad_expert_input_to_capacity``) every expert takes exactly its capacity, so the
        shapes recur with the step's shape, like the dense groups'. A full-iteration CUDA graph
        needs that: its copies write to the host buffers they were captured with on every
        replay, which the pool keeps alive and reuses in the same order, while a fresh tensor is
        freed after its reload. Eagerly it saves a pinned allocation per group and step. It
        applies from the first step after the plan's warm-up step.

        Stands in for: no upstream issue (fraction placement; expert groups' pinned buffers
        under drop-and-pad dispatch).
        Remove when: Megatron places a fraction's groups evenly and pools expert groups whose
        shapes are static."""
        fractions = [
            self._activation_offload_fraction,
            *dict(self.choices.fraction_by_module).values(),
        ]
        # Megatron prints its summary table of the plan's bytes on stdout (after a gather every
        # rank joins); the runtime reports the same bytes per step (plan_metrics), so the table
        # is kept off the user's output.
        with contextlib.redirect_stdout(io.StringIO()):
            if self.choices.fraction_placement == "spread" and min(fractions) < 1:
                self._place_spread()
            else:
                super().post_warmup_callback()
        if self.choices.pool_expert_groups:
            for chunk in self._cached_chunks_forward:
                for group in chunk.offload_groups:
                    group.use_cpu_pool = True  # Megatron's choice was False for expert groups

    def _place_spread(self) -> None:
        """Megatron's ``post_warmup_callback`` with its fraction step spread over each module's
        groups instead of keeping the earliest (its other steps as Megatron's, without the
        debug messages)."""
        self._is_warmup = False
        assert len(self._cached_chunks_forward) == len(self._cached_chunks_backward), (
            "Cached chunks forward and backward must have the same length"
        )
        for chunk in self._cached_chunks_forward:
            chunk.is_warmup = False
            assert chunk in self._cached_chunks_backward, (
                "Chunk not found in cached chunks backward"
            )
            self._offload_margin = max(self._offload_margin, chunk.get_max_deduplicated_groups())
        # The last group of each name stays on the GPU (its reload would block the compute).
        last_group_with_same_name: dict[str, Any] = {}
        for chunk in reversed(self._cached_chunks_backward):
            for group in chunk.offload_groups:
                last_group_with_same_name[group._name] = group
        for group in last_group_with_same_name.values():
            if self._offload_margin > 0:
                group.offload = False
                self._offload_margin -= 1
            else:
                break
        assert self._offload_margin == 0, "Offload margin is not 0"
        keep_on_gpu_bytes = self._pp_rank * self._delta_offload_bytes_across_pp_ranks
        for chunk in self._cached_chunks_backward:
            for group in chunk.offload_groups:
                if group.offload and keep_on_gpu_bytes > 0:
                    keep_on_gpu_bytes -= group.total_offload_bytes
                    group.offload = False
        fraction = self._activation_offload_fraction
        fraction_of = dict(self.choices.fraction_by_module)
        for chunk in self._cached_chunks_backward:
            by_module: dict[str, list[Any]] = {}
            for group in chunk.offload_groups:
                if group.offload and group.total_offload_bytes:
                    by_module.setdefault(group._name, []).append(group)
            for name, groups in by_module.items():
                share = fraction_of.get(name, fraction)
                for group, offload in zip(groups, spread_choice(len(groups), share), strict=True):
                    group.offload = offload
        summary = _summary_bytes(self)
        self._offload_summary_bytes = summary
        self._offload_summary_total_bytes = int(sum(summary.values()))
        fgo.print_offload_summary_table(summary)


# --- fingerprints of the Megatron code the classes above override or rely on ----------------


@dataclass(frozen=True)
class Fingerprint:
    """A Megatron function (``name`` in the offload module) whose source, normalised by
    :func:`fingerprint`, hashed to ``digest`` in megatron-core :data:`CHECKED_MEGATRON_VERSION`;
    ``stands_in_for``: the upstream issue or the reason ours differs or relies on it;
    ``remove_when``: when the entry (and the code relying on it) can go."""

    name: str
    digest: str
    stands_in_for: str
    remove_when: str


_HOOKS = "no upstream issue: host time of the hooks (lean_hooks)"
_HOOKS_GONE = "Megatron's hook code makes no more host calls than OwnedChunkHandler's"
_STATE = "private state that OwnedChunkHandler's re-implemented hooks read and write"
_POOL = (
    "no upstream issue: OwnedHostPool lends buffers by size, shared across step shapes "
    "(Megatron keys them by exact shape: pinned memory grows with the sum over shapes)"
)
_POOL_GONE = "Megatron's pool shares its buffers across shapes and bounds its pinned bytes"

FINGERPRINTS: tuple[Fingerprint, ...] = (
    Fingerprint(
        "ChunkOffloadHandler.tensor_pop",
        "a85852af075707e6",
        "Megatron-LM issue 7398 (reload_waits_for_offload) and compute-stream reload timing",
        "Megatron's tensor_pop waits for the group's offload event itself",
    ),
    Fingerprint(
        "ChunkOffloadHandler.offload",
        "28b96facb800f800",
        "no upstream issue: non-contiguous tensors copied through contiguous() (strided_copies)",
        "Megatron offloads a dense permutation as it lies and reloads it with its strides",
    ),
    Fingerprint(
        "ChunkOffloadHandler.reload",
        "64125c417704483a",
        "no upstream issue: the reload of strided_copies' host tensors",
        "as ChunkOffloadHandler.offload",
    ),
    Fingerprint(
        "ChunkOffloadHandler.bulk_offload_group",
        "4be869f647afd7c4",
        "no upstream issue: copy timing (copy_timer); re-implemented by lean_hooks",
        f"Megatron times its copies and {_HOOKS_GONE}",
    ),
    Fingerprint(
        "ChunkOffloadHandler.bulk_reload_group",
        "1087d83046433406",
        "no upstream issue: copy timing (copy_timer); re-implemented by lean_hooks",
        f"Megatron times its copies and {_HOOKS_GONE}",
    ),
    Fingerprint(
        "ChunkOffloadHandler.on_group_commit_forward", "96345406b558e0dc", _HOOKS, _HOOKS_GONE
    ),
    Fingerprint(
        "ChunkOffloadHandler.on_group_start_backward", "4b4bdd37add70358", _HOOKS, _HOOKS_GONE
    ),
    Fingerprint(
        "ChunkOffloadHandler.on_group_commit_backward", "7787996702ca2bdf", _HOOKS, _HOOKS_GONE
    ),
    Fingerprint(
        "ChunkOffloadHandler.bulk_offload",
        "9a7d4390fb9db7a5",
        "re-implemented by the lean commit (OwnedChunkHandler._lean_bulk_offload; lean_hooks)",
        _HOOKS_GONE,
    ),
    Fingerprint(
        "ChunkOffloadHandler.on_group_start_forward", "0fd5c8c8fcde4a69", _HOOKS, _HOOKS_GONE
    ),
    Fingerprint("ChunkOffloadHandler.tensor_push", "1432fdbc45b51064", _HOOKS, _HOOKS_GONE),
    Fingerprint(
        "ChunkOffloadHandler.finish_all_groups",
        "7a06fd76496b842f",
        "re-implemented by the lean pop_forward_chunk (lean_hooks)",
        _HOOKS_GONE,
    ),
    Fingerprint(
        "PipelineOffloadManager.on_save_for_backward", "b94a695152e0aea5", _HOOKS, _HOOKS_GONE
    ),
    Fingerprint(
        "PipelineOffloadManager.pop_forward_chunk", "db68856d7ef0d807", _HOOKS, _HOOKS_GONE
    ),
    Fingerprint(
        "ChunkOffloadHandler.tensor_need_offloading_checker",
        "02f12e2408d712e0",
        _HOOKS,
        _HOOKS_GONE,
    ),
    Fingerprint(
        "ChunkOffloadHandler._can_manage_tensor_for_offload",
        "6a909777db6a79f7",
        "inlined in the lean tensor_need_offloading_checker (lean_hooks)",
        _HOOKS_GONE,
    ),
    Fingerprint("ChunkOffloadHandler.__init__", "bff827694adcd407", _STATE, _HOOKS_GONE),
    Fingerprint(
        "ChunkOffloadHandler._drain_offload_pending",
        "6b5e7e31990277a7",
        "called by the lean bulk_offload_group (lean_hooks)",
        _HOOKS_GONE,
    ),
    Fingerprint(
        "_te_do_not_offload",
        "caa1e6a03302e735",
        "called by the lean tensor_need_offloading_checker (lean_hooks)",
        _HOOKS_GONE,
    ),
    Fingerprint(
        "OffloadTensorGroup.__init__",
        "a1a1d99d4d8aa557",
        "private state (_tensors, _name, _offload_event, use_cpu_pool) the hooks, the copy "
        "timing and pool_expert_groups read and write",
        "nothing here reads a group's private state",
    ),
    Fingerprint(
        "OffloadTensorPool.allocate",
        "538ba5e149214deb",
        _POOL,
        _POOL_GONE,
    ),
    Fingerprint("OffloadTensorPool.free", "0b7d663f4a225e0b", _POOL, _POOL_GONE),
    Fingerprint(
        "OffloadTensorPool.reset",
        "ee19a299e4200702",
        f"{_POOL}; the manager's reset calls it at the end of each step",
        _POOL_GONE,
    ),
    Fingerprint(
        "OffloadTensorPool.clear",
        "d81de83df1731300",
        f"{_POOL}; Megatron's __del__ calls it",
        _POOL_GONE,
    ),
    Fingerprint(
        "OffloadTensorPool.__init__",
        "c79b48881415ba56",
        "private state (_stats) OwnedHostPool keeps counting as Megatron's pool does",
        _POOL_GONE,
    ),
    Fingerprint(
        "PipelineOffloadManager.__init__",
        "9d4b6ac2a6a59ed6",
        "OwnedOffloadManager replaces the _cpu_tensor_pool it makes; the runtime and "
        "post_warmup_callback read its private state (_cached_chunks_*, _offload_margin)",
        "Megatron's manager takes its pool as an argument and the plan is read through "
        "public properties",
    ),
    Fingerprint(
        "PipelineOffloadManager.get_instance",
        "66688a50c0089a3c",
        "the singleton seam (OFFLOAD_MGR) through which the runtime installs each plan's manager",
        "Megatron's layers take their manager from elsewhere than OFFLOAD_MGR (then install it "
        "there)",
    ),
    Fingerprint(
        "PipelineOffloadManager.init_model_chunk_offload_handler",
        "802d50a6f73927a6",
        "no upstream issue: Megatron names ChunkOffloadHandler inline (re-implemented to create "
        "OwnedChunkHandler)",
        "Megatron lets a manager subclass choose its handler class",
    ),
    Fingerprint(
        "PipelineOffloadManager.post_warmup_callback",
        "b2fccb9324154543",
        "no upstream issue: fraction placement (re-implemented for spread, which prints the "
        "summary once) and pooled expert groups (pool_expert_groups)",
        "Megatron places a fraction's groups evenly and pools expert groups whose shapes "
        "are static",
    ),
)


def _source(obj: Any) -> str:
    """The source of a Megatron function (the seam tests replace)."""
    return inspect.getsource(obj)


class _Normalise(ast.NodeTransformer):
    """Drops what does not change behaviour: docstrings and other bare strings, and
    ``debug_rank(...)`` statements (messages printed only with Megatron's DEBUG flag)."""

    def visit_Expr(self, node: ast.Expr) -> Any:
        value = node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return None
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "debug_rank"
        ):
            return None
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        node = super().generic_visit(node)
        if getattr(node, "body", None) == []:
            node.body = [ast.Pass()]  # a body that held only what was dropped
        return node


def fingerprint(obj: Any) -> str:
    """A hash of ``obj``'s source, independent of formatting, comments, docstrings and debug
    messages (its syntax tree without them, written back as code by ``ast.unparse``)."""
    tree = _Normalise().visit(ast.parse(textwrap.dedent(_source(obj))))
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]


def _megatron_object(name: str) -> Any:
    obj: Any = fgo
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def installed_fingerprints() -> dict[str, str | None]:
    """Each :data:`FINGERPRINTS` name's hash in the installed megatron-core (None: missing)."""
    digests: dict[str, str | None] = {}
    for entry in FINGERPRINTS:
        try:
            digests[entry.name] = fingerprint(_megatron_object(entry.name))
        except (AttributeError, OSError, TypeError, SyntaxError):
            digests[entry.name] = None
    return digests


def changed_megatron_code() -> list[str]:
    """Names of the :data:`FINGERPRINTS` whose installed source differs from the checked one."""
    installed = installed_fingerprints()
    return [entry.name for entry in FINGERPRINTS if installed[entry.name] != entry.digest]


def _installed_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def megatron_drift() -> str | None:
    """One line saying which Megatron code changed since this backend was checked and what to
    do, or None when the installed megatron-core's offload code is the checked one."""
    changed = changed_megatron_code()
    if not changed:
        return None
    names = ", ".join(changed)
    return (
        f"megatron-core's {names} changed since this backend was checked (installed "
        f"megatron-core {_installed_version()}, checked {CHECKED_MEGATRON_VERSION}); pin "
        f"megatron-core=={CHECKED_MEGATRON_VERSION} or update nemo_rl_offload/offload/owned.py "
        "(its FINGERPRINTS and the overrides they guard), or turn "
        "fine_grained_activation_offloading off"
    )


@functools.cache
def _checked() -> str | None:
    return megatron_drift()


def require_checked_megatron() -> None:
    """Refuse offloading (UserInputError, one line) when the installed megatron-core's offload
    code differs from the code the classes above were checked against."""
    drift = _checked()
    if drift is not None:
        raise UserInputError(drift)


# Megatron's dense MLP methods the project's MLP offload points (models/mlp_offload.py) rely on
# (its forward calls fc1, the activation and fc2 once each; as_mlp_submodule builds the class it
# is called on), with their source hashes (:func:`fingerprint`) in CHECKED_MEGATRON_VERSION.
MLP_FINGERPRINTS = {"forward": "ffe0ebc9e20000af", "as_mlp_submodule": "be18d82adbf5db84"}


def mlp_drift() -> str | None:
    """One line refusing the MLP offload modules when the installed megatron-core's ``MLP``
    code they rely on differs from the checked one (:data:`MLP_FINGERPRINTS`), else None."""
    from megatron.core.transformer.mlp import MLP

    changed = [
        f"MLP.{name}"
        for name, digest in MLP_FINGERPRINTS.items()
        if fingerprint(getattr(MLP, name)) != digest
    ]
    if not changed:
        return None
    return (
        f"the MLP offload modules rely on megatron-core's {', '.join(changed)}, which changed "
        f"since megatron-core {CHECKED_MEGATRON_VERSION} ({_installed_version()} is installed); "
        f"remove mlp_fc1/mlp_act/mlp_fc2 or pin megatron-core=={CHECKED_MEGATRON_VERSION}"
    )


# Megatron code the local spec's selective recompute (models/local_recompute.py) relies on, per
# recompute module, with source hashes (:func:`fingerprint`) in CHECKED_MEGATRON_VERSION:
# ``layernorm``: the layer's forward steps that assign, call and discard its two norm
# checkpoints; ``mlp_act``: the MLP's forward, whose activation step RecomputeActMLP repeats,
# and as_mlp_submodule, which builds the class it is called on.
RECOMPUTE_FINGERPRINTS: dict[str, dict[str, str]] = {
    "layernorm": {
        "TransformerLayer._forward_attention": "8046dd4d85c140ba",
        "TransformerLayer._forward_pre_mlp_layernorm": "6666ed6815845b8a",
        "TransformerLayer._forward_mlp": "7f397f821d6e348e",
        "TransformerLayer._forward_post_mlp": "06e11931c17c3b7b",
    },
    "mlp_act": {"MLP.forward": "ffe0ebc9e20000af", "MLP.as_mlp_submodule": "be18d82adbf5db84"},
    # models.grouped_linear.LocalGroupedMLP: its forward assigns activation_checkpoint, then
    # calls its checkpoint and discard_output_and_register_recompute.
    "moe_act": {"TEGroupedMLP.forward": "87a91a6fc99082a9"},
}


def recompute_drift(modules: frozenset[str] | set[str]) -> str | None:
    """One line refusing the recompute ``modules`` of :data:`RECOMPUTE_FINGERPRINTS` whose
    Megatron code differs from the checked one, else None."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    classes = {"MLP": MLP, "TEGroupedMLP": TEGroupedMLP, "TransformerLayer": TransformerLayer}
    changed: dict[str, list[str]] = {}
    for module in sorted(set(modules) & set(RECOMPUTE_FINGERPRINTS)):
        for name, digest in RECOMPUTE_FINGERPRINTS[module].items():
            cls, method = name.split(".")
            try:
                installed: str | None = fingerprint(getattr(classes[cls], method))
            except (AttributeError, OSError, TypeError, SyntaxError):
                installed = None
            if installed != digest:
                changed.setdefault(module, []).append(name)
    if not changed:
        return None
    names = sorted({name for names in changed.values() for name in names})
    return (
        f"recomputing {_list(changed)} on the local layer spec relies on megatron-core's "
        f"{', '.join(names)}, which changed since megatron-core {CHECKED_MEGATRON_VERSION} "
        f"({_installed_version()} is installed); remove {_list(changed)} from "
        f"recompute_modules or pin megatron-core=={CHECKED_MEGATRON_VERSION}"
    )


def _list(names: Any) -> str:
    return "[" + ", ".join(sorted(names)) + "]"
