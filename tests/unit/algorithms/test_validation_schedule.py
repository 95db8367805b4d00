"""When validation runs (val_period, grpo.val_start_at, every algorithm's val_at_end) and the
early stop on a validation metric (grpo.stop_at_validation_metric / threshold), through
Run.end_step, the one owner of the schedule for all four algorithms. The workers' part of a save
is a stand-in that writes files."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from support.loop_runs import stand_in_run

from nemo_rl_offload.algorithms import grpo
from nemo_rl_offload.algorithms.common import Run, validation_due
from nemo_rl_offload.config import grpo_options
from nemo_rl_offload.metrics_logger import MetricsLogger


class WritingPolicy:
    def __init__(self) -> None:
        self.saved: list[str] = []

    def save(self, directory: str) -> None:
        Path(directory).mkdir(parents=True)
        self.saved.append(Path(directory).parent.name)


def make_run(root: Path, algorithm: str, section: dict, *, max_steps: int = 10) -> Run:
    logger = MetricsLogger(root / "logs", total_steps=max_steps, stream=io.StringIO())
    return stand_in_run(
        algorithm,
        checkpointing={"checkpoint_dir": str(root / "ckpt")},
        section=section,
        logger=logger,
        max_steps=max_steps,
    )


def validated_steps(
    run: Run,
    *,
    val_period: int,
    data_done_at: int | None = None,
    metrics=None,
    stop_when=None,
) -> list[int]:
    """Run the loop's bookkeeping and return the steps after which validation ran."""
    seen: list[int] = []
    policy = WritingPolicy()
    for step in run.steps():

        def validate(step: int = step) -> dict:
            seen.append(step)
            return metrics(step) if metrics else {}

        run.end_step(
            step,
            policy,
            step,
            val_period=val_period,
            validate=validate,
            data_done=step == data_done_at,
            stop_when=stop_when,
        )
        if step == data_done_at:
            break
    run.finish(policy)
    return seen


def test_the_rule_periodic_from_val_start_at_and_once_more_at_the_end():
    due = [
        s
        for s in range(1, 11)
        if validation_due(s, val_period=3, val_start_at=-1, val_at_end=False, last=s == 10)
    ]
    assert due == [3, 6, 9]
    due = [
        s
        for s in range(1, 11)
        if validation_due(s, val_period=3, val_start_at=5, val_at_end=True, last=s == 10)
    ]
    assert due == [6, 9, 10]
    assert validation_due(7, val_period=0, val_start_at=-1, val_at_end=True, last=True)
    assert not validation_due(7, val_period=0, val_start_at=-1, val_at_end=False, last=True)


@pytest.mark.parametrize("algorithm", ["sft", "dpo", "grpo", "distillation"])
def test_val_at_end_validates_after_the_last_step_of_every_algorithm(tmp_path, algorithm):
    plain = make_run(tmp_path / "plain", algorithm, {})
    assert validated_steps(plain, val_period=4) == [4, 8]
    at_end = make_run(tmp_path / "end", algorithm, {"val_at_end": True})
    assert validated_steps(at_end, val_period=4) == [4, 8, 10]


def test_val_at_end_also_validates_when_the_data_epochs_end_the_run(tmp_path):
    run = make_run(tmp_path, "sft", {"val_at_end": True})
    assert validated_steps(run, val_period=0, data_done_at=6) == [6]
    assert validated_steps(make_run(tmp_path / "b", "sft", {}), val_period=0, data_done_at=6) == []


def test_val_start_at_delays_periodic_validation(tmp_path):
    run = make_run(tmp_path, "grpo", {"val_start_at": 5})
    assert validated_steps(run, val_period=2) == [6, 8, 10]


def test_the_run_saves_and_stops_once_the_validation_metric_reaches_the_threshold(tmp_path, capsys):
    run = make_run(tmp_path, "grpo", {})
    stop_when = grpo.stop_rule(
        {"stop_at_validation_metric": "accuracy", "stop_at_validation_threshold": 0.5}
    )
    seen = validated_steps(
        run, val_period=2, metrics=lambda step: {"val_reward": step / 10}, stop_when=stop_when
    )
    assert seen == [2, 4, 6] and run.stopped_at == 6  # 0.6 >= 0.5; 0.4 was not
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000006"]
    assert "val_reward 0.6000 reached grpo.stop_at_validation_threshold 0.5" in (
        capsys.readouterr().err
    )
    no_rule = make_run(tmp_path / "b", "grpo", {})
    assert validated_steps(no_rule, val_period=2, metrics=lambda step: {"val_reward": 1.0}) == [
        2,
        4,
        6,
        8,
        10,
    ]


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("accuracy", "val_reward"),
        ("val:accuracy", "val_reward"),
        ("pass_k", "val_pass_k"),
        ("val_reward_greedy", "val_reward_greedy"),
    ],
)
def test_stop_metric_names_resolve_nemo_rl_names_to_ours(name, key):
    assert grpo_options.resolve_stop_metric(name) == key


def test_the_stop_compares_at_or_above_the_threshold():
    assert grpo_options.stop_message({"val_reward": 0.5}, "val_reward", 0.5) is not None
    assert grpo_options.stop_message({"val_reward": 0.49}, "val_reward", 0.5) is None
    assert grpo_options.stop_message({}, "val_reward", 0.5) is None  # validation had no data
