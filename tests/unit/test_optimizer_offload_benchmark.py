"""benchmarks/optimizer_offload.py's pure parts: the cases the rules accept, a case's row from
its steps, and the comparison against the baseline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent / "benchmarks"))

import optimizer_offload as oo  # noqa: E402


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_every_case_is_one_the_rules_accept(fraction):
    section = oo.case_section("llama-1b", 4096, fraction)
    optimizer = section["megatron_cfg"]["optimizer"]
    assert optimizer.get("optimizer_cpu_offload", False) == (fraction > 0)
    assert oo.bench.check_section(section) == []


def _step(step: float, fwd_bwd: float, peak: float, held: float, loss: float) -> dict:
    return {
        "step_time_s": step,
        "fwd_bwd_time_s": fwd_bwd,
        "peak_gpu_memory_gib": peak,
        "gpu_memory_gib": held,
        "loss": loss * 10,
        "num_tokens": 10,
    }


def test_rows_leave_the_first_step_out_of_the_times_and_compare_with_the_baseline():
    base = oo.summarize(0.0, [_step(9.0, 1.0, 30, 20, 2.0)] + [_step(1.5, 1.0, 30, 20, 1.9)] * 3)
    moved = oo.summarize(1.0, [_step(9.0, 1.0, 25, 8, 2.0)] + [_step(3.0, 1.0, 26, 8, 1.9)] * 3)
    assert base["optimizer_time_s"] == pytest.approx(0.5)
    assert moved["peak_gpu_memory_gib"] == 26 and moved["losses"][0] == pytest.approx(2.0)
    rows = oo.compare([base, moved, {"fraction": 0.5, "failed": "out of memory"}])
    assert rows[1]["step_time_x"] == pytest.approx(2.0)
    assert rows[1]["optimizer_time_x"] == pytest.approx(4.0)
    assert rows[1]["between_steps_saved_gib"] == 12 and rows[1]["peak_saved_gib"] == 4
    assert rows[1]["max_loss_rel_diff"] == 0.0
    assert rows[2] == {"fraction": 0.5, "failed": "out of memory"}
