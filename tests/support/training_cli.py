"""Running the CLI's training commands on the tiny recipes from a test, and reading the metrics
file a run wrote (tests/functional/test_training_cpu.py and test_training_failures_cpu.py)."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "configs" / "tiny"


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "nemo_rl_offload.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def outputs(root: Path) -> list[str]:
    return [f"checkpointing.checkpoint_dir={root / 'ckpt'}", f"logger.log_dir={root / 'logs'}"]


def metrics(root: Path, phase: str) -> list[dict]:
    lines = (root / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


def window_mean(records: list[dict], key: str, first: bool, size: int = 10) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.mean(values[:size] if first else values[-size:])


def progress_phases(stderr: str, algorithm: str) -> set[str]:
    """The phases a run's progress lines named on stderr (nemo_rl_offload.progress: a phase's
    first line is ``[grpo step 3] generation: 64 rows ...``)."""
    pattern = rf"^\[{algorithm} step \d+\] ([a-z -]+?)(?::| \.\.\.)"
    return set(re.findall(pattern, stderr, re.MULTILINE))
