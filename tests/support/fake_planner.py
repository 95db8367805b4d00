"""Telemetry records as a graphed job reports them to the planner (``planner._measure``), for
planner tests that run no workers: warm-up steps eager, one captured, the rest replayed;
offloading saves 2 GiB of peak and moves 0.5 GiB per module and micro-batch."""

from __future__ import annotations

from nemo_rl_offload import planner


def graphed_records(overrides: list[str], steps: int) -> list[dict]:
    offloading = any("fine_grained_activation_offloading=true" in o for o in overrides)
    records = []
    for step in range(1, steps + 1):
        record = {
            "length": 1024,
            "peak_fwd_bwd_gpu_memory_gib": 18.0 if offloading else 20.0,
            "peak_activation_gpu_memory_gib": 5.0,
            "fwd_bwd_time_s": 0.3,
            "offload_step_microbatches": 4.0,
            "cuda_graph_replayed": float(step >= 4),
            "cuda_graph_captured": float(step == 4),
        }
        if offloading:
            record.update({f"offloaded_gib_{m}": 2.0 for m in planner.DENSE_MODULES})
        records.append(record)
    return records
