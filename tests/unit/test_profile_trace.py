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


def test_several_profiled_steps_split_by_their_host_ranges():
    mark = profile.STEP_MARK
    events = [
        _span("user_annotation", f"{mark}0", 0, 1000),
        _span("user_annotation", f"{mark}1", 1000, 2000),
        _span("gpu_user_annotation", f"{mark}0", 5, 950, stream=7),  # the GPU's copy
        _span("kernel", "gemm", 10, 500),
        _span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 600, 900, stream=20),
        _span("kernel", "gemm", 1100, 1900),
        {"ph": "i", "name": "marker", "ts": 5},  # not a span: no step holds it
    ]
    first, second = profile.split_steps(events)
    assert [e["name"] for e in first] == [
        f"{mark}0",
        f"{mark}0",
        "gemm",
        "Memcpy DtoH (Device -> Pinned)",
    ]
    assert [e["name"] for e in second] == [f"{mark}1", "gemm"]
    assert profile.summarise_trace(first)["d2h_busy_s"] == pytest.approx(300e-6)
    assert profile.summarise_trace(second)["compute_busy_s"] == pytest.approx(800e-6)


def test_idle_time_the_host_caused_is_told_from_waits_on_queued_work():
    def kernel(start: float, end: float, correlation: int) -> dict:
        event = _span("kernel", "k", start, end)
        event["args"]["correlation"] = correlation
        return event

    def launch(at: float, correlation: int) -> dict:
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": at,
            "dur": 5,
            "args": {"correlation": correlation},
        }

    events = [
        kernel(0, 100, 1),
        launch(0, 1),
        kernel(130, 200, 2),  # launched at 120, after the GPU went idle at 100: host behind
        launch(120, 2),
        kernel(250, 300, 3),  # launched at 50, long before: it waited (an event, a copy)
        launch(50, 3),
    ]
    summary = profile.summarise_trace(events)
    assert summary["idle_s"] == pytest.approx(80e-6)
    assert summary["idle_host_behind_s"] == pytest.approx(30e-6)


def test_the_longest_idle_stretches_say_where_they_were_and_what_ended_them():
    events = [
        _span("kernel", "gemm", 0, 100),
        _span("kernel", "norm", 150, 160),  # after 50 us idle while a copy out runs
        _span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 90, 140, stream=20),
        _span("kernel", "softmax", 180, 200),  # after 20 us with no copy
    ]
    longest = profile.summarise_trace(events)["longest_idle"]
    assert [(s["at_ms"], s["idle_ms"]) for s in longest] == [(0.1, 0.05), (0.16, 0.02)]
    first, second = longest
    assert (first["previous_kernel"], first["next_kernel"]) == ("gemm", "norm")
    assert first["d2h_running"] and not first["h2d_running"] and not second["d2h_running"]
    assert second["next_kernel"] == "softmax" and not second["host_behind"]


def test_an_idle_stretch_lists_what_the_host_issued_between_its_two_kernels():
    def kernel(name: str, start: float, end: float, correlation: int) -> dict:
        event = _span("kernel", name, start, end)
        event["args"]["correlation"] = correlation
        return event

    def call(name: str, at: float, correlation: int | None = None) -> dict:
        args = {} if correlation is None else {"correlation": correlation}
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": at, "dur": 1, "args": args}

    events = [
        call("cudaLaunchKernel", 0, 1),
        kernel("sdpa", 5, 100, 1),
        call("cudaEventRecord", 2),
        call("cudaStreamWaitEvent", 3),
        call("cudaMemcpyAsync", 4),
        call("cudaMemcpyAsync", 4.5),
        call("cudaLaunchKernel", 6, 2),  # queued long before the stretch: it waited
        kernel("gemm", 150, 200, 2),
    ]
    (stretch,) = profile.summarise_trace(events)["longest_idle"]
    assert not stretch["host_behind"] and stretch["next_kernel"] == "gemm"
    assert stretch["calls_between"] == [
        "cudaEventRecord x1",
        "cudaStreamWaitEvent x1",
        "cudaMemcpyAsync x2",
    ]


def test_a_kernel_launched_through_the_driver_api_has_its_launch_time():
    """cuBLASLt's GEMMs and Triton's kernels are launched with the driver API: a stretch the
    host caused before one of them is the host's, not a wait on queued work."""
    kernel = _span("kernel", "nvjet_gemm", 150, 200)
    kernel["args"]["correlation"] = 2
    first = _span("kernel", "norm", 0, 100)
    first["args"]["correlation"] = 1
    launches = [
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 0,
            "dur": 1,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_driver",
            "name": "cuLaunchKernelEx",
            "ts": 120,
            "dur": 1,
            "args": {"correlation": 2},
        },
    ]
    (stretch,) = profile.summarise_trace([first, kernel, *launches])["longest_idle"]
    assert stretch["host_behind"] and stretch["calls_between"] == []
