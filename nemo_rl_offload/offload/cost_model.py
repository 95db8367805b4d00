"""The physical model of offloading's cost (docs/benchmark.md): the benchmark's floors.

Per micro-batch, offloading moves S bytes to the host during the forward pass (forward time F,
device-to-host bandwidth Wd) and back during the backward pass (time B, host-to-device
bandwidth Wh). The copies run on their own streams beside the compute, so at best they hide
completely; what cannot hide is the part of each transfer longer than the pass it overlaps:

    floor = max(0, S / Wd - F) + max(0, S / Wh - B)

A plan's measured overhead above this floor is cost that is not bandwidth: hook and launch
overhead on the CPU, reloads scheduled late, allocator effects. The benchmark reports both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PassTimes:
    """Forward and backward seconds of one micro-batch without offloading."""

    forward_s: float
    backward_s: float


def overhead_floor_s(
    offloaded_bytes: float, times: PassTimes, d2h_bytes_per_s: float, h2d_bytes_per_s: float
) -> float:
    """The least time offloading ``offloaded_bytes`` of one micro-batch can add (seconds)."""
    if offloaded_bytes <= 0:
        return 0.0
    if d2h_bytes_per_s <= 0 or h2d_bytes_per_s <= 0:
        raise ValueError("bandwidths must be > 0")
    to_host = offloaded_bytes / d2h_bytes_per_s
    back = offloaded_bytes / h2d_bytes_per_s
    return max(0.0, to_host - times.forward_s) + max(0.0, back - times.backward_s)


def step_floor_s(
    baseline_step_s: float,
    microbatches: int,
    offloaded_bytes_per_step: float,
    times: PassTimes,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
) -> float:
    """The least step time of a plan: the step without offloading plus each micro-batch's
    floor (micro-batches run one after another without pipeline parallelism)."""
    per_microbatch = offloaded_bytes_per_step / max(1, microbatches)
    floor = overhead_floor_s(per_microbatch, times, d2h_bytes_per_s, h2d_bytes_per_s)
    return baseline_step_s + microbatches * floor
