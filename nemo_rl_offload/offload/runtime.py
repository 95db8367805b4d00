"""Keep Megatron's fine-grained offloading correct across the phases of an RL step.

Megatron-core's PipelineOffloadManager records one offload plan during the first training step
and replays it on every later one. RL steps do not repeat (shared/measurements/RESULTS.md):

- a forward-only pass (logprobs, reference or teacher scores, generation) in between crashes the
  next backward (``AssertionError: Chunk mismatch``): :meth:`OffloadRuntime.forward_only`
  suspends offloading for such passes (measured: the suspension avoids the crash);
- a different micro-batch count silently drops the savings, and changing lengths grow the
  pinned pool without bound: :meth:`OffloadRuntime.before_step` keeps one plan per step shape
  (measured: a plan recorded for its shape keeps the savings), under a host-memory budget;
- the warm-up step's gradients differ from a model without offload (Megatron-LM issue 7398):
  :func:`_patch_reload_waits_for_offload` closes the race behind it.

The runtime is owned by the policy worker; it does nothing when offloading is off (CPU workers,
recipes without FGO).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any


def _patch_reload_waits_for_offload() -> bool:
    """Make a synchronous reload wait for its offload copy (megatron-core 0.19).

    Megatron-LM issue 7398: during the warm-up step every group is offloaded, including the
    last one, whose tensors backward needs at once, before any bulk reload. Then
    ``ChunkOffloadHandler.tensor_pop`` reloads them on the current stream from pinned memory
    that the device-to-host copy on the side stream may not have finished writing, so the
    warm-up step computes with partly stale activations (measured: step-1 gradients differ from
    an identical model without offload; later steps, which keep that group on the GPU, are
    bitwise equal). The fix: before such a reload, the current stream waits for the group's
    offload event, which the group records after its copies. Returns whether it patched.
    """
    import torch
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    handler = fgo.ChunkOffloadHandler
    if getattr(handler.tensor_pop, "_waits_for_offload", False):
        return False
    original = handler.tensor_pop

    def tensor_pop(self: Any, tensor_tag: Any) -> Any:
        if not isinstance(tensor_tag, torch.Tensor):
            group = self.offload_groups[tensor_tag[0] - 1]
            if isinstance(group._tensors.get(tensor_tag), tuple):
                group.wait_offload_event(torch.cuda.current_stream())
        return original(self, tensor_tag)

    tensor_pop._waits_for_offload = True  # type: ignore[attr-defined]
    handler.tensor_pop = tensor_pop
    return True


def plan_metrics(manager: Any) -> dict[str, float]:
    """Bytes the manager's recorded plan offloads per step, per module and in all, and the
    pinned host bytes held by its tensor pool (GiB)."""
    per_module: dict[str, int] = {}
    for chunk in getattr(manager, "_cached_chunks_forward", []):
        for group in chunk.offload_groups:
            if group.offload:
                per_module[group._name] = per_module.get(group._name, 0) + int(
                    group.total_offload_bytes
                )
    metrics = {f"offloaded_gib_{name}": count / 2**30 for name, count in per_module.items()}
    metrics["offloaded_gib_per_step"] = sum(per_module.values()) / 2**30
    metrics["pinned_host_gib"] = _pinned_bytes(manager) / 2**30
    return metrics


def _pinned_bytes(manager: Any) -> int:
    pool = getattr(manager, "_cpu_tensor_pool", None)
    return sum(
        tensor.numel() * tensor.element_size()
        for entry in getattr(pool, "_pools", {}).values()
        for tensor in entry["all"]
    )


def default_host_budget_bytes() -> int:
    """Half of this host's RAM, shared by the GPUs on it (each runs one worker)."""
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpus = 1
    try:
        import pynvml

        pynvml.nvmlInit()
        gpus = max(1, pynvml.nvmlDeviceGetCount())
    except Exception:  # no NVML: count this worker's GPU only
        pass
    return ram // 2 // gpus


class OffloadRuntime:
    """One offload plan per step shape, under a host-memory budget.

    A step's shape is its micro-batch count and padded sequence length (lengths are padded to
    ``policy.make_sequence_length_divisible_by``, which bounds how many shapes there are).
    Megatron's manager is a process-wide singleton holding one recorded plan and the pinned
    pool that plan fills, so the runtime keeps one manager per shape and installs the right
    one before each step: a shape seen before replays its own plan and reuses its pinned
    buffers; a new shape records a new plan. When the pinned memory of all kept plans exceeds
    ``host_budget_bytes``, the least recently used plans are released (and counted in the
    metrics) until it fits, so host memory never grows without bound.
    """

    def __init__(self, config: Any, *, host_budget_bytes: int | None = None) -> None:
        """``config`` is the model's TransformerConfig (offloading is on when its flag is)."""
        self.config = config
        self.enabled = bool(getattr(config, "fine_grained_activation_offloading", False))
        self.host_budget_bytes = host_budget_bytes
        self._plans: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._current: tuple[int, int] | None = None
        self.plans_recorded = 0
        self.plans_released = 0
        if self.enabled:
            _patch_reload_waits_for_offload()

    @staticmethod
    def _manager() -> Any:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            PipelineOffloadManager,
        )

        return PipelineOffloadManager

    def before_step(self, num_microbatches: int, seq_len: int = 0) -> None:
        """Call before each training step: install the plan of this shape (or record one)."""
        if not self.enabled:
            return
        shape = (num_microbatches, seq_len)
        if shape == self._current:
            return
        manager_cls = self._manager()
        if shape in self._plans:
            manager_cls.OFFLOAD_MGR = self._plans[shape]
            self._plans.move_to_end(shape)
        else:
            manager_cls.reset_instance()
            self._plans[shape] = manager_cls.OFFLOAD_MGR
            self.plans_recorded += 1
        self._current = shape

    def _enforce_budget(self) -> None:
        if self.host_budget_bytes is None:
            return
        while len(self._plans) > 1 and self.pinned_bytes() > self.host_budget_bytes:
            oldest = next(iter(self._plans))
            if oldest == self._current:
                break
            del self._plans[oldest]  # its pinned pool is freed with it
            self.plans_released += 1

    def pinned_bytes(self) -> int:
        """Pinned host bytes held by the pools of every kept plan."""
        return sum(_pinned_bytes(manager) for manager in self._plans.values())

    def after_step(self, num_microbatches: int) -> dict[str, float]:
        """Offload metrics of the step just run, from the plan the manager replays: bytes per
        module over every micro-batch of the step (Megatron's own summary table counts only
        the first micro-batch), and the pinned host memory of all kept plans."""
        if not self.enabled:
            return {}
        self._enforce_budget()
        metrics = plan_metrics(self._manager().get_instance())
        metrics["pinned_host_gib"] = self.pinned_bytes() / 2**30
        metrics["offload_plans_recorded"] = float(self.plans_recorded)
        metrics["offload_plans_kept"] = float(len(self._plans))
        metrics["offload_plans_released"] = float(self.plans_released)
        return metrics

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """Run a pass without gradients outside the offload plan: the modules see offloading
        off, and the manager neither records nor replays anything."""
        if not self.enabled:
            yield
            return
        manager = self._manager().get_instance()
        self.config.fine_grained_activation_offloading = False
        manager.disable_offload()
        try:
            yield
        finally:
            manager.enable_offload()
            self.config.fine_grained_activation_offloading = True
