"""``nemo-rl-offload telemetry`` end to end on CPU workers (the recipe's own cluster section):
the table, the JSON records and the comparison; bad arguments are one line and exit 2.

Offloading itself runs only on GPU workers; tests/unit/offload/test_runtime_gpu.py checks the
offload columns on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_SFT = REPO / "examples" / "configs" / "tiny" / "sft.yaml"


def telemetry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_rl_offload.cli",
            "telemetry",
            "--config",
            str(TINY_SFT),
            *args,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_table_records_and_comparison(tmp_path):
    target = tmp_path / "out" / "telemetry.json"
    done = telemetry("--steps", "3", "--lengths", "32,64", "--baseline", "--json", str(target))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"telemetry: {TINY_SFT}") and "offload off" in lines[0]
    header = lines[1].split()
    assert header[:3] == ["step", "run", "length"]
    rows = [line.split() for line in lines[2:] if line.split() and line.split()[0].isdigit()]
    # three offload-run steps then three baseline steps; lengths cycle 32, 64, 32
    assert [row[0] for row in rows] == ["1", "2", "3", "1", "2", "3"]
    assert [row[-10] for row in rows[:3]] == ["32", "64", "32"]
    assert any("CPU workers" in line and "no offload telemetry" in line for line in lines)
    assert any(line.startswith("train time: no offload") for line in lines)
    records = json.loads(target.read_text())["records"]
    # the tiny recipe has offloading off: its run is named for the recipe
    assert [(r["run"], r["length"]) for r in records[:3]] == [
        ("recipe", 32),
        ("recipe", 64),
        ("recipe", 32),
    ]
    assert all(r["num_tokens"] > 0 and r["train_time_s"] > 0 for r in records)
    environment = json.loads(target.read_text())["environment"]
    assert environment["megatron-core"].startswith("0.") and environment["torch"]
    assert not Path(str(target) + ".tmp").exists()


def test_bad_arguments_are_one_line():
    done = telemetry("--lengths", "32,100000")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("--lengths: [100000] outside 2..64")
    assert "Traceback" not in done.stderr
    done = telemetry("--steps", "0")
    assert done.returncode == 2 and "--steps: must be >= 1" in done.stderr
