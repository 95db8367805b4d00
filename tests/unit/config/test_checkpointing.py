"""checkpointing.metric_name and keep_top_k, with NeMo-RL's meaning."""

from __future__ import annotations

import pytest

from nemo_rl_offload.config.checkpointing import Metric, record, resolve_metric, steps_to_delete
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.preflight import check_recipe

LOSS = Metric("val", "val_loss")


@pytest.mark.parametrize(
    "name,algorithm,expected",
    [
        ("val_loss", "sft", LOSS),
        ("val:val_loss", "sft", LOSS),
        ("train:loss", "sft", Metric("train", "loss")),
        ("loss", "sft", Metric("train", "loss")),  # no validation metric of that name
        ("val:accuracy", "grpo", Metric("val", "val_reward")),  # NeMo-RL's name
        ("accuracy", "distillation", Metric("val", "val_reward")),
        ("val_preference_accuracy", "dpo", Metric("val", "val_preference_accuracy")),
        # NeMo-RL's NeMo-Gym rollouts log total_reward/mean in both phases.
        ("val:total_reward/mean", "grpo", Metric("val", "val_reward")),
        ("train:total_reward/mean", "grpo", Metric("train", "reward")),
        ("total_reward/mean", "grpo", Metric("val", "val_reward")),
    ],
)
def test_metric_names_resolve(name, algorithm, expected):
    assert resolve_metric(name, algorithm) == expected


@pytest.mark.parametrize(
    "name,algorithm,says",
    [
        (
            "val_reward",
            "sft",
            "sft does not produce a metric 'val_reward'; use one of val:val_loss",
        ),
        ("val:accuracy", "sft", "use one of"),
        ("test:val_loss", "sft", "starts with 'test:'"),
        ("train:val_loss", "sft", "does not produce"),
        ("val:total_reward/mean", "sft", "does not produce"),
        ("val:total_reward/max", "grpo", "does not produce"),
    ],
)
def test_unknown_metric_names_are_refused_with_the_choices(name, algorithm, says):
    with pytest.raises(ValueError, match=says):
        resolve_metric(name, algorithm)


def test_a_checkpoint_records_only_what_its_step_logged():
    logged = {"train": {"loss": 1.5}, "val": {"val_loss": 0.7}}
    assert record(LOSS, logged) == {"val:val_loss": 0.7}
    assert record(LOSS, {"train": {"loss": 1.5}}) == {}
    assert record(None, logged) == {}


def _history(*pairs):
    return [(step, {} if value is None else {"val:val_loss": value}) for step, value in pairs]


def test_keep_top_k_keeps_the_best_by_the_metric_and_the_newest():
    history = _history((2, 0.9), (4, 0.5), (6, 0.7), (8, 0.8))
    lower = steps_to_delete(history, keep_top_k=1, metric=LOSS, higher_is_better=False)
    assert lower == [2, 6]  # best (4) and newest (8) stay
    higher = steps_to_delete(history, keep_top_k=1, metric=LOSS, higher_is_better=True)
    assert higher == [4, 6]  # best (2) and newest (8) stay
    assert steps_to_delete(history, keep_top_k=2, metric=LOSS, higher_is_better=False) == [2]


def test_without_a_metric_keep_top_k_keeps_the_newest():
    history = _history((2, 0.1), (4, 0.5), (6, 0.9))
    assert steps_to_delete(history, keep_top_k=1, metric=None, higher_is_better=False) == [2, 4]
    assert steps_to_delete(history, keep_top_k=None, metric=LOSS, higher_is_better=False) == []


def test_checkpoints_without_the_metric_rank_last_and_ties_go_to_the_newer():
    history = _history((2, None), (4, 0.5), (6, 0.5), (8, None))
    assert steps_to_delete(history, keep_top_k=1, metric=LOSS, higher_is_better=False) == [2, 4]
    assert steps_to_delete(history, keep_top_k=1, metric=LOSS, higher_is_better=True) == [2, 4]


def _sft(**checkpointing):
    recipe = load_recipe("examples/configs/tiny/sft.yaml")
    recipe["checkpointing"].update(checkpointing)
    return recipe


def test_validate_refuses_a_metric_the_algorithm_never_logs():
    report = check_recipe(_sft(metric_name="val_reward"), megatron_crosscheck=False)
    assert any(
        line.startswith("checkpointing.metric_name: sft does not produce a metric 'val_reward'")
        for line in report.errors
    ), report.errors
    assert check_recipe(_sft(metric_name="val:val_loss"), megatron_crosscheck=False).ok


def test_validate_warns_when_saves_fall_between_validations():
    recipe = _sft(metric_name="val_loss", keep_top_k=2, save_period=300)  # val_period 250
    warnings = check_recipe(recipe, megatron_crosscheck=False).warnings
    assert any(w.startswith("warning: checkpointing.save_period: 300") for w in warnings)
    aligned = _sft(metric_name="val_loss", keep_top_k=2, save_period=500)
    assert not any(
        "save_period" in w for w in check_recipe(aligned, megatron_crosscheck=False).warnings
    )
