"""checkpointing.checkpoint_must_save_by: the format, NeMo-RL's rule (elapsed time plus the mean
step so far reaching the deadline), and the loop's save-and-stop in Run, on a fake clock. The
workers' part of a save is a stand-in that writes files (tests/unit/algorithms/
test_checkpoint_dirs.py); a real run stopped and resumed is tests/functional/test_resume_cpu.py.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from support.loop_runs import stand_in_run

from nemo_rl_offload.algorithms.common import Deadline, Run
from nemo_rl_offload.config.checkpointing import parse_deadline
from nemo_rl_offload.metrics_logger import MetricsLogger
from nemo_rl_offload.policy.checkpoint_dirs import STATE_FILE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class WritingPolicy:
    def __init__(self) -> None:
        self.saved: list[str] = []

    def save(self, directory: str) -> None:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "__0_0.distcp").write_bytes(b"weights")
        self.saved.append(Path(directory).parent.name)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:03:45:00", 3 * 3600 + 45 * 60), ("01:00:00:05", 86405), ("00:00:90:00", 5400)],
)
def test_deadline_strings_read_as_nemo_rl_reads_them(text, seconds):
    assert parse_deadline(text) == seconds


@pytest.mark.parametrize("text", ["3:45:00", "00:03:45", "1h", "00:03:-1:00", "00:0a:00:00", ""])
def test_malformed_deadline_strings_are_refused(text):
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        parse_deadline(text)


def test_the_deadline_is_due_when_another_mean_step_would_reach_it():
    clock = Clock()
    deadline = Deadline(100, clock=clock, started=clock.now - 10)  # 10 s of set-up
    deadline.start_steps()
    assert not deadline.due()
    clock.now += 20  # step 1: 20 s
    deadline.mark_step()
    clock.now += 40  # step 2: 40 s; elapsed 70, mean 30: 100 reaches it
    deadline.mark_step()
    assert deadline.expected_step == 30 and deadline.elapsed == 70
    assert deadline.due()
    assert not Deadline(None, clock=clock).due()
    assert not Deadline(101, clock=clock, started=clock.now - 70).due()  # no step yet: 70 < 101


def make_run(
    root: Path,
    clock: Clock,
    deadline_s: float | None,
    *,
    enabled: bool = True,
    save_period: int = 10,
) -> Run:
    checkpointing = {
        "enabled": enabled,
        "checkpoint_dir": str(root / "ckpt"),
        "save_period": save_period,
        "checkpoint_must_save_by": "00:00:01:40",
    }
    logger = MetricsLogger(root / "logs", total_steps=10, stream=io.StringIO())
    run = stand_in_run("sft", checkpointing=checkpointing, logger=logger, max_steps=10)
    run.deadline = Deadline(deadline_s, clock=clock, started=clock.now)
    return run


def loop(run: Run, clock: Clock, policy: WritingPolicy, step_s: float) -> list[int]:
    ran = []
    for step in run.steps():
        clock.now += step_s
        ran.append(step)
        run.end_step(step, policy, step * 32, val_period=0, validate=dict)
    run.finish(policy)
    return ran


def test_the_loop_saves_and_stops_before_a_step_would_pass_the_deadline(tmp_path, capsys):
    clock, policy = Clock(), WritingPolicy()
    run = make_run(tmp_path, clock, 100)
    assert loop(run, clock, policy, 35) == [1, 2]  # after 2 steps: 70 + 35 >= 100
    assert run.stopped_at == 2 and policy.saved == [".tmp_step_000002"]
    state = json.loads((tmp_path / "ckpt" / "step_000002" / STATE_FILE).read_text())
    assert state["position"] == 64
    err = capsys.readouterr().err
    assert "checkpointing.checkpoint_must_save_by: stopped after step 2 of 10" in err
    assert "run the same command again" in err


def test_without_a_deadline_or_far_from_it_the_loop_runs_to_the_end(tmp_path):
    for deadline_s in (None, 10_000):
        clock, policy = Clock(), WritingPolicy()
        run = make_run(tmp_path / str(deadline_s), clock, deadline_s)
        assert loop(run, clock, policy, 30) == list(range(1, 11))
        assert run.stopped_at is None and policy.saved == [".tmp_step_000010"]


def test_a_deadline_at_a_step_that_saves_anyway_saves_once(tmp_path):
    clock, policy = Clock(), WritingPolicy()
    run = make_run(tmp_path, clock, 100, save_period=2)
    assert loop(run, clock, policy, 35) == [1, 2]
    assert policy.saved == [".tmp_step_000002"]


def test_without_checkpointing_the_loop_stops_and_says_nothing_was_saved(tmp_path, capsys):
    clock, policy = Clock(), WritingPolicy()
    run = make_run(tmp_path, clock, 100, enabled=False)
    assert loop(run, clock, policy, 35) == [1, 2]
    assert policy.saved == []
    assert "no checkpoint (checkpointing.enabled is false)" in capsys.readouterr().err
