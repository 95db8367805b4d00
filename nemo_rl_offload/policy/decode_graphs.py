"""CUDA graphs of the sampler's decode step, one per attention window of the KV cache.

An eager decode step launches a few hundred small kernels from Python; at batch sizes where a
step's arithmetic is a millisecond or less, the launches are the step. A graph replays them
all at once. The step reads its inputs from tensors that stay in place (the rows' tokens and
positions) and writes its logits to one output per graph; only the number of cache positions
it attends over changes the kernels, so each window gets its own graph, captured the first time
a step needs it and sharing one memory pool with the others.

Capturing is safe in the middle of a call: the warm-up run before a capture is the step itself
(it stores the same keys and values at the same positions the replay stores again).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import torch

from nemo_rl_offload.models.kv_cache import KVCache


def windows(shortest: int, longest: int, count: int | None) -> Callable[[int], int]:
    """The window a step that needs ``n`` positions attends over: ``n`` itself when eager
    (``count`` None), else the smallest of ``count`` windows evenly splitting
    ``shortest..longest``."""
    if count is None:
        return lambda n: n
    span = max(longest - shortest, 0)
    ceilings = sorted(
        {min(longest, shortest + math.ceil(span * (i + 1) / count)) for i in range(count)}
    )

    def pick(n: int) -> int:
        return ceilings[min(bisect.bisect_left(ceilings, n), len(ceilings) - 1)]

    return pick


class DecodeGraphs:
    def __init__(
        self, step: Callable[[], torch.Tensor], cache: KVCache, pool: object | None = None
    ) -> None:
        """``pool``: the memory pool of an earlier batch size's graphs, to share."""
        self.step, self.cache = step, cache
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool

    def run(self, window: int) -> torch.Tensor:
        """The step's logits, attending over ``window`` cache positions."""
        self.cache.window = window
        if window not in self.graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step()  # warm-up: the same writes the replay makes
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.step()
            self.graphs[window] = (graph, output)
        graph, output = self.graphs[window]
        graph.replay()
        return output

    def release(self) -> None:
        self.graphs.clear()
