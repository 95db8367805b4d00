"""The GPU timeline summary of benchmarks/profile_offload_step.py, on a hand-made trace."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_offload_step as profile  # noqa: E402


def _span(category: str, name: str, start_us: float, end_us: float, stream: int = 7) -> dict:
    return {
        "ph": "X",
        "cat": category,
        "name": name,
        "ts": start_us,
        "dur": end_us - start_us,
        "args": {"stream": stream},
    }


def test_the_summary_splits_idle_time_by_copy_and_counts_both_directions_at_once():
    events = [
        _span("kernel", "gemm", 0, 100),
        _span("kernel", "norm", 150, 160),
        _span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 10, 60, stream=20),
        _span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 40, 130, stream=21),
    ]
    summary = profile.summarise_trace(events)
    assert summary["window_s"] == pytest.approx(160e-6)
    assert summary["compute_busy_s"] == pytest.approx(110e-6)
    assert summary["d2h_busy_s"] == pytest.approx(50e-6)
    assert summary["h2d_busy_s"] == pytest.approx(90e-6)
    assert summary["both_directions_busy_s"] == pytest.approx(20e-6)  # 40-60
    assert summary["idle_during_h2d_s"] == pytest.approx(30e-6)  # 100-130: a reload
    assert summary["idle_no_copy_s"] == pytest.approx(20e-6)  # 130-150: the CPU behind
    assert summary["kernels"] == 2 and summary["side_stream_kernel_s"] == 0


def test_a_trace_without_kernels_says_so():
    assert profile.summarise_trace([]) == {"error": "no kernels in the trace"}
