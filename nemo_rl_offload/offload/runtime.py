"""Keep Megatron's fine-grained offloading correct across the phases of an RL step.

Megatron-core's PipelineOffloadManager records one offload plan during the first training step
and replays it on every later one. RL steps do not repeat (shared/measurements/RESULTS.md):

- a forward-only pass (logprobs, reference or teacher scores, generation) in between crashes the
  next backward (``AssertionError: Chunk mismatch``): :meth:`OffloadRuntime.forward_only`
  suspends offloading for such passes (measured: the suspension avoids the crash);
- a different micro-batch count silently drops the savings: :meth:`OffloadRuntime.before_step`
  records a fresh plan whenever the count changes (measured: savings hold);
- the warm-up step's gradients differ from a model without offload (Megatron-LM issue 7398):
  :func:`_patch_reload_waits_for_offload` closes the race behind it.

The runtime is owned by the policy worker; it does nothing when offloading is off (CPU workers,
recipes without FGO). Shape buckets, the host-pool budget, first-step numerics and per-module
telemetry build on this class.
"""

from __future__ import annotations

import contextlib
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
    pool = getattr(manager, "_cpu_tensor_pool", None)
    pinned = sum(
        tensor.numel() * tensor.element_size()
        for entry in getattr(pool, "_pools", {}).values()
        for tensor in entry["all"]
    )
    metrics = {f"offloaded_gib_{name}": count / 2**30 for name, count in per_module.items()}
    metrics["offloaded_gib_per_step"] = sum(per_module.values()) / 2**30
    metrics["pinned_host_gib"] = pinned / 2**30
    return metrics


class OffloadRuntime:
    def __init__(self, config: Any) -> None:
        """``config`` is the model's TransformerConfig (offloading is on when its flag is)."""
        self.config = config
        self.enabled = bool(getattr(config, "fine_grained_activation_offloading", False))
        if self.enabled:
            _patch_reload_waits_for_offload()
        self._plan_microbatches: int | None = None
        self.plans_recorded = 0
        self.last_step_offloaded_bytes = 0

    @staticmethod
    def _manager() -> Any:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            PipelineOffloadManager,
        )

        return PipelineOffloadManager

    def before_step(self, num_microbatches: int) -> None:
        """Call before each training step: a new micro-batch count records a new plan."""
        if not self.enabled:
            return
        if num_microbatches != self._plan_microbatches:
            self._manager().reset_instance()
            self._plan_microbatches = num_microbatches
            self.plans_recorded += 1

    def after_step(self, num_microbatches: int) -> dict[str, float]:
        """Offload metrics of the step just run, from the plan the manager replays: bytes per
        module over every micro-batch of the step (Megatron's own summary table counts only
        the first micro-batch), and the pinned host memory its pool holds."""
        if not self.enabled:
            return {}
        metrics = plan_metrics(self._manager().get_instance())
        self.last_step_offloaded_bytes = int(metrics["offloaded_gib_per_step"] * 2**30)
        metrics["offload_plans_recorded"] = float(self.plans_recorded)
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
