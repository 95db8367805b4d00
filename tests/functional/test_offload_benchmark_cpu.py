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


def test_cases_run_side_by_side_and_write_their_records(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "offload_benchmark.py"),
            "--model",
            "tiny-dense",
            "--seq",
            "64",
            "--steps",
            "2",
            "--precision",
            "float32",
            "--cases",
            "fgo_attn_pair,recompute_core_attn,save_on_cpu",
            "--out",
            str(tmp_path),
        ],  # fmt: skip
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
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


def test_unknown_case_is_one_line():
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "offload_benchmark.py"), "--cases", "fgo_al5"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "--cases: unknown 'fgo_al5'" in done.stderr
