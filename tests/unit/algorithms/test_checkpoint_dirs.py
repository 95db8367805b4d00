"""The driver's side of checkpoints: a stop in the middle of a save leaves the previous
checkpoint the one that resume picks, leftovers are removed at the next start, and a resumed
run's metrics file loses the records of the steps it runs again.

The workers' part of a save is played by a stand-in that writes files (and, for the crash,
raises halfway); the real workers' save is covered by tests/functional/test_resume_cpu.py.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from support.loop_runs import stand_in_run
from support.tiny_checkpoints import write_policy

from nemo_rl_offload.algorithms.common import Run
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.metrics_logger import MetricsLogger, read_metrics
from nemo_rl_offload.policy.checkpoint_dirs import (
    STATE_FILE,
    checkpoint_dirs,
    checkpoint_problem,
    remove_incomplete,
    resolve_checkpoint,
)


class WritingPolicy:
    """Writes a policy directory as the workers do (data files, then its description)."""

    def save(self, directory: str) -> None:
        write_policy(directory)


class CrashingPolicy(WritingPolicy):
    """Stops after writing one rank's data: what a killed worker leaves."""

    def save(self, directory: str) -> None:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "__0_0.distcp").write_bytes(b"half")
        raise RuntimeError("policy worker 1 failed: the worker process died")


def make_run(root: Path, keep: int | None = 1) -> Run:
    return stand_in_run("sft", checkpointing={"checkpoint_dir": str(root), "keep_top_k": keep})


def test_a_stop_mid_save_leaves_the_previous_checkpoint_the_latest(tmp_path):
    run = make_run(tmp_path)
    run.save(WritingPolicy(), 3, {"position": 96})
    with pytest.raises(RuntimeError, match="died"):
        run.save(CrashingPolicy(), 6, {"position": 192})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_step_000006", "step_000003"]
    assert checkpoint_dirs(tmp_path) == [tmp_path / "step_000003"]
    latest = resolve_checkpoint(str(tmp_path), "policy.init_checkpoint")
    assert json.loads((latest / STATE_FILE).read_text()) == {
        "step": 3,
        "position": 96,
        "metrics": {},
    }

    assert remove_incomplete(tmp_path) == [tmp_path / ".tmp_step_000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"]


def test_the_next_save_replaces_leftovers_and_keeps_the_newest(tmp_path):
    run = make_run(tmp_path)
    run.save(WritingPolicy(), 3, {"position": 96})
    with pytest.raises(RuntimeError):
        run.save(CrashingPolicy(), 6, {"position": 192})
    run.save(WritingPolicy(), 6, {"position": 192})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006"]
    assert (tmp_path / "step_000006" / "policy" / "__0_0.distcp").read_bytes() != b"half"
    assert checkpoint_problem(tmp_path / "step_000006") is None  # the complete one


def test_a_checkpoint_dir_without_complete_checkpoints_is_one_line(tmp_path):
    (tmp_path / ".tmp_step_000003" / "policy").mkdir(parents=True)
    (tmp_path / "step_000002").mkdir()  # no state.json: not complete
    with pytest.raises(UserInputError) as caught:
        resolve_checkpoint(str(tmp_path), "policy.init_checkpoint")
    assert caught.value.problems == [
        f"policy.init_checkpoint: no complete checkpoint under {tmp_path} (each is damaged or "
        "partial, see the warnings above); move them away to start afresh, or restore one"
    ]
    (tmp_path / "step_000002").rmdir()
    with pytest.raises(UserInputError) as caught:
        resolve_checkpoint(str(tmp_path), "policy.init_checkpoint")
    assert caught.value.problems[0].startswith(
        f"policy.init_checkpoint: no checkpoint at '{tmp_path}'"
    )


def test_a_resumed_run_drops_the_metrics_of_the_steps_it_runs_again(tmp_path):
    first = MetricsLogger(tmp_path, total_steps=6, stream=io.StringIO())
    for step in range(1, 6):
        first.log(step, {"loss": float(step)})
    first.log(4, {"val_loss": 0.5}, phase="val")
    first.close()
    again = MetricsLogger(tmp_path, total_steps=6, stream=io.StringIO(), resume_step=3)
    again.log(4, {"loss": 40.0})
    again.close()
    assert [(r["step"], r["phase"], r.get("loss")) for r in read_metrics(tmp_path)] == [
        (1, "train", 1.0),
        (2, "train", 2.0),
        (3, "train", 3.0),
        (4, "train", 40.0),
    ]
