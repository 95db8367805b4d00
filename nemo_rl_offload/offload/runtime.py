"""Keep Megatron's fine-grained offloading correct across the phases of an RL step.

Megatron records one offload plan in the first training step and replays it; RL steps do not
repeat. :class:`OffloadRuntime` (owned by the policy worker; it does nothing when offloading is
off) suspends offloading for forward-only passes, keeps one plan per step shape and fixes the
warm-up step. What goes wrong without it: docs/offloading.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from nemo_rl_offload.config.megatron_settings import RuntimeChoices
from nemo_rl_offload.config.router_replay import NO_ROUTE, ROUTES_KEY

_LOG = logging.getLogger("nemo_rl_offload.offload")


def host_allocator_bytes() -> int:
    """Bytes of pinned memory torch's caching host allocator holds (in use and cached), where
    ``torch.empty(..., pin_memory=True)`` lands, the offload pool's slabs included; 0 without
    CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def plan_metrics(manager: Any) -> dict[str, float]:
    """Bytes the manager's recorded plan offloads per step, per module and in all, and the
    pinned host memory (GiB): the shared pool's slabs (``offload_pool_gib``), torch's caching
    host allocator (``torch_pinned_host_gib``: where the pool's slabs come from, with whatever
    else the process pinned through torch), the larger of the two (``pinned_host_gib``: all of
    the process's pinned memory, or the pool's where torch reports none), the largest kept
    plan's need (the most bytes its steps hold in the pool at once), this plan's, and pinned
    over the largest need (``pinned_over_need``; the pool keeps it at most
    :data:`.owned.POOL_SLACK` where the plans' buffers nest, see :class:`.owned.OwnedHostPool`)."""
    per_module: dict[str, int] = {}
    for chunk in manager._cached_chunks_forward:
        for group in chunk.offload_groups:
            if group.offload:
                per_module[group._name] = per_module.get(group._name, 0) + int(
                    group.total_offload_bytes
                )
    metrics = {f"offloaded_gib_{name}": count / 2**30 for name, count in per_module.items()}
    metrics["offloaded_gib_per_step"] = sum(per_module.values()) / 2**30
    pool = manager.cpu_tensor_pool
    pooled, torch_pinned, need = pool.pinned_bytes(), host_allocator_bytes(), pool.largest_need()
    metrics["offload_pool_gib"] = pooled / 2**30
    metrics["torch_pinned_host_gib"] = torch_pinned / 2**30
    pinned = max(pooled, torch_pinned)
    metrics["pinned_host_gib"] = pinned / 2**30
    metrics["largest_plan_need_gib"] = need / 2**30
    metrics["plan_need_gib"] = pool.need_by_plan.get(pool.plan, 0) / 2**30
    metrics["pinned_over_need"] = pinned / need if need else 0.0
    # Buffers the pool had to make (a request no free buffer held), since the runtime began.
    metrics["offload_pool_misses"] = float(pool._stats["pool_misses"])
    return metrics


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


def pads_steps(offloading: bool, full_iteration_graphs: bool) -> bool:
    """Whether training steps are padded to the length buckets: with offloading (one plan per
    step shape) or full-iteration CUDA graphs (one graph per step shape), which both need
    shapes that recur. The one rule the runtime, the recipe checks and validate's report use."""
    return offloading or full_iteration_graphs


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``length`` (``length`` itself beyond the largest: the
    recipe's checks keep sequences within max_total_sequence_length, the largest bucket)."""
    for bucket in buckets:
        if bucket >= length:
            return bucket
    return length


def pad_microbatches(
    microbatches: list[dict[str, np.ndarray]], length: int
) -> list[dict[str, np.ndarray]]:
    """Right-pad every per-token array (axis 1 is the sequence) to ``length`` with zeros.

    Zeros are safe: attention is causal, so right padding does not change earlier positions,
    and padded positions have loss mask 0 (the losses ignore what padding holds there). A
    packed micro-batch's padding becomes one more segment (``cu_seqlens``) of no sequence
    (``segment_ids`` -1), and its sampled routes none (``NO_ROUTE``: the router's own choice;
    zeros would be one expert twice)."""
    padded = []
    for batch in microbatches:
        current = batch["input_ids"].shape[1]
        out = {}
        for key, value in batch.items():
            if key == "cu_seqlens" and current < length:
                value = np.append(value, np.asarray(length, dtype=value.dtype))
            elif value.ndim >= 2 and value.shape[1] == current and current < length:
                widths = [(0, 0)] * value.ndim
                widths[1] = (0, length - current)
                fill = -1 if key == "segment_ids" else NO_ROUTE if key == ROUTES_KEY else 0
                value = np.pad(value, widths, constant_values=fill)
            out[key] = value
        padded.append(out)
    return padded


class OffloadRuntime:
    """One offload plan per step shape, sharing one pinned pool under a host-memory budget.

    A step's shape is its micro-batch count and padded sequence length: every micro-batch of a
    step is padded to the smallest of ``sequence_buckets`` that holds its longest sequence, so
    the tensors a plan offloads have the same shapes whenever the shape recurs. Megatron's
    manager is a process-wide singleton holding one recorded plan, so the runtime keeps one
    manager per shape and installs the right one before each step: a shape seen before replays
    its own plan; a new shape records a new plan.

    The pinned host buffers are the runtime's subclass of Megatron's OffloadTensorPool,
    :class:`.owned.OwnedHostPool`, which every plan shares and which lends buffers by size, not
    shape: a step draws buffers only within itself, so a smaller shape runs in a larger one's
    buffers, and after each step the pool rebuilds itself when it holds more than
    :data:`.owned.POOL_SLACK` times the largest kept plan's need. Pinned memory then follows
    the largest step, not the number of shapes. When it exceeds ``host_budget_bytes``, the
    least recently used plans are released (logged, and counted in the metrics) and the pool
    keeps what the others need, until it fits, so host memory never grows without bound.
    """

    def __init__(
        self,
        config: Any,
        *,
        host_budget_bytes: int | None = None,
        sequence_buckets: Sequence[int] = (),
        graphed: bool = False,
        on_release: Callable[[tuple[int, int]], None] | None = None,
        choices: RuntimeChoices | None = None,
    ) -> None:
        """``config`` is the model's TransformerConfig (offloading is on when its flag is).
        ``graphed``: steps run as full-iteration CUDA graphs (padded then, offloading or not);
        ``on_release(shape)`` is told when a plan is released; ``choices``: the model's
        (:func:`.apply.runtime_choices`, their one owner). They become every plan's
        :attr:`choices` (:class:`.owned.PlanChoices`), with the Megatron-LM 7398 fix, the copy
        timing and ``pool_every_group`` on.

        With offloading on, it refuses (UserInputError) a megatron-core whose offload code is
        not the one the runtime's subclasses were checked against
        (:func:`.owned.require_checked_megatron`)."""
        from nemo_rl_offload.offload import owned

        self.config = config
        self.enabled = bool(getattr(config, "fine_grained_activation_offloading", False))
        self.pad_steps = pads_steps(self.enabled, graphed)
        self.on_release = on_release
        self.host_budget_bytes = host_budget_bytes
        self.sequence_buckets = sorted(sequence_buckets)
        self.step_shape: tuple[int, int] = (0, 0)  # (micro-batches, padded length) of the step
        self._plans: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._pool: Any = None  # the plans' OwnedHostPool, made with the first plan
        self.plans_recorded = 0
        self.plans_released = 0
        if self.enabled:
            owned.require_checked_megatron()
        # Every plan's choices (a benchmark may replace them before the first step).
        choices = choices or RuntimeChoices()
        self.choices = owned.PlanChoices(
            reload_waits_for_offload=True,
            strided_copies=choices.strided_copies,
            fraction_placement=choices.fraction_placement,
            fraction_by_module=choices.fraction_by_module,
            pool_expert_groups=choices.pool_expert_groups,
            pool_every_group=True,
            lean_hooks=choices.lean_hooks,
            one_copy_per_storage=choices.one_copy_per_storage,
            copy_timer=owned.CopyTimer(),
        )

    @staticmethod
    def _manager() -> Any:
        """Megatron's manager class, whose ``OFFLOAD_MGR`` is the manager Megatron's layers use
        (the seam through which the runtime installs each plan's own manager)."""
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            PipelineOffloadManager,
        )

        return PipelineOffloadManager

    def _new_pool(self) -> Any:
        """The pinned pool every plan shares."""
        from nemo_rl_offload.offload.owned import OwnedHostPool

        return OwnedHostPool()

    def _new_manager(self) -> Any:
        """A manager for a new plan, with the runtime's choices and pool."""
        from nemo_rl_offload.offload.owned import OwnedOffloadManager

        return OwnedOffloadManager(self.choices, pool=self._pool)

    def prepare_step(
        self,
        microbatches: list[dict[str, np.ndarray]],
        sync_length: Callable[[int], int] | None = None,
    ) -> list[dict[str, np.ndarray]]:
        """Call before each training step with its micro-batches: pads them to the step's
        length bucket and installs the plan of the step's shape (or records one). Returns the
        micro-batches to train on (unchanged when :func:`pads_steps` says so).
        ``sync_length(length)`` may agree the padded length with other ranks (the largest)."""
        length = max(batch["input_ids"].shape[1] for batch in microbatches)
        if self.pad_steps:
            length = bucket_for(length, self.sequence_buckets)
            if sync_length is not None:
                length = sync_length(length)
            microbatches = pad_microbatches(microbatches, length)
        self.before_step(len(microbatches), length)
        return microbatches

    def before_step(self, num_microbatches: int, seq_len: int) -> None:
        """Note the step's shape and install its plan (or record one); :meth:`prepare_step`
        calls it."""
        shape = self.step_shape = (num_microbatches, seq_len)
        if not self.enabled:
            return
        manager_cls = self._manager()
        if shape in self._plans:
            if manager_cls.OFFLOAD_MGR is not self._plans[shape]:  # else: installed already
                manager_cls.OFFLOAD_MGR = self._plans[shape]
            self._plans.move_to_end(shape)
        else:
            if self._pool is None:
                self._pool = self._new_pool()
            manager = self._plans[shape] = self._new_manager()
            manager_cls.OFFLOAD_MGR = manager
            self.plans_recorded += 1
        self._pool.plan = shape  # the pool notes each plan's need and draws

    def _enforce_budget(self) -> None:
        if self.host_budget_bytes is None:
            return
        pool = self._pool
        while len(self._plans) > 1 and self.pinned_bytes() > self.host_budget_bytes:
            oldest = next(iter(self._plans))
            if oldest == self.step_shape:
                break
            del self._plans[oldest]
            pool.release(oldest)
            self.plans_released += 1
            if self.on_release is not None:
                self.on_release(oldest)
            _LOG.warning(
                "offload: released the plan of step shape %s (micro-batches x length) to keep "
                "pinned host memory under offload_host_memory_budget_gib=%.2f; it is recorded "
                "again when that shape recurs",
                oldest,
                self.host_budget_bytes / 2**30,
            )

    def pinned_bytes(self) -> int:
        """Pinned host bytes held by the pool the plans share (the budget's measure: torch's
        caching host allocator also holds pinned memory of others, reported beside it)."""
        return 0 if self._pool is None else self._pool.pinned_bytes()

    def after_step(self, *, copies_timed: bool = True) -> dict[str, float]:
        """Offload metrics of the step just run: bytes per module over every micro-batch of
        the step, from the plan the manager replays (Megatron's own summary table counts only
        the first micro-batch), copy time and bandwidth, the step's shape, and the pinned host
        memory of all kept plans. ``copies_timed`` False (a CUDA graph replay, where no Python
        runs to record copy events) leaves the copy time and bandwidth out."""
        if not self.enabled:
            return {}
        if self._pool is not None:
            self._pool.settle()
        self._enforce_budget()
        metrics = plan_metrics(self._manager().get_instance())
        # plan_metrics' pinned_host_gib is the plan's pool: the one pool all kept plans share.
        timer = self.choices.copy_timer
        copies = timer.collect() if timer is not None else {}
        if copies_timed:
            metrics.update(copies)
        metrics["offload_step_microbatches"] = float(self.step_shape[0])
        metrics["offload_step_length"] = float(self.step_shape[1])
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
