"""benchmarks/offload_benchmark.py end to end on CPU with the tiny model: each case in its own
process, the table, the JSON and the floor bookkeeping (offloading itself needs a GPU; the
measured tables are in benchmarks/results)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ("--model", "tiny-dense", "--seq", "64", "--steps", "2", "--precision", "float32")


def _benchmark(*arguments: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """benchmarks/offload_benchmark.py with these arguments, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "offload_benchmark.py"), *arguments],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cases_run_side_by_side_and_write_their_records(tmp_path):
    done = _benchmark(
        *TINY, "--cases", "fgo_attn_pair,recompute_core_attn,save_on_cpu", "--out", str(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "tiny-dense_seq64.json").read_text())
    cases = [record["case"] for record in payload["cases"]]
    assert cases == ["no_offload", "fgo_attn_pair", "recompute_core_attn", "save_on_cpu"]
    for record in payload["cases"]:
        assert record["fwd_bwd_s"] > 0 and len(record["losses"]) == 2, record
        assert "time_change" in record
    assert payload["cases"][0]["forward_s_per_microbatch"] > 0
    # the same batches for every case: the first step's loss does not depend on the plan
    first = {round(record["losses"][0], 4) for record in payload["cases"]}
    assert len(first) == 1, first
    table = (tmp_path / "tiny-dense_seq64.md").read_text().splitlines()
    assert table[0].startswith("| case | peak GiB") and len(table) == 2 + len(cases)
    assert not list(tmp_path.glob(".case_*"))


def test_rounds_measure_every_case_in_that_many_processes(tmp_path):
    done = _benchmark(
        *TINY, "--cases", "recompute_core_attn", "--rounds", "2", "--out", str(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Each process prints its record as it finishes: round 2 runs the cases in reverse.
    printed = [json.loads(line)["case"] for line in done.stdout.splitlines() if line[:1] == "{"]
    assert printed == ["no_offload", "recompute_core_attn", "recompute_core_attn", "no_offload"]
    payload = json.loads((tmp_path / "tiny-dense_seq64.json").read_text())
    assert payload["rounds"] == 2
    for record in payload["cases"]:
        times = record["fwd_bwd_s_by_process"]
        assert len(times) == 2 and min(times) <= record["fwd_bwd_s"] <= max(times)
        assert len(record["steps_by_process"]) == 2 and "time_change" in record
    table = (tmp_path / "tiny-dense_seq64.md").read_text().splitlines()
    assert table[0].endswith("processes: spread |") and table[2].split("|")[-2].startswith(" 2: ")


def test_rounds_below_one_are_one_line():
    done = _benchmark("--rounds", "0", timeout=300)
    assert done.returncode == 2 and done.stderr.strip() == "--rounds: 0; give 1 or more"


def test_unknown_case_is_one_line():
    done = _benchmark("--cases", "fgo_al5", timeout=300)
    assert done.returncode == 2 and "--cases: unknown 'fgo_al5'" in done.stderr
