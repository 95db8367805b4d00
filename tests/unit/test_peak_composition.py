"""The peak-composition replay (benchmarks/peak_composition.py) on hand-made allocator traces."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import peak_composition as pc  # noqa: E402

GPT = "/site/megatron/core/models/gpt/gpt_model.py"


def _alloc(addr: int, size: int, filename: str, time_us: int = 0) -> dict:
    frames = [{"filename": filename, "line": 7, "name": "forward"}]
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames, "time_us": time_us}


def _event(action: str, addr: int, size: int, time_us: int = 0) -> dict:
    return {"action": action, "addr": addr, "size": size, "time_us": time_us}


def _free(addr: int, size: int) -> list[dict]:
    return [_event("free_requested", addr, size), _event("free_completed", addr, size)]


def _trace() -> list[dict]:
    return [
        _alloc(1, 100, "/site/megatron/core/x.py"),  # a warm-up step's leftover
        *_free(1, 100),
        _alloc(9, 500, "/site/megatron/core/optimizer/distrib_optimizer.py"),  # step 2's copies
        _alloc(2, 30, "/repo/nemo_rl_offload/models/a.py"),  # the recorded step from here (4)
        *_free(9, 500),  # zero_grad frees the copies
        _alloc(3, 40, GPT),  # the forward's first allocation (7)
        *_free(600, 20),  # allocated before the trace began
        _event("free_requested", 2, 30, time_us=1000),  # a copy still reads it
        _alloc(4, 60, "/site/megatron/core/y.py"),  # (11)
        _event("free_completed", 2, 30, time_us=3500),
        _alloc(5, 1000, "/site/torch/optim/adam.py"),  # the optimizer: not the fwd-bwd peak
    ]


def test_each_count_has_its_peak_from_the_forward_on_and_before_the_optimizer():
    trace = _trace()
    assert pc.first_forward(trace, begin=4) == 7
    # Net bytes against the trace's start: block 2 (30) is alive when the forward begins.
    allocated, at, alive = pc.live_at_peak(trace, 7, until="free_requested")
    assert allocated == 30 + 40 - 20 - 30 + 60 and trace[at]["addr"] == 4
    assert set(alive) == {3, 4}
    blocked, at_blocked, alive_blocked = pc.live_at_peak(trace, 7, until="free_completed")
    assert blocked == 30 + 40 - 20 + 60 and trace[at_blocked]["addr"] == 4
    assert set(alive_blocked) == {2, 3, 4}  # the pending free still holds its block
    # From the step's first event, the previous step's leftover copies would be the "peak".
    assert pc.live_at_peak(trace, 4, until="free_requested")[0] == 530


def test_the_summary_names_owners_alive_and_pending_at_each_peak():
    summary = pc.summarize(_trace(), allocated_at_trace_start=1000, begin=4)
    assert summary["forward_first_event"] == 7
    allocated, blocked = summary["allocated"], summary["blocked"]
    assert allocated["peak_gib"] * 2**30 == 1000 + 80
    assert allocated["pending"]["pending_blocks"] == 1  # the same moment: block 2's copy
    assert blocked["peak_gib"] * 2**30 == 1000 + 110
    pending = blocked["pending"]
    assert pending["pending_gib"] * 2**30 == 30 and pending["wait_ms_median"] == 2.5
    assert pending["pending_by_owner"][0]["owner"] == "nemo_rl_offload/models/a.py:7 forward"
    owners = {row["owner"] for row in blocked["live_at_peak"]}
    assert owners == {
        "megatron/core/models/gpt/gpt_model.py:7 forward",
        "nemo_rl_offload/models/a.py:7 forward",
        "megatron/core/y.py:7 forward",
    }


def test_an_allocation_without_own_frames_is_named_by_its_caller():
    assert pc.owner_of([]).startswith("(no Python frame")
    frames = [{"filename": "/site/torch/autograd/__init__.py", "line": 1, "name": "backward"}]
    assert pc.owner_of(frames) == "(no own frame) backward"


def test_a_pending_free_waits_once_though_its_address_is_used_again():
    trace = [
        _alloc(1, 10, GPT),
        _event("free_requested", 1, 10, time_us=0),
        _alloc(2, 5, GPT),  # the peak's moment (2)
        _event("free_completed", 1, 10, time_us=4000),
        _alloc(1, 10, GPT),  # the address again, freed again
        _event("free_requested", 1, 10, time_us=5000),
        _event("free_completed", 1, 10, time_us=9000),
    ]
    pending = pc.pending_at(trace, 2)
    assert pending["pending_blocks"] == 1
    assert pending["wait_ms_median"] == pending["wait_ms_max"] == 4.0
