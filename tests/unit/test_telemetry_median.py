"""telemetry.replayed_median: the steady steps only (what the planner and telemetry report)."""

from __future__ import annotations

from nemo_rl_offload.telemetry import replayed_median


def test_each_lengths_first_step_records_a_plan_and_is_left_out():
    records = [
        {"length": 1024, "t": 9.0},
        {"length": 1024, "t": 1.0},
        {"length": 2048, "t": 8.0},
        {"length": 1024, "t": 3.0},
        {"length": 2048, "t": 2.0},
    ]
    assert replayed_median(records, "t") == 2.0


def test_graph_warmup_and_capture_steps_are_left_out():
    def step(t, replayed, captured):
        return {
            "length": 512,
            "t": t,
            "cuda_graph_replayed": replayed,
            "cuda_graph_captured": captured,
        }

    records = [step(9.0, 0.0, 0.0), step(5.0, 0.0, 0.0), step(7.0, 1.0, 1.0), step(1.0, 1.0, 0.0)]
    assert replayed_median(records, "t") == 1.0


def test_all_steps_when_none_is_steady_and_none_without_the_key():
    assert replayed_median([{"length": 8, "t": 4.0}], "t") == 4.0
    assert replayed_median([{"length": 8}], "t") is None
