"""The benchmark's floor bookkeeping (benchmarks/offload_benchmark.py: add_floors) on records
made up for it: which baseline and which copy rate each case's floors use."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import offload_benchmark as bench  # noqa: E402

GIB = 2**30
FGO = {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]}
GRAPHS = {"cuda_graph_impl": "full_iteration"}


def _case(name, settings, seconds, gib, d2h=0.0, h2d=0.0, forward=None):
    record = {
        "case": name,
        "settings": settings,
        "peak_gib": 10.0,
        "fwd_bwd_s": seconds,
        "offloaded_gib_per_step": gib,
        "d2h_gb_per_s": d2h,
        "h2d_gb_per_s": h2d,
    }
    if forward is not None:
        record["forward_s_per_microbatch"] = forward
    return record


def test_eager_and_graphed_floors_start_from_their_own_baseline_and_rates():
    # 1 micro-batch: forward 0.1 s, backward 0.2 s without offloading (graphed: 0.05 / 0.1).
    records = [
        _case("no_offload", {}, 0.3, 0.0, forward=0.1),
        _case("no_offload_graph", GRAPHS, 0.15, 0.0),
        _case("fgo", FGO, 0.4, 10.0, d2h=50.0, h2d=100.0),
        _case("fgo_graph", {**FGO, **GRAPHS}, 0.25, 10.0, d2h=50.0, h2d=100.0),
    ]
    plain_rate = {"d2h_bytes_per_s": 100e9, "h2d_bytes_per_s": 100e9}
    bench.add_floors(records, plain_rate, mbs=1)
    eager, graphed = records[2], records[3]
    copy_s = 10 * GIB / 100e9  # 0.107 s each way at the plain rate
    assert eager["floor_time_change"] == pytest.approx((max(0, copy_s - 0.1)) / 0.3)
    # At its own rates (50 GB/s out, 100 back): 0.215 s out behind a 0.1 s forward.
    achieved = max(0, 10 * GIB / 50e9 - 0.1) + max(0, 10 * GIB / 100e9 - 0.2)
    assert eager["floor_achieved_time_change"] == pytest.approx(achieved / 0.3)
    # The graphed case: the graphed step's passes (0.05 / 0.1 s), its eager warm-up's rates.
    graph_floor = 0.15 + max(0, copy_s - 0.05) + max(0, copy_s - 0.1)
    assert graphed["floor_time_change"] == pytest.approx(graph_floor / 0.3 - 1)
    twin = 0.15 + max(0, 10 * GIB / 50e9 - 0.05) + max(0, 10 * GIB / 100e9 - 0.1)
    assert graphed["floor_achieved_time_change"] == pytest.approx(twin / 0.3 - 1)
    assert graphed["gap_to_floor_pp"] == pytest.approx(
        100 * (0.25 / 0.3 - 1 - graph_floor / 0.3 + 1)
    )
    # In points of each case's own mode's step: the graphed gap is twice as many points.
    assert graphed["gap_to_floor_own_step_pp"] == pytest.approx(100 * (0.25 - graph_floor) / 0.15)
    assert graphed["gap_to_achieved_floor_own_step_pp"] == pytest.approx(100 * (0.25 - twin) / 0.15)
    assert eager["gap_to_floor_own_step_pp"] == pytest.approx(eager["gap_to_floor_pp"])


def test_a_graphed_floor_takes_the_gpus_own_forward_time_when_measured():
    # The eager forward took 0.1 s of a 0.3 s step (CPU-bound); its kernels alone 0.04 s.
    base = _case("no_offload", {}, 0.3, 0.0, forward=0.1)
    base["forward_gpu_s_per_microbatch"] = 0.04
    records = [
        base,
        _case("no_offload_graph", GRAPHS, 0.15, 0.0),
        _case("fgo", FGO, 0.4, 10.0, d2h=50.0, h2d=100.0),
        _case("fgo_graph", {**FGO, **GRAPHS}, 0.25, 10.0),
    ]
    bench.add_floors(records, {"d2h_bytes_per_s": 100e9, "h2d_bytes_per_s": 100e9}, mbs=1)
    copy_s = 10 * GIB / 100e9
    assert records[2]["floor_time_change"] == pytest.approx(max(0, copy_s - 0.1) / 0.3)
    graph_floor = 0.15 + max(0, copy_s - 0.04) + max(0, copy_s - 0.11)
    assert records[3]["floor_time_change"] == pytest.approx(graph_floor / 0.3 - 1)


def test_offload_with_recompute_adds_what_the_recompute_alone_costs():
    recompute = {
        "activation_checkpointing": True,
        "recompute_granularity": "selective",
        "recompute_modules": ["core_attn"],
    }
    records = [
        _case("no_offload", {}, 0.3, 0.0, forward=0.1),
        _case("recompute", recompute, 0.33, 0.0),
        _case("fgo+recompute", {**FGO, **recompute}, 0.36, 1.0, d2h=50.0, h2d=50.0),
        _case("fgo_alone", FGO, 0.31, 1.0, d2h=50.0, h2d=50.0),
    ]
    bench.add_floors(records, {"d2h_bytes_per_s": 100e9, "h2d_bytes_per_s": 100e9}, mbs=1)
    # 1 GiB hides behind both passes: the copy floor is 0; the recompute adds 0.03 s.
    assert records[2]["floor_time_change"] == pytest.approx(0.03 / 0.3)
    assert records[2]["floor_achieved_time_change"] == pytest.approx(0.03 / 0.3)
    assert records[3]["floor_time_change"] == 0.0


def test_no_floor_without_bytes_or_a_measured_copy_rate():
    records = [_case("no_offload", {}, 0.3, 0.0, forward=0.1), _case("fgo", FGO, 0.4, 1.0)]
    bench.add_floors(records, {"d2h_bytes_per_s": 0.0, "h2d_bytes_per_s": 0.0}, mbs=1)
    assert "floor_time_change" not in records[1] and records[1]["time_change"] == pytest.approx(
        1 / 3
    )


def test_processes_combine_into_their_median_time_highest_peak_and_median_rates():
    runs = [
        {**_case("fgo", FGO, 0.30, 1.0, d2h=40.0, h2d=50.0), "steps": [1], "peak_gib": 10.0},
        {**_case("fgo", FGO, 0.40, 1.0, d2h=50.0, h2d=52.0), "steps": [2], "peak_gib": 10.2},
        {**_case("fgo", FGO, 0.33, 1.0, d2h=45.0, h2d=54.0), "steps": [3], "peak_gib": 10.1},
    ]
    merged = bench.combine_processes(runs)
    assert merged["fwd_bwd_s"] == 0.33 and merged["fwd_bwd_s_by_process"] == [0.30, 0.40, 0.33]
    assert merged["peak_gib"] == 10.2
    assert (merged["d2h_gb_per_s"], merged["h2d_gb_per_s"]) == (45.0, 52.0)
    assert merged["steps_by_process"] == [[1], [2], [3]] and "steps" not in merged
    assert bench.combine_processes(runs[:1]) is runs[0]  # one round: the record as it is


def test_a_failed_process_is_named_and_the_others_count():
    ok = _case("fgo", FGO, 0.30, 1.0)
    merged = bench.combine_processes([ok, {"case": "fgo", "failed": "CUDA error"}])
    assert merged["fwd_bwd_s"] == 0.30 and merged["failed_processes"] == ["CUDA error"]
    failed = {"case": "fgo", "failed": "boom"}
    assert bench.combine_processes([failed, dict(failed)]) is failed


def test_the_table_shows_processes_and_their_spread_only_with_rounds():
    base = _case("no_offload", {}, 0.25, 0.0)
    single = bench.table([base])
    assert "processes" not in single and single.splitlines()[1].count("|---") == 14
    merged = bench.combine_processes([_case("no_offload", {}, t, 0.0) for t in (0.2, 0.25, 0.3)])
    rounds = bench.table([merged]).splitlines()
    assert rounds[0].endswith("processes: spread |") and rounds[1].count("|---") == 15
    assert rounds[2].endswith("| 3: 40% |")


def test_retable_derives_the_floors_and_the_table_again_from_a_results_json(tmp_path, capsys):
    records = [
        _case("no_offload", {}, 0.3, 0.0, forward=0.1),
        _case("no_offload_graph", GRAPHS, 0.15, 0.0),
        _case("fgo_graph", {**FGO, **GRAPHS}, 0.25, 10.0, d2h=50.0, h2d=100.0),
    ]
    payload = {
        "microbatches": 1,
        "copy_bandwidth": {"d2h_bytes_per_s": 100e9, "h2d_bytes_per_s": 100e9},
        "cases": records,
    }
    path = tmp_path / "moe-1b_seq4096.json"
    path.write_text(json.dumps(payload))
    assert bench.retable(path) == 0
    again = json.loads(path.read_text())["cases"][2]
    assert "gap_to_floor_own_step_pp" in again and "floor_time_change" in again
    table = (tmp_path / "moe-1b_seq4096.md").read_text()
    assert table.splitlines()[0].startswith("| case |") and "| fgo_graph |" in table
    (tmp_path / "bad.json").write_text("{}")
    assert bench.retable(tmp_path / "bad.json") == 2
    assert "not a benchmark results JSON" in capsys.readouterr().err
