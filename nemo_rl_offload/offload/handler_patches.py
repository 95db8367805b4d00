"""Changes to Megatron-core 0.19's offload handler (``ChunkOffloadHandler``), each measured.

The offload runtime (:mod:`nemo_rl_offload.offload.runtime`) installs them once, when a model
with fine-grained offloading is built (:func:`install`):

- :func:`_patch_reload_waits_for_offload`: a reload on the compute stream waits for its offload
  copy (Megatron-LM issue 7398: the warm-up step computed with partly stale activations);
- :func:`_patch_strided_copies`: a tensor saved as a permuted view (SDPA's query, key and output)
  goes to the host and back as its bytes lie, with its strides, instead of through a
  ``contiguous()`` copy kernel on the GPU, and autograd gets back the layout it saved (dense
  models: the runtime turns it on per plan);
- :func:`_patch_fraction_placement`: with ``activation_offload_fraction`` below 1, the groups
  offloaded are spread evenly over the forward pass (``spread``, the default) instead of being
  the earliest ones (Megatron's choice, ``earliest``), so the copies keep pace with the compute;
- :func:`_patch_pooled_expert_groups`: MoE expert groups take their pinned buffers from the pool
  when drop-and-pad dispatch makes their shapes recur (what a CUDA graph of a MoE step needs);
- :func:`_patch_copy_timing`: CUDA events around each group's copies, for :data:`COPY_TIMER`
  (copy time and achieved bandwidth in the step metrics);
- :func:`_patch_lean_hooks`: the same work in less host time, outside CUDA graph capture (an
  eager step that is host-bound pays every microsecond of the hooks).
"""

from __future__ import annotations

from collections import deque
from typing import Any


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
        import torch

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


COPY_TIMER = CopyTimer()


def install() -> None:
    """Install every change (idempotent: each checks its own marker)."""
    _patch_reload_waits_for_offload()
    _patch_strided_copies()
    _patch_fraction_placement()
    _patch_pooled_expert_groups()
    _patch_copy_timing()
    _patch_lean_hooks()


def _handler() -> Any:
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    return fgo.ChunkOffloadHandler


def _state_bytes(state: Any) -> int:
    """Bytes of an offloaded tensor's host copy (Megatron keeps (device, host tensor, pooled))."""
    host = state[1]
    return host.numel() * host.element_size()


def _timing_wanted() -> bool:
    """Copies are timed except while a CUDA graph is captured (its events would be captured)."""
    import torch

    return not torch.cuda.is_current_stream_capturing()


def _patch_reload_waits_for_offload() -> bool:
    """Make a synchronous reload wait for its offload copy (megatron-core 0.19).

    Megatron-LM issue 7398: during the warm-up step every group is offloaded, including the
    last one, whose tensors backward needs at once, before any bulk reload. Then
    ``ChunkOffloadHandler.tensor_pop`` reloads them on the current stream from pinned memory
    that the device-to-host copy on the side stream may not have finished writing, so the
    warm-up step computes with partly stale activations (measured: step-1 gradients differ from
    an identical model without offload; later steps, which keep that group on the GPU, are
    bitwise equal). The fix: before such a reload, the current stream waits for the group's
    offload event, which the group records after its copies. Such reloads run on the compute
    stream, outside the bulk reloads :func:`_patch_copy_timing` times, so they are timed here
    (every reload of a MoE warm-up step goes this way). Returns whether it patched.
    """
    import torch

    handler = _handler()
    if getattr(handler.tensor_pop, "_waits_for_offload", False):
        return False
    original = handler.tensor_pop

    def tensor_pop(self: Any, tensor_tag: Any) -> Any:
        if isinstance(tensor_tag, torch.Tensor):
            return original(self, tensor_tag)
        group = self.offload_groups[tensor_tag[0] - 1]
        state = group._tensors.get(tensor_tag)
        if not isinstance(state, tuple):  # on the GPU already
            return original(self, tensor_tag)
        stream = torch.cuda.current_stream()
        group.wait_offload_event(stream)
        if not _timing_wanted():
            return original(self, tensor_tag)
        start = COPY_TIMER.event()
        start.record(stream)
        result = original(self, tensor_tag)
        end = COPY_TIMER.event()
        end.record(stream)
        COPY_TIMER.record("h2d", start, end, _state_bytes(state))
        return result

    tensor_pop._waits_for_offload = True  # type: ignore[attr-defined]
    handler.tensor_pop = tensor_pop
    return True


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


def _patch_strided_copies() -> bool:
    """Offload a permuted tensor as its bytes lie, and reload it with the same strides.

    Megatron's ``offload`` makes every non-contiguous tensor contiguous first: a copy kernel on
    the offload stream, which competes with the compute for the GPU, and the tensor comes back
    in a layout autograd did not save, so a backward kernel that wants the original layout
    converts it again. SDPA saves its query, key and output as permuted views of contiguous
    tensors; measured on the 1B dense step (H100, 4 x 4096 tokens, CUDA graphs): 360 extra
    copy kernels and 60 extra concatenations per step, +9 ms (all five modules) to +14 ms (the
    attention pair) of kernel time.
    Here such a tensor (``is_dense_permutation``) lands in a pinned buffer of the same strides
    (a view of a pooled buffer of its shape: one ``cudaMemcpyAsync``, no kernel), and comes
    back into a GPU tensor of the same strides. Other non-contiguous tensors (slices of a larger
    tensor) keep Megatron's path.

    It applies where the installed manager's ``strided_copies`` is true (the runtime sets it
    per plan). Measured on an H100 in one run each (4 x 4096 tokens): the 1B dense step's
    attention pair +36.3% -> +22.1% eagerly and +3.3% -> -0.9% under graphs, all five modules
    +54.5% -> +38.3% and +27.0% -> +22.6%; but the 1B MoE step's attention pair was slower
    with it in two runs (+11.2% -> +17.6%, +17.0% -> +44.4%), although its GPU ran 300 fewer
    kernels (that step waits on the host, which was slower across unrelated code too), so until
    a longer comparison settles it the runtime leaves eager MoE plans on Megatron's copies;
    graphed MoE plans use these (0.298 against 0.300 s, drop-and-pad, attention pair + experts).
    Returns whether it patched."""
    import torch
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    handler, manager_class = _handler(), fgo.PipelineOffloadManager
    if getattr(handler.offload, "_strided", False):
        return False
    original_offload, original_reload = handler.offload, handler.reload

    def offload(self: Any, src_tensor: Any, pin_memory: bool = True, use_cpu_pool: bool = True):
        wanted = getattr(manager_class.OFFLOAD_MGR, "strided_copies", False)
        if not wanted or src_tensor.is_contiguous() or not is_dense_permutation(src_tensor):
            return original_offload(
                self, src_tensor, pin_memory=pin_memory, use_cpu_pool=use_cpu_pool
            )
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

    def reload(self: Any, state: Any, non_blocking: bool | None = None) -> Any:
        device, host, use_cpu_pool = state
        if host.is_contiguous():
            return original_reload(self, state, non_blocking=non_blocking)
        if non_blocking is None:
            non_blocking = host.is_pinned()
        tensor = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        tensor.copy_(host, non_blocking=non_blocking)
        if use_cpu_pool:
            self.cpu_tensor_pool.free(host._base)  # the pooled buffer this view was made of
        return tensor

    offload._strided = True  # type: ignore[attr-defined]
    handler.offload = offload
    handler.reload = reload
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


def _patch_fraction_placement() -> bool:
    """Spread the groups a fraction below 1 offloads evenly over the forward pass.

    Megatron keeps the earliest groups offloaded, for the longest relief (the fraction counts
    groups of all modules together). The peak, though, comes at the end of the forward pass,
    where every offloaded group counts the same, and the earliest groups put all of the copying
    in the first part of the forward. Measured on the 1B dense step (H100, 4 x 4096 tokens, all
    five modules, fraction 0.5, CUDA graphs, max inflight 4, one run): earliest +4.3% against
    a floor of -5.1% (9.4 pp over), spread -2.9% (2.3 pp over), the same peak. Spread, each
    module offloads the fraction of its own groups, evenly spaced over the layers, so the
    copies run beside the whole forward and every module gives up its share of bytes (a count
    over all modules together could pick one module only when two alternate). The manager's
    ``fraction_placement`` (set by the runtime from the recipe) chooses; without it Megatron's
    choice stands. Returns whether it patched."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    manager_class = fgo.PipelineOffloadManager
    if getattr(manager_class.post_warmup_callback, "_placed", False):
        return False
    original = manager_class.post_warmup_callback

    def post_warmup_callback(self: Any) -> Any:
        fraction = self._activation_offload_fraction
        if getattr(self, "fraction_placement", "earliest") != "spread" or fraction >= 1:
            return original(self)
        printer = fgo.print_offload_summary_table
        self._activation_offload_fraction = 1.0  # Megatron's own pass turns nothing off
        fgo.print_offload_summary_table = lambda _bytes: None  # printed below, once right
        try:
            original(self)
        finally:
            fgo.print_offload_summary_table = printer
            self._activation_offload_fraction = fraction
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
        self._offload_summary_total_bytes = sum(summary.values())
        printer(summary)
        return None

    post_warmup_callback._placed = True  # type: ignore[attr-defined]
    manager_class.post_warmup_callback = post_warmup_callback
    return True


def _patch_pooled_expert_groups() -> bool:
    """Give the MoE expert groups (``expert_fc1``, ``moe_act``) pinned buffers from the pool
    once their plan is recorded, where their shapes are static.

    Megatron allocates a fresh pinned tensor for every offload of an expert group, as their row
    count follows the routing (a pool keyed by shape would fill with one-off sizes). With
    drop-and-pad dispatch (``moe_expert_capacity_factor`` with
    ``moe_pad_expert_input_to_capacity``) every expert takes exactly its capacity, so the shapes
    recur with the step's shape, like the dense groups'. A full-iteration CUDA graph needs that:
    its copies write to the host buffers they were captured with on every replay, which the pool
    keeps alive and reuses in the same order, while a fresh tensor is freed after its reload.
    Eagerly it saves a pinned allocation per group and step. It applies where the installed
    manager's ``pool_expert_groups`` is true (the runtime sets it for drop-and-pad models), from
    the first step after the plan's warm-up step. Returns whether it patched."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    manager_class = fgo.PipelineOffloadManager
    if getattr(manager_class.post_warmup_callback, "_pools_experts", False):
        return False
    original = manager_class.post_warmup_callback

    def post_warmup_callback(self: Any) -> Any:
        result = original(self)
        if getattr(self, "pool_expert_groups", False):
            for chunk in self._cached_chunks_forward:
                for group in chunk.offload_groups:
                    group.use_cpu_pool = True  # Megatron's choice was False for expert groups
        return result

    post_warmup_callback._pools_experts = True  # type: ignore[attr-defined]
    manager_class.post_warmup_callback = post_warmup_callback
    return True


def _patch_copy_timing() -> bool:
    """Wrap the bulk offload and reload of a group with CUDA events for :data:`COPY_TIMER`
    (reloads on the compute stream are timed by :func:`_patch_reload_waits_for_offload`)."""

    handler = _handler()
    if getattr(handler.bulk_offload_group, "_timed", False):
        return False
    offload_group, reload_group = handler.bulk_offload_group, handler.bulk_reload_group

    def bulk_offload_group(self: Any, group: Any) -> Any:
        if not _timing_wanted():
            return offload_group(self, group)
        start = COPY_TIMER.event()
        start.record(self.d2h_stream)
        result = offload_group(self, group)
        end = COPY_TIMER.event()
        end.record(self.d2h_stream)
        # What the group offloads: Megatron counts it while recording the plan (this very
        # call on that step), and every replay offloads the same tensors.
        COPY_TIMER.record("d2h", start, end, group.total_offload_bytes)
        return result

    def bulk_reload_group(self: Any) -> Any:
        if not _timing_wanted():
            return reload_group(self)
        group = self._groups_to_reload[-1]
        moved = sum(_state_bytes(v) for v in group._tensors.values() if isinstance(v, tuple))
        # Megatron's reload waits for the offload first; waiting here keeps that wait out of
        # the timed interval.
        group.wait_offload_event(self.h2d_stream)
        start = COPY_TIMER.event()
        start.record(self.h2d_stream)
        result = reload_group(self)
        end = COPY_TIMER.event()
        end.record(self.h2d_stream)
        COPY_TIMER.record("h2d", start, end, moved)
        return result

    bulk_offload_group._timed = True  # type: ignore[attr-defined]
    handler.bulk_offload_group = bulk_offload_group
    handler.bulk_reload_group = bulk_reload_group
    return True


# The ChunkOffloadHandler methods :func:`_patch_lean_hooks` replaces (with the pinned pool's
# allocate and free).
LEAN_METHODS = (
    "on_group_commit_forward",
    "on_group_start_backward",
    "on_group_commit_backward",
    "bulk_offload_group",
    "bulk_reload_group",
    "tensor_need_offloading_checker",
)


class _Streams:
    """The current CUDA stream without building a ``torch.cuda.Stream`` per call, and stream
    switches without ``torch.cuda.stream``'s context manager: measured on the H100 host,
    ``torch.cuda.current_stream()`` costs 7.6 us, the context manager 11.9 us and
    ``wait_stream`` 13.7 us per call (benchmarks/host_primitives.py); Megatron 0.19's code
    makes seven such calls per offloaded group (eight with tensors to release). One ``Stream``
    object is kept per stream seen (a handful)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._known: dict[tuple[int, int, int], Any] = {}

    def current(self) -> Any:
        torch = self._torch
        key = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
        stream = self._known.get(key)
        if stream is None:
            stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._known[key] = stream
        return stream

    def use(self, stream: Any) -> None:
        """Make ``stream`` current (on its device, which is the current one here)."""
        self._torch._C._cuda_setStream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )


def _patch_lean_hooks() -> bool:
    """Do the offload hooks' per-group work in less host time (megatron-core 0.19).

    On a step whose host time already equals its GPU time (the 1B dense step at 4 x 4096
    tokens, eagerly; every MoE step), every microsecond the hooks spend on the host is a
    microsecond of step time: measured on an H100, the hooks took 0.45-0.6 ms per offloaded
    group and that was the whole of the step's added time (benchmarks/results/README.md,
    "Eager offloading is host time"). The same operations, in the same order on the same
    streams, with fewer host calls:

    - a stream waits for the compute stream through one reused event instead of
      ``wait_stream(torch.cuda.current_stream())`` (a new ``Stream`` object and a new event
      per call), when a group's offload or reload starts and when backward waits for a reload;
    - the copies switch streams directly (:class:`_Streams`) instead of through the context
      manager, and the copy timing's events are reused (:meth:`CopyTimer.event`);
    - a group's reload counts its bytes in the loop that reloads it, and waits for its offload
      once (the timing wrapper and Megatron each waited);
    - the pinned pool's allocate and free skip debug messages built for nothing, and free
      finds its tensor by identity in a set instead of scanning the pool's list;
    - the offload check looks its tensor types up once.

    It applies where the installed manager's ``lean_hooks`` is true (the runtime's default, for
    every model: on the eager 1B MoE step it was no faster, +1.2% and +4.2% in a two-round A/B
    within the processes' 4-9% spread, but the MoE runtime suite passed with it and failed
    twice on the H100 without it, cause not yet found), and not while a CUDA graph is captured
    (a capture runs once, and records what every replay does): there the original code runs.
    Measured on an H100 (1B dense, 4 x 4096 tokens,
    eager, hooks' host time per step against Megatron's code in separate processes): the
    norms 54 -> 42 ms; all five modules 135-162 -> 122-146 ms in three pairs, of which the
    reloads 43-59 -> 33-34 ms while the offload side stayed within the host's spread.
    Gradients stayed bitwise equal over the dense and MoE runtime suites' 100 steps each and
    the graphed SFT tests (benchmarks/results/README.md).
    Returns whether it patched."""
    import megatron.core
    import torch
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    handler, manager_class, pool_class = (
        _handler(),
        fgo.PipelineOffloadManager,
        fgo.OffloadTensorPool,
    )
    if getattr(handler.bulk_offload_group, "_lean", False):
        return False
    if not megatron.core.__version__.startswith("0.19."):
        return False  # the methods below follow 0.19's; another version keeps its own
    streams = _Streams()
    capturing = torch.cuda.is_current_stream_capturing
    stray_types = (
        torch._subclasses.fake_tensor.FakeTensor,
        torch._subclasses.functional_tensor.FunctionalTensor,
    )
    waited: dict[int, Any] = {}  # one reused event per waiting stream (keyed by its id)

    def wanted() -> bool:
        """The installed manager asks for lean hooks (the runtime sets it per plan)."""
        return getattr(manager_class.OFFLOAD_MGR, "lean_hooks", False)

    def wait_for(stream: Any, producer: Any) -> None:
        """``stream`` waits for the work issued so far on ``producer``."""
        event = waited.get(id(stream))
        if event is None:
            event = waited[id(stream)] = torch.cuda.Event()
        event.record(producer)
        stream.wait_event(event)

    original_allocate, original_free = pool_class.allocate, pool_class.free
    replaced: list[str] = []

    def replace(function: Any, *, in_capture: bool = False) -> Any:
        """Install ``function`` as the handler method of its name, for plans that want lean
        hooks, outside graph capture unless ``in_capture`` (a method that records no events);
        the method it replaces runs otherwise."""
        name = function.__name__
        original = getattr(handler, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not wanted() or (not in_capture and capturing()):
                return original(self, *args, **kwargs)
            return function(self, *args, **kwargs)

        method.__name__ = name
        method._lean = True  # type: ignore[attr-defined]
        method._replaced = original  # type: ignore[attr-defined]
        # The bulk copies keep timing them (the copy timing's marker, so it is not re-wrapped).
        method._timed = getattr(original, "_timed", False)  # type: ignore[attr-defined]
        setattr(handler, name, method)
        replaced.append(name)
        return method

    @replace
    def on_group_commit_forward(self: Any, name: str, forced_released_tensors: Any) -> Any:
        if not self.do_offload:
            return None
        wait_for(self.d2h_stream, streams.current())
        return self.bulk_offload(name, forced_released_tensors)

    @replace
    def on_group_start_backward(self: Any) -> Any:
        if not self.do_offload:
            return None
        wait_for(self.h2d_stream, streams.current())
        return self.bulk_reload()

    @replace
    def on_group_commit_backward(self: Any, name: str) -> Any:
        if not self.do_offload:
            return None
        manager = manager_class.get_instance()
        if manager.cur_backward_chunk() is not self:
            manager.pop_backward_chunk(name)
        assert manager.cur_backward_chunk() is self, "Chunk mismatch"
        if not fgo.is_graph_capturing():
            for group in self._reloading_group:
                if group._name == name:
                    group.wait_reload_event(streams.current())
                    self._reloading_group.remove(group)
                    break
        return None

    @replace
    def bulk_offload_group(self: Any, group: Any) -> Any:
        d2h, compute = self.d2h_stream, streams.current()
        fgo.nvtx_range_push("activation offloading " + group._name)
        start = COPY_TIMER.event()
        start.record(d2h)
        streams.use(d2h)
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
            streams.use(compute)
        end = COPY_TIMER.event()
        end.record(d2h)
        fgo.nvtx_range_pop("activation offloading " + group._name)
        COPY_TIMER.record("d2h", start, end, group.total_offload_bytes)
        if self._max_inflight_offloads is not None:
            self._offload_pending_by_name[group._name].append(group._offload_event)
            self._drain_offload_pending(group._name)
        return None

    @replace
    def bulk_reload_group(self: Any) -> Any:
        group = self._groups_to_reload[-1]
        h2d, compute = self.h2d_stream, streams.current()
        fgo.nvtx_range_push("activation reloading " + group._name)
        group.wait_offload_event(h2d)
        start = COPY_TIMER.event()
        start.record(h2d)
        moved = 0
        streams.use(h2d)
        try:
            for tag, state in group._tensors.items():
                if isinstance(state, tuple):
                    moved += _state_bytes(state)
                    group.push_tensor(tag, self.reload(state))
            group.record_reload_event(h2d)
        finally:
            streams.use(compute)
        end = COPY_TIMER.event()
        end.record(h2d)
        COPY_TIMER.record("h2d", start, end, moved)
        self._groups_to_reload.pop()
        self._reloading_group.append(group)
        fgo.nvtx_range_pop("activation reloading " + group._name)
        return None

    def tensor_need_offloading_checker(self: Any, tensor: Any) -> bool:
        if (
            isinstance(tensor, (torch.nn.Parameter, *stray_types))
            or tensor.device.type != "cuda"
            or fgo._te_do_not_offload(tensor)
            or tensor.numel() < self.min_offloaded_tensor_size
        ):
            return False
        return not getattr(tensor, "_do_not_offload", False)

    replace(tensor_need_offloading_checker, in_capture=True)

    def allocate(self: Any, shape: Any, dtype: Any = torch.float32) -> Any:
        if fgo.DEBUG or not wanted():
            return original_allocate(self, shape, dtype)
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

    def free(self: Any, tensor: Any) -> Any:
        pool = self._pools.get((tensor.shape, tensor.dtype))
        if fgo.DEBUG or not wanted() or pool is None or id(tensor) not in _owned(pool):
            return original_free(self, tensor)  # Megatron's own messages and errors
        self._stats["free_requests"] += 1
        pool["free"].append(tensor)
        pool["allocated_count"] -= 1
        self._stats["current_in_use"] -= 1
        return None

    assert tuple(replaced) == LEAN_METHODS
    if not getattr(pool_class.free, "_lean", False):
        for function, original in ((allocate, original_allocate), (free, original_free)):
            function._lean, function._replaced = True, original  # type: ignore[attr-defined]
        pool_class.allocate, pool_class.free = allocate, free
    return True


def _owned(pool: dict[str, Any]) -> set[int]:
    """Identities of the tensors a pinned pool made (its list holds them, so they stay
    unique), kept beside the pool's list and rebuilt whenever the list changed size."""
    owned = pool.get("owned")
    if owned is None or owned[0] != len(pool["all"]):
        owned = pool["owned"] = (len(pool["all"]), {id(t) for t in pool["all"]})
    return owned[1]
