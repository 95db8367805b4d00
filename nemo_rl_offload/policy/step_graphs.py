"""Full-iteration CUDA graphs of the training step, one graph per step shape.

``cuda_graph_impl: full_iteration`` captures a whole forward-backward pass in one CUDA graph and
replays it. Megatron-core's own wrapper keeps one training graph per process, wrong for RL,
where steps come in several shapes: :class:`StepGraphs` keeps one per step key. How graphs are
captured, share memory and are dropped: docs/cuda_graphs.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

_LOG = logging.getLogger("nemo_rl_offload.graphs")

StepMode = Literal["eager", "captured", "replayed"]
Inputs = list[dict[str, Any]]


@dataclass
class _KeyGraph:
    """One step key: how many eager steps it ran, and once captured its graph and buffers."""

    eager_steps: int = 0
    graph: Any = None
    static_inputs: Inputs = field(default_factory=list)
    static_outputs: Any = None
    activation_peak_bytes: int = 0


def input_signature(inputs: Inputs) -> tuple:
    """What a graph's static buffers are made of: every tensor's name, shape and dtype."""
    return tuple(
        tuple((name, tuple(value.shape), str(value.dtype)) for name, value in sorted(mb.items()))
        for mb in inputs
    )


def allow_reuse_of_offloaded_memory_in_capture() -> None:
    """Let the caching allocator reuse, within a capture, memory that was freed while a side
    stream still used it (an offloaded activation, freed once its device-to-host copy is
    ordered). Without this PyTorch defers such frees to the end of the capture, so a graphed
    step would keep every offloaded activation on the GPU and offloading would save nothing.
    Settable at run time; a no-op on PyTorch builds without the option."""
    import torch

    try:
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
    except (RuntimeError, AttributeError) as error:  # older PyTorch: option unknown
        _LOG.warning("cuda graphs: allocator option graph_capture_record_stream_reuse: %s", error)


def _tracker_generators() -> list[Any]:
    """The generators of Megatron's model-parallel RNG tracker (dropout and initialisation
    draw from them), which a graph must register so that every replay draws new numbers; none
    before the tracker exists or when its states are not graph-safe generators."""
    import torch
    from megatron.core.tensor_parallel import random as megatron_random

    if not getattr(megatron_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return []
    states = megatron_random.get_all_rng_states().values()
    return [state for state in states if isinstance(state, torch.Generator)]


class StepGraphs:
    """Per-key full-iteration graphs of a training step (see docs/cuda_graphs.md)."""

    def __init__(self, *, warmup_steps: int) -> None:
        if warmup_steps < 1:
            raise ValueError(f"StepGraphs: warmup_steps must be >= 1, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self._keys: dict[Hashable, _KeyGraph] = {}
        self._pool: Any = None  # this instance's graph memory pool, made at the first capture
        self.released = 0  # graphs dropped by release()

    def run(
        self, key: Hashable, inputs: Inputs, step: Callable[[Inputs], Any]
    ) -> tuple[Any, StepMode]:
        """Run ``step(inputs)`` for ``key``: eagerly during the key's warm-up, else as (the
        capture and) a replay of its graph. Returns the step's outputs (for a graph, its static
        outputs, valid until the next step) and how it ran."""
        entry = self._keys.setdefault(key, _KeyGraph())
        if entry.graph is None and entry.eager_steps < self.warmup_steps:
            entry.eager_steps += 1
            return step(inputs), "eager"
        if entry.graph is None:
            self._capture(key, entry, inputs, step)
            mode: StepMode = "captured"
        else:
            for static, given in zip(entry.static_inputs, inputs, strict=True):
                for name, value in given.items():
                    static[name].copy_(value, non_blocking=True)
            mode = "replayed"
        entry.graph.replay()
        return entry.static_outputs, mode

    def _capture(self, key: Hashable, entry: _KeyGraph, inputs: Inputs, step: Callable) -> None:
        import torch
        from megatron.core.full_cuda_graph import get_shared_capture_stream

        if hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
            torch.autograd.graph.set_override_stale_capture_stream(True)
        entry.static_inputs = [{name: value.clone() for name, value in mb.items()} for mb in inputs]
        graph = torch.cuda.CUDAGraph()
        for generator in _tracker_generators():
            graph.register_generator_state(generator)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.cuda.graph(
            graph,
            stream=get_shared_capture_stream(),
            pool=self._pool,
            capture_error_mode="thread_local",
        ):
            entry.static_outputs = step(entry.static_inputs)
        torch.cuda.synchronize()
        entry.activation_peak_bytes = torch.cuda.max_memory_allocated() - before
        entry.graph = graph
        _LOG.info(
            "cuda graphs: captured the training step of shape %s (%d graphs)",
            key,
            self.kept(),
        )

    def activation_peak_bytes(self, key: Hashable) -> int:
        """What the key's captured step allocated at its peak beyond what was resident before
        it (replays allocate nothing: they reuse the capture's memory)."""
        entry = self._keys.get(key)
        return entry.activation_peak_bytes if entry else 0

    def release(self, matches: Callable[[Hashable], bool]) -> int:
        """Drop every key for which ``matches(key)`` holds, graphs and buffers; returns how
        many graphs went."""
        dropped = [key for key in self._keys if matches(key)]
        graphs = 0
        for key in dropped:
            entry = self._keys.pop(key)
            if entry.graph is not None:
                graphs += 1
                entry.graph.reset()
        self.released += graphs
        return graphs

    def kept(self) -> int:
        """Graphs captured and still held."""
        return sum(entry.graph is not None for entry in self._keys.values())

    def metrics(self, mode: StepMode) -> dict[str, float]:
        """How the step ran, and the graphs held (the ``cuda_graph`` metrics)."""
        return {
            "cuda_graph_replayed": float(mode != "eager"),
            "cuda_graph_captured": float(mode == "captured"),
            "cuda_graphs_kept": float(self.kept()),
            "cuda_graphs_released": float(self.released),
        }
