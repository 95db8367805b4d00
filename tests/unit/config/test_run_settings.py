"""The run's own sections resolved once (config/run_settings.py): NeMo-RL's defaults where a
key is absent, the recipe's values where given, and check_recipe building them."""

from __future__ import annotations

import pytest

from nemo_rl_offload.config import run_settings
from nemo_rl_offload.config.checkpointing import parse_deadline


def recipe(algorithm: str, **section) -> dict:
    base = {"max_num_steps": 5, "seed": 3, "val_period": 2}
    if algorithm == "dpo":
        base["reference_policy_kl_penalty"] = 0.1
    return {
        algorithm: {**base, **section},
        "checkpointing": {"enabled": True, "checkpoint_dir": "ckpt"},
        "logger": {"log_dir": "logs"},
    }


@pytest.mark.parametrize("algorithm", ["sft", "dpo", "grpo", "distillation"])
def test_defaults_are_nemo_rls(algorithm):
    settings = run_settings.resolve(recipe(algorithm), algorithm)
    schedule = settings.schedule
    assert (schedule.max_steps, schedule.seed, schedule.val_period) == (5, 3, 2)
    assert schedule.max_epochs is None and not schedule.val_at_start and not schedule.val_at_end
    assert schedule.val_start_at == -1 and schedule.val_batches == 8
    assert schedule.val_global_batch_size == (8 if algorithm == "dpo" else 32)
    assert schedule.val_micro_batch_size is None
    ckpt = settings.checkpointing
    assert ckpt.enabled and ckpt.save_period == 0 and ckpt.keep_top_k is None
    assert ckpt.metric is None and ckpt.higher_is_better and ckpt.must_save_by_seconds is None
    assert settings.logger.tensorboard is False and settings.logger.monitor_gpus is False
    assert (settings.dpo is not None) == (algorithm == "dpo")


def test_given_values_are_read():
    raw = recipe(
        "dpo",
        max_num_epochs=2,
        val_at_start=True,
        val_at_end=True,
        val_batches=3,
        val_global_batch_size=4,
        val_micro_batch_size=2,
        sft_loss_weight=0.5,
        preference_average_log_probs=True,
    )
    raw["checkpointing"].update(
        save_period=4,
        keep_top_k=2,
        metric_name="val:validation-default_loss",
        higher_is_better=False,
        checkpoint_must_save_by="00:01:00:00",
    )
    raw["logger"].update(tensorboard_enabled=True, monitor_gpus=True, num_val_samples_to_print=3)
    settings = run_settings.resolve(raw, "dpo")
    assert settings.schedule.max_epochs == 2 and settings.schedule.val_examples == 12
    assert settings.schedule.val_micro_batch_size == 2
    ckpt = settings.checkpointing
    assert (ckpt.save_period, ckpt.keep_top_k, ckpt.higher_is_better) == (4, 2, False)
    assert ckpt.metric is not None and ckpt.metric.phase == "val"
    assert ckpt.must_save_by_seconds == parse_deadline("00:01:00:00") == 3600
    assert settings.logger.num_val_samples_to_print == 3 and settings.logger.monitor_gpus
    spec = settings.dpo.loss_spec()
    assert spec["beta"] == 0.1 and spec["sft_loss_weight"] == 0.5
    assert spec["preference_average_log_probs"] is True


def test_settings_are_frozen_and_picklable():
    import pickle

    settings = run_settings.resolve(recipe("sft"), "sft")
    assert pickle.loads(pickle.dumps(settings)) == settings
    with pytest.raises(AttributeError):
        settings.schedule.seed = 4  # type: ignore[misc]


def test_check_recipe_resolves_them_once_for_a_recipe_without_errors(tmp_path):
    from nemo_rl_offload.config.loader import load_recipe
    from nemo_rl_offload.preflight import check_recipe

    good = check_recipe(load_recipe("examples/configs/tiny/sft.yaml"), base_dir=tmp_path)
    assert good.ok and good.run is not None and good.run.algorithm == "sft"
    bad = load_recipe("examples/configs/tiny/sft.yaml")
    bad["sft"]["max_num_steps"] = "many"
    report = check_recipe(bad, base_dir=tmp_path)
    assert not report.ok and report.run is None


def test_cluster_settings_count_workers_as_the_groups_get_them():
    from nemo_rl_offload.config.cluster_settings import ClusterSettings, cluster_settings

    assert cluster_settings(None) == ClusterSettings()  # one CPU worker, embedded Ray
    cpu = cluster_settings({"gpus_per_node": 0, "num_cpu_workers": 3})
    assert (cpu.workers, cpu.on_gpu) == (3, False)
    gpus = cluster_settings({"gpus_per_node": 4, "num_nodes": 2, "num_cpu_workers": 3})
    assert (gpus.workers, gpus.on_gpu, gpus.address) == (8, True, None)
    assert cluster_settings({"address": "ray://head:10001"}).address == "ray://head:10001"
    assert cluster_settings({"address": ""}).address is None
