"""The offload runtime's own subclasses of Megatron-core 0.19's offload classes.

Megatron's fine-grained activation offloading is three classes in
``megatron.core.pipeline_parallel.fine_grained_activation_offload``: a process-wide
``PipelineOffloadManager`` (the singleton ``PipelineOffloadManager.OFFLOAD_MGR`` that Megatron's
layers ask for), a ``ChunkOffloadHandler`` per micro-batch that the manager creates, and the
``OffloadTensorPool`` of pinned host buffers. The runtime (:mod:`.runtime`) creates its own
manager per step shape, :class:`OwnedOffloadManager`, and installs it as that singleton; the
manager creates :class:`OwnedChunkHandler` handlers, and the plans share one
:class:`OwnedHostPool`. What they do differently is chosen per plan by :class:`PlanChoices`
(each choice off is Megatron's own code, through ``super()``):

- ``reload_waits_for_offload``: a reload on the compute stream waits for its offload copy
  (Megatron-LM issue 7398: the warm-up step computed with partly stale activations);
- ``strided_copies``: a tensor saved as a permuted view (SDPA's query, key and output) goes to
  the host and back as its bytes lie, with its strides, instead of through a ``contiguous()``
  copy kernel on the GPU, and autograd gets back the layout it saved;
- ``fraction_placement``: with ``activation_offload_fraction`` below 1, the groups offloaded
  are spread evenly over the forward pass (``spread``) instead of being the earliest ones
  (Megatron's choice, ``earliest``), so the copies keep pace with the compute;
- ``pool_expert_groups``: MoE expert groups take their pinned buffers from the pool when
  drop-and-pad dispatch makes their shapes recur (what a CUDA graph of a MoE step needs);
- ``copy_timer``: CUDA events around each group's copies, for a :class:`CopyTimer` (copy time
  and achieved bandwidth in the step metrics);
- ``lean_hooks``: the same hook work in less host time, outside CUDA graph capture (an eager
  step that is host-bound pays every microsecond of the hooks).

No Megatron class or module attribute is replaced: Megatron's classes keep their own methods for
any other user in the process. The subclasses override or re-implement Megatron methods and read
some of Megatron's private state, so each such Megatron function is listed in
:data:`FINGERPRINTS` with a hash of its source as checked: :func:`require_checked_megatron`
refuses offloading when the installed megatron-core's source differs (the runtime calls it when
it is built, ``validate`` reports it through the capabilities), and
tests/unit/offload/test_owned.py fails on such a difference in CI.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import inspect
import textwrap
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from nemo_rl_offload.errors import UserInputError

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
    - ``pool_expert_groups``: :meth:`OwnedOffloadManager.post_warmup_callback`;
    - ``lean_hooks``: the hooks of :class:`OwnedChunkHandler` and the pool of
      :class:`OwnedHostPool`;
    - ``copy_timer``: where the copies' CUDA events go (None: the copies are not timed).
    """

    reload_waits_for_offload: bool = False
    strided_copies: bool = False
    fraction_placement: str = "earliest"
    pool_expert_groups: bool = False
    lean_hooks: bool = False
    copy_timer: CopyTimer | None = None

    def __post_init__(self) -> None:
        if self.fraction_placement not in FRACTION_PLACEMENTS:
            raise ValueError(
                f"fraction_placement {self.fraction_placement!r}: one of {FRACTION_PLACEMENTS}"
            )


def _state_bytes(state: Any) -> int:
    """Bytes of an offloaded tensor's host copy (Megatron keeps (device, host tensor, pooled))."""
    host = state[1]
    return host.numel() * host.element_size()


def _timing_wanted() -> bool:
    """Copies are timed except while a CUDA graph is captured (its events would be captured)."""
    return not torch.cuda.is_current_stream_capturing()


def is_dense_permutation(tensor: Any) -> bool:
    """Whether the tensor's elements fill its memory span exactly, in some order of its
    dimensions (a transpose or permute of a contiguous tensor), so that its bytes can be copied
    as one block. Dimensions of size 1 have no meaningful stride and are skipped."""
    expected = 1
    laid_out = zip(tensor.shape, tensor.stride(), strict=True)
    for stride, size in sorted((stride, size) for size, stride in laid_out if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


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


class OwnedHostPool(fgo.OffloadTensorPool):
    """Megatron's pinned host pool, shared by every plan of a runtime, that also notes which of
    its entries (tensor shapes) each plan draws from (:attr:`plan`, set by the runtime before
    each step), so that releasing a plan frees the buffers only it used (:meth:`release`).

    With ``lean`` (the plans' ``lean_hooks``) its ``allocate`` and ``free`` do Megatron's work
    in less host time: no debug messages built for nothing, and ``free`` finds its tensor by
    identity in a set instead of scanning the entry's list."""

    def __init__(self, *, lean: bool = False, device: str = "cpu", pin_memory: bool = True):
        super().__init__(device=device, pin_memory=pin_memory)
        self.lean = lean
        self.plan: Hashable = None  # the plan whose step draws buffers now
        self.keys_by_plan: dict[Hashable, set[Any]] = {}
        # Per entry: (its list of tensors, that list's length, their identities).
        self._identities: dict[Any, tuple[list[Any], int, set[int]]] = {}

    def pinned_bytes(self) -> int:
        """Pinned bytes the pool holds."""
        return sum(
            tensor.numel() * tensor.element_size()
            for entry in self._pools.values()
            for tensor in entry["all"]
        )

    def release(self, keys: set[Any]) -> None:
        """Drop the entries ``keys`` (tensor shapes) with their buffers."""
        for key in keys:
            self._pools.pop(key, None)
            self._identities.pop(key, None)

    def allocate(self, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Megatron's allocate (leaner with ``lean``), noting the entry for :attr:`plan`.

        Stands in for: no upstream issue (host time of the hooks; plan bookkeeping).
        Remove when: Megatron's allocate builds no debug message unless DEBUG, and the runtime
        no longer releases plans' buffers (then ``FINGERPRINTS`` loses its entry)."""
        self.keys_by_plan.setdefault(self.plan, set()).add(self._get_pool_key(shape, dtype))
        if fgo.DEBUG or not self.lean:
            return super().allocate(shape, dtype)
        stats = self._stats
        stats["allocation_requests"] += 1
        pool = self._pools.get((shape, dtype))
        if pool is None:
            pool = self._pools[(shape, dtype)] = {"free": deque(), "all": [], "allocated_count": 0}
        if pool["free"]:
            tensor = pool["free"].popleft()
            stats["pool_hits"] += 1
        else:
            tensor = torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self.pin_memory)
            pool["all"].append(tensor)
            stats["total_allocated"] += 1
            stats["pool_misses"] += 1
        pool["allocated_count"] += 1
        stats["current_in_use"] += 1
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Megatron's free (leaner with ``lean``: an identity set instead of a list scan).

        Stands in for: no upstream issue (host time of the hooks).
        Remove when: Megatron's free checks ownership in O(1) and builds no debug message
        unless DEBUG."""
        key = (tensor.shape, tensor.dtype)
        pool = self._pools.get(key)
        if fgo.DEBUG or not self.lean or pool is None or id(tensor) not in self._owned(key):
            return super().free(tensor)  # Megatron's own messages and errors
        self._stats["free_requests"] += 1
        pool["free"].append(tensor)
        pool["allocated_count"] -= 1
        self._stats["current_in_use"] -= 1
        return None

    def _owned(self, key: Any) -> set[int]:
        """Identities of the tensors the entry ``key`` made (its list holds them, so they stay
        unique), rebuilt whenever the entry's list is another one or changed size."""
        made = self._pools[key]["all"]
        known = self._identities.get(key)
        if known is None or known[0] is not made or known[1] != len(made):
            known = self._identities[key] = (made, len(made), {id(t) for t in made})
        return known[2]


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

        Stands in for: Megatron-LM issue 7398.
        Remove when: the installed megatron-core's ``tensor_pop`` waits for the group's offload
        event itself."""
        choices = self.choices
        if isinstance(tensor_tag, torch.Tensor):
            return super().tensor_pop(tensor_tag)
        group = self.offload_groups[tensor_tag[0] - 1]
        state = group._tensors.get(tensor_tag)
        if not isinstance(state, tuple):  # on the GPU already
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
        Megatron's path. The runtime chooses it per model (docs/offloading.md says where it was
        measured faster).

        Stands in for: no upstream issue (Megatron copies every non-contiguous tensor through
        ``contiguous()``).
        Remove when: Megatron offloads a dense permutation as it lies and reloads it with its
        strides."""
        if (
            not self.choices.strided_copies
            or src_tensor.is_contiguous()
            or not is_dense_permutation(src_tensor)
        ):
            return super().offload(src_tensor, pin_memory=pin_memory, use_cpu_pool=use_cpu_pool)
        size, stride = src_tensor.shape, src_tensor.stride()
        if use_cpu_pool:
            pooled = self.cpu_tensor_pool.allocate(size, dtype=src_tensor.dtype)
            host = pooled.as_strided(size, stride)
        else:
            host = torch.empty_strided(
                size, stride, dtype=src_tensor.dtype, device="cpu", pin_memory=pin_memory
            )
        host.copy_(src_tensor, non_blocking=pin_memory)
        return (src_tensor.device, host, use_cpu_pool)

    def reload(self, state: Any, non_blocking: bool | None = None) -> Any:
        """Reload a tensor :meth:`offload` kept with its strides into a GPU tensor of the same
        strides; anything else is Megatron's reload.

        Stands in for: as :meth:`offload`. Remove when: as :meth:`offload`."""
        device, host, use_cpu_pool = state
        if host.is_contiguous():
            return super().reload(state, non_blocking=non_blocking)
        if non_blocking is None:
            non_blocking = host.is_pinned()
        tensor = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        tensor.copy_(host, non_blocking=non_blocking)
        if use_cpu_pool:
            self.cpu_tensor_pool.free(host._base)  # the pooled buffer this view was made of
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
        - the pinned pool's allocate and free skip debug messages built for nothing, and free
          finds its tensor by identity (:class:`OwnedHostPool`);
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
        return self.bulk_offload(name, forced_released_tensors)

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

        Stands in for / remove when: as :meth:`on_group_commit_forward`."""
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
        _STREAMS.use(d2h)
        try:
            for tag, tensor in group._tensors.items():
                if self.tensor_need_offloading_checker(tensor):
                    state = self.offload(tensor, use_cpu_pool=group.use_cpu_pool)
                    if self.is_warmup:
                        group.update_offload_info(tensor)
                    tensor.record_stream(d2h)
                    group.push_tensor(tag, state)
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


class OwnedOffloadManager(fgo.PipelineOffloadManager):
    """Megatron's offload manager for one plan (one step shape), with its :class:`PlanChoices`,
    handlers of class :class:`OwnedChunkHandler` and the runtime's shared :class:`OwnedHostPool`.
    The runtime installs it as Megatron's singleton (``PipelineOffloadManager.OFFLOAD_MGR``),
    which Megatron's layers ask for."""

    def __init__(self, choices: PlanChoices, pool: OwnedHostPool | None = None) -> None:
        self.choices = choices
        super().__init__()
        # Megatron's __init__ made a pool of its own (no buffers yet): the plans share ours.
        self._cpu_tensor_pool = pool if pool is not None else OwnedHostPool(lean=choices.lean_hooks)

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
        two alternate). Megatron's callback prints its summary table from inside, so the spread
        case re-implements it (:meth:`_place_spread`) and prints the table once, as trained.

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
        if self.choices.fraction_placement == "spread" and self._activation_offload_fraction < 1:
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
        for chunk in self._cached_chunks_backward:
            by_module: dict[str, list[Any]] = {}
            for group in chunk.offload_groups:
                if group.offload and group.total_offload_bytes:
                    by_module.setdefault(group._name, []).append(group)
            for groups in by_module.values():
                for group, offload in zip(
                    groups, spread_choice(len(groups), fraction), strict=True
                ):
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
    Fingerprint("OffloadTensorPool.allocate", "538ba5e149214deb", _HOOKS, _HOOKS_GONE),
    Fingerprint("OffloadTensorPool.free", "0b7d663f4a225e0b", _HOOKS, _HOOKS_GONE),
    Fingerprint(
        "OffloadTensorPool._get_pool_key",
        "7670e057206b9986",
        "keys of the entries OwnedHostPool notes per plan (the runtime's host-memory budget)",
        "the runtime no longer releases plans' buffers",
    ),
    Fingerprint(
        "OffloadTensorPool.__init__",
        "c79b48881415ba56",
        "private state (_pools, _stats) of the lean pool, its byte count and releases",
        "the runtime neither counts nor releases the pool's buffers and lean_hooks is gone",
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
