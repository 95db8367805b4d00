"""benchmarks/router_replay_cost.py on CPU with the tiny MoE preset: every pass is timed with
and without routes, recording the routes leaves the sampled tokens as they are, and the medians
leave out each pass's first repetition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from router_replay_cost import medians  # noqa: E402


def test_medians_leave_out_the_first_repetition():
    got = medians({"train": {"plain": [9.0, 1.0, 3.0], "replay": [5.0]}})
    assert got == {"train": {"plain": 2.0, "replay": 5.0}}


def test_the_benchmark_times_every_pass_with_and_without_routes(tmp_path):
    done = subprocess.run(
        [
            sys.executable, str(REPO / "benchmarks" / "router_replay_cost.py"),
            "--model", "tiny-moe", "--microbatches", "2", "--rows", "2", "--seq", "32",
            "--repetitions", "2", "--prompts", "3", "--prompt-len", "5", "--new-tokens", "4",
            "--port", "29611", "--out", str(tmp_path),
        ],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "router_replay_cost_own.json").read_text())
    assert result["same_tokens_with_recording"] is True
    assert set(result["seconds"]) == {"train", "logprobs", "generate"}
    assert all(
        len(v) == 2 for phase in ("train", "logprobs") for v in result["seconds"][phase].values()
    )
    assert set(result["median_s"]["generate"]) == {"plain", "record"}
