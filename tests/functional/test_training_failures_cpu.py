"""The CLI's training runs where something goes wrong or is kept: a dead worker, bad input, an
unreachable cluster, checkpoints kept by their metric. None needs test_training_cpu.py's shared
SFT run, so these run wherever pytest-xdist has a free process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.training_cli import REPO, TINY, cli, metrics, outputs


def test_keep_top_k_keeps_the_best_checkpoint_by_its_metric_and_the_newest(tmp_path):
    # higher_is_better on a loss keeps the worst-loss checkpoint: one the newest-k rule would
    # have deleted, so the test tells the two rules apart.
    result = cli(
        "sft",
        "--config",
        str(TINY / "sft.yaml"),
        *outputs(tmp_path),
        "sft.max_num_steps=6",
        "sft.val_period=2",
        "sft.val_at_start=false",
        "checkpointing.save_period=2",
        "checkpointing.keep_top_k=1",
        "checkpointing.metric_name=val:val_loss",
        "checkpointing.higher_is_better=true",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    val = {r["step"]: r["val_loss"] for r in metrics(tmp_path, "val")}
    assert sorted(val) == [2, 4, 6]
    best = max(val, key=val.get)
    assert best != 6, val
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == [f"step_{best:06d}", "step_000006"], (kept, val)
    state = json.loads((tmp_path / "ckpt" / f"step_{best:06d}" / "state.json").read_text())
    assert state["metrics"] == {"val:val_loss": val[best]}


def test_dead_worker_fails_the_job_within_a_minute(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nemo_rl_offload.cli",
            "sft",
            "--config",
            str(TINY / "sft.yaml"),
            *outputs(tmp_path),
            "sft.max_num_steps=100000",
            "sft.val_period=0",
            "sft.val_at_start=false",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stdout:  # wait until training runs
            if line.startswith("[train 3/"):
                break
        pids = subprocess.run(["pgrep", "-f", "PolicyWorker"], capture_output=True, text=True)
        # This job's workers only: a test running beside this one (pytest-xdist) has its own.
        victims = [pid for pid in map(int, pids.stdout.split()) if _descends_from(pid, process.pid)]
        assert victims, "no worker process found"
        killed_at = time.monotonic()
        os.kill(victims[-1], signal.SIGKILL)
        process.wait(timeout=60)
        assert time.monotonic() - killed_at < 60
        stderr = process.stderr.read()
        assert process.returncode != 0
        assert "policy worker" in stderr and "died" in stderr, stderr[-2000:]
    finally:
        if process.poll() is None:
            process.kill()


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is a child, grandchild, ... of ``ancestor`` (Ray's workers are
    children of the raylet that the job's driver started)."""
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's id
        if pid == ancestor:
            return True
    return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["data.dataset_name=jsonl", "++data.train_data_path=/nonexistent/train.jsonl"],
            "data.train_data_path",
        ),
        (["policy.model_name=tiny-dens"], "policy.model_name: 'tiny-dens' is neither"),
        (
            ["policy.max_total_sequence_length=12", "~data.max_input_seq_length"],
            "longer than policy.max_total_sequence_length",
        ),
        # The recipe's max_input_seq_length follows max_total_sequence_length: every example
        # reaches it, so all would be cut and none would train.
        (["policy.max_total_sequence_length=12"], "reaches 12 tokens, so none would train"),
    ],
    ids=["missing_data_file", "unknown_preset", "prompt_too_long", "every_example_cut"],
)
def test_bad_input_is_one_clear_line(tmp_path, overrides, expected):
    result = cli(
        "sft", "--config", str(TINY / "sft.yaml"), *outputs(tmp_path), *overrides, timeout=120
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_jsonl_line_is_named(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "Q: 1+1=? A:", "output": " 2"}\n{"input": "Q: 2+2=? A:",\n')
    result = cli(
        "sft",
        "--config",
        str(TINY / "sft.yaml"),
        *outputs(tmp_path),
        "data.dataset_name=jsonl",
        f"++data.train_data_path={data}",
        timeout=120,
    )
    assert result.returncode == 2
    assert f"{data}:2: not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_ray_address_fails_in_seconds(tmp_path):
    start = time.monotonic()
    result = cli(
        "sft",
        "--config",
        str(TINY / "sft.yaml"),
        *outputs(tmp_path),
        f"cluster.address=127.0.0.1:{_free_port()}",
        timeout=120,
    )
    assert result.returncode == 2
    assert "cluster.address: cannot reach a Ray cluster" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 60
