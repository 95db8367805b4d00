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
- :func:`_patch_copy_timing`: CUDA events around each group's copies, for :data:`COPY_TIMER`
  (copy time and achieved bandwidth in the step metrics).
"""

from __future__ import annotations

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
            intervals.clear()
        return metrics


COPY_TIMER = CopyTimer()


def install() -> None:
    """Install every change (idempotent: each checks its own marker)."""
    _patch_reload_waits_for_offload()
    _patch_strided_copies()
    _patch_fraction_placement()
    _patch_copy_timing()


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
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        result = original(self, tensor_tag)
        end = torch.cuda.Event(enable_timing=True)
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
    a longer comparison settles it the runtime leaves MoE models on Megatron's copies. Returns
    whether it patched."""
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


def _patch_copy_timing() -> bool:
    """Wrap the bulk offload and reload of a group with CUDA events for :data:`COPY_TIMER`
    (reloads on the compute stream are timed by :func:`_patch_reload_waits_for_offload`)."""
    import torch

    handler = _handler()
    if getattr(handler.bulk_offload_group, "_timed", False):
        return False
    offload_group, reload_group = handler.bulk_offload_group, handler.bulk_reload_group

    def bulk_offload_group(self: Any, group: Any) -> Any:
        if not _timing_wanted():
            return offload_group(self, group)
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.d2h_stream)
        result = offload_group(self, group)
        end = torch.cuda.Event(enable_timing=True)
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
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.h2d_stream)
        result = reload_group(self)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.h2d_stream)
        COPY_TIMER.record("h2d", start, end, moved)
        return result

    bulk_offload_group._timed = True  # type: ignore[attr-defined]
    handler.bulk_offload_group = bulk_offload_group
    handler.bulk_reload_group = bulk_reload_group
    return True
