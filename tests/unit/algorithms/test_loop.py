"""The one loop driver (algorithms/loop.py): what every algorithm's run shares, driven with a
step body that trains nothing. The workers' part of a save is a stand-in that writes files."""

from __future__ import annotations

import io
import json
from pathlib import Path

from nemo_rl_offload.algorithms import loop
from nemo_rl_offload.algorithms.common import EpochSampler, Run
from nemo_rl_offload.config import run_settings
from nemo_rl_offload.config.run_settings import ScheduleSettings
from nemo_rl_offload.metrics_logger import MetricsLogger, read_metrics
from nemo_rl_offload.policy.checkpoint_dirs import checkpoint_dirs
from nemo_rl_offload.preflight import Report


class StandInGroup:
    def __init__(self) -> None:
        self.saved: list[str] = []
        self.shut_down = False

    def save(self, directory: str) -> None:
        Path(directory).mkdir(parents=True)
        self.saved.append(Path(directory).parent.name)

    def shutdown(self) -> None:
        self.shut_down = True


def make_run(root: Path, section: dict, *, max_steps: int) -> Run:
    recipe = {
        "grpo": {"max_num_steps": max_steps, "seed": 0, "val_period": 0, **section},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(root / "ckpt")},
        "logger": {"log_dir": str(root / "logs")},
    }
    report = Report("grpo", recipe, None, run=run_settings.resolve(recipe, "grpo"))
    logger = MetricsLogger(root / "logs", total_steps=max_steps, stream=io.StringIO())
    return Run("grpo", recipe, report, None, logger, None, max_steps=max_steps)


def schedule(run: Run, section: dict) -> ScheduleSettings:
    """The run's schedule with ``section``'s keys over it."""
    recipe = {**run.recipe, "grpo": {**run.recipe["grpo"], **section}}
    return run_settings.resolve(recipe, "grpo").schedule


def body(
    run: Run, group: StandInGroup, section: dict, *, stop_at: float | None = None
) -> loop.Steps:
    """Two examples a step out of four; validation reports the step it ran after; ``section``
    schedules the loop."""
    run.groups.append(group)
    sampler = EpochSampler(4, seed=0, shuffle=False)

    def train_step(step: int) -> loop.TrainResult:
        sampler.take(2)
        metrics = {"loss": 2.0 * step, "num_tokens": 2.0, "grad_norm": 1.0}
        return loop.TrainResult(metrics, elapsed=0.5, tokens=10, values={"epoch": sampler.epoch})

    return loop.Steps(
        group,
        sampler,
        train_step,
        validate=lambda step: {"val_reward": float(step)},
        schedule=schedule(run, section),
        stop_when=None
        if stop_at is None
        else (lambda m: "stop" if m["val_reward"] >= stop_at else None),
    )


def test_the_data_epochs_end_the_run_with_a_validated_saved_last_step(tmp_path):
    run = make_run(tmp_path, {"val_at_end": True}, max_steps=10)
    group = StandInGroup()
    assert loop.drive(run, lambda r: body(r, group, {"val_period": 0, "max_num_epochs": 1})) == 0
    train = read_metrics(tmp_path / "logs", "train")
    assert [r["step"] for r in train] == [1, 2]  # 4 examples, 2 a step, one epoch
    assert train[1]["loss"] == 2.0 and train[1]["tokens_per_s"] == 20.0
    assert [(r["step"], r["val_reward"]) for r in read_metrics(tmp_path / "logs", "val")] == [
        (2, 2.0)
    ]
    assert len(group.saved) == 1 and group.shut_down
    assert [p.name for p in checkpoint_dirs(tmp_path / "ckpt")] == ["step_000002"]
    state = json.loads((tmp_path / "ckpt" / "step_000002" / "state.json").read_text())
    assert state["position"] == 4


def test_validation_at_start_can_stop_the_run_before_any_step(tmp_path):
    run = make_run(tmp_path, {}, max_steps=10)
    group = StandInGroup()
    steps = loop.drive(
        run, lambda r: body(r, group, {"val_period": 1, "val_at_start": True}, stop_at=0)
    )
    assert steps == 0 and read_metrics(tmp_path / "logs", "train") == []
    assert [r["step"] for r in read_metrics(tmp_path / "logs", "val")] == [0]
    assert group.saved == [] and group.shut_down


def test_without_an_epoch_limit_the_steps_run_out_and_a_validation_can_stop_them(tmp_path):
    run = make_run(tmp_path, {}, max_steps=10)
    group = StandInGroup()
    assert loop.drive(run, lambda r: body(r, group, {"val_period": 2}, stop_at=4)) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "logs", "train")] == [1, 2, 3, 4]
    # the stop saves
    assert [p.name for p in checkpoint_dirs(tmp_path / "ckpt")] == ["step_000004"]
