"""The recipe rules of GRPO's reward, sampling and validation options: each bad value is one
line naming the key and the fix, reported by ``validate`` (the tiny GRPO recipe with
overrides), and the values NeMo-RL's recipes use pass."""

from __future__ import annotations

import pytest

from nemo_rl_offload.config import grpo_options
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.preflight import check_recipe

pytest.importorskip("megatron.core")


def report_for(*overrides: str):
    recipe = load_recipe("examples/configs/tiny/grpo.yaml", list(overrides))
    return check_recipe(recipe, megatron_crosscheck=False)


BAD = [
    (["+grpo.advantage_clip_low=2.0", "+grpo.advantage_clip_high=1.0"], "grpo.advantage_clip_low"),
    (
        ["+grpo.reward_scaling={enabled: true, source_min: 1.0, source_max: 1.0}"],
        "grpo.reward_scaling.source_max",
    ),
    (["+grpo.reward_shaping={enabled: true, overlong_buffer_length: 8}"], "grpo.reward_shaping"),
    (
        ["+grpo.reward_shaping={enabled: true, stop_properly_penalty_coef: 1.5}"],
        "grpo.reward_shaping.stop_properly_penalty_coef",
    ),
    (
        [
            "+grpo.reward_shaping={enabled: true, overlong_buffer_length: 0, "
            "overlong_buffer_penalty: 1.0, max_response_length: 64}"
        ],
        "grpo.reward_shaping.overlong_buffer_length",
    ),
    (["+grpo.batch_multiplier=2"], "grpo.batch_multiplier"),
    (
        ["+grpo.use_dynamic_sampling=true", "+grpo.dynamic_sampling_max_gen_batches=0"],
        "grpo.dynamic_sampling_max_gen_batches",
    ),
    (["grpo.val_num_generations_per_prompt=0"], "grpo.val_num_generations_per_prompt"),
    (["+grpo.stop_at_validation_metric=loss"], "grpo.stop_at_validation_metric"),
    (["+grpo.stop_at_validation_metric=no_such_metric"], "grpo.stop_at_validation_metric"),
    (["+grpo.stop_at_validation_metric=accuracy"], "grpo.stop_at_validation_threshold"),
    (
        [
            "+grpo.stop_at_validation_metric=pass_k",
            "+grpo.stop_at_validation_threshold=0.9",
            "grpo.val_num_generations_per_prompt=1",
        ],
        "grpo.stop_at_validation_metric",
    ),
    (
        [
            "+grpo.stop_at_validation_metric=accuracy",
            "+grpo.stop_at_validation_threshold=0.9",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
        ],
        "grpo.stop_at_validation_metric",
    ),
]


@pytest.mark.parametrize(("overrides", "key"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_key(overrides, key):
    report = report_for(*overrides)
    assert len(report.errors) == 1, report.errors
    assert report.errors[0].startswith(f"{key}: "), report.errors
    assert "; " in report.errors[0]  # the fix follows


GOOD = [
    ["+grpo.advantage_clip_low=-5.0", "+grpo.advantage_clip_high=5.0"],
    ["+grpo.reward_scaling={enabled: true, target_min: -1.0}"],
    # NeMo-RL's DAPO recipe: max_response_length from the sequence length
    [
        "+grpo.reward_shaping={enabled: true, overlong_buffer_length: 128, "
        "overlong_buffer_penalty: 1, max_response_length: 512}"
    ],
    ["+grpo.reward_shaping={enabled: true, stop_properly_penalty_coef: 0.0}"],
    ["+grpo.use_dynamic_sampling=true", "+grpo.batch_multiplier=3"],
    ["+grpo.overlong_filtering=true"],
    ["+grpo.val_at_end=true", "+grpo.val_start_at=5"],
    [
        "+grpo.stop_at_validation_metric=pass_k",
        "+grpo.stop_at_validation_threshold=0.9",
        "grpo.val_num_generations_per_prompt=4",
    ],
    ["+sft.val_at_end=true"],
]


@pytest.mark.parametrize("overrides", GOOD, ids=[" ".join(o) for o in GOOD])
def test_nemo_rl_values_of_the_options_pass(overrides):
    algorithm = overrides[0].lstrip("+").split(".")[0]
    recipe = load_recipe(f"examples/configs/tiny/{algorithm}.yaml", overrides)
    report = check_recipe(recipe, megatron_crosscheck=False)
    assert report.errors == [] and report.warnings == []


def test_the_checks_leave_wrongly_typed_values_to_the_schema():
    assert (
        grpo_options.check({"batch_multiplier": "2", "val_num_generations_per_prompt": "x"}) == []
    )


def test_top_k_and_top_p_are_said_to_stay_out_of_the_ratios():
    def lines(report) -> list[str]:
        return [w for w in report.warnings if w.startswith("warning: policy.generation.top_")]

    assert lines(report_for()) == []
    assert (
        lines(report_for("++policy.generation.top_k=null", "++policy.generation.top_p=1.0")) == []
    )
    warned = lines(report_for("++policy.generation.top_k=20", "++policy.generation.top_p=0.9"))
    assert [w.split(":")[1].strip() for w in warned] == [
        "policy.generation.top_k",
        "policy.generation.top_p",
    ]


def test_async_grpo_needs_importance_sampling_and_an_age_of_one_or_more():
    """grpo.async_grpo (algorithms/async_rollouts.py): NeMo-RL's condition on the loss, its age
    as an integer >= 1, and the generation-engine switches said to have nothing to act on
    (config/ignored_keys.py's lines)."""
    on = ["++grpo.async_grpo.enabled=true"]
    corrected = ["++loss_fn.use_importance_sampling_correction=true"]
    assert report_for("++grpo.async_grpo.enabled=false").errors == []
    (error,) = report_for(*on).errors
    assert error.startswith("grpo.async_grpo.enabled: ") and "use_importance_sampling" in error
    report = report_for(*on, *corrected, "++grpo.async_grpo.max_trajectory_age_steps=2")
    assert report.errors == [] and report.warnings == []
    (error,) = report_for(*on, *corrected, "++grpo.async_grpo.max_trajectory_age_steps=0").errors
    assert error.startswith("grpo.async_grpo.max_trajectory_age_steps: 0 must be")
    warned = report_for(
        *on,
        *corrected,
        "++grpo.async_grpo.in_flight_weight_updates=true",
        "++grpo.async_grpo.recompute_kv_cache_after_weight_updates=true",
        "++grpo.async_grpo.max_generation_failures=3",
    ).warnings
    assert sorted(w.split(":")[1].strip() for w in warned) == [
        "grpo.async_grpo.in_flight_weight_updates",
        "grpo.async_grpo.max_generation_failures",
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates",
    ]


def test_the_lead_comes_from_async_grpo_or_the_single_controllers_in_order_sampler():
    assert grpo_options.async_lead({"grpo": {}}) == 0
    assert grpo_options.async_lead({"grpo": {"async_grpo": {"enabled": False}}}) == 0
    assert grpo_options.async_lead({"grpo": {"async_grpo": {"enabled": True}}}) == 1
    legacy = {"enabled": True, "max_trajectory_age_steps": 3}
    assert grpo_options.async_lead({"grpo": {"async_grpo": legacy}}) == 3
    assert grpo_options.async_lead({"grpo": {}, "async_rl": None}) == 0
    assert grpo_options.async_lead({"grpo": {}, "async_rl": {}}) == 1  # NeMo-RL's default
    in_order = {"sampler": {"name": "in_order", "max_lookahead_versions": 0}}
    assert grpo_options.async_lead({"grpo": {}, "async_rl": in_order}) == 0


def test_the_single_controllers_in_order_sampler_passes_and_the_others_are_refused():
    sync = ["++async_rl={sampler: {name: in_order, max_lookahead_versions: 0}}"]
    assert report_for(*sync).errors == []
    ahead = ["++async_rl={sampler: {name: in_order, max_lookahead_versions: 2}}"]
    assert report_for(*ahead).errors == []
    (error,) = report_for("++async_rl={sampler: {name: windowed}}").errors
    assert error.startswith("async_rl.sampler.name: 'windowed' is not supported")
    (error,) = report_for(
        "++async_rl={sampler: {name: in_order, max_lookahead_versions: -1}}"
    ).errors
    assert error.startswith("async_rl.sampler.max_lookahead_versions: -1 must be")
    (error,) = report_for("++async_rl={min_groups_for_streaming_train: 1}").errors
    assert error.startswith("async_rl.min_groups_for_streaming_train: 1 is not supported")
    (error,) = report_for(
        "++async_rl={}",
        "++grpo.async_grpo.enabled=true",
        "++loss_fn.use_importance_sampling_correction=true",
    ).errors
    assert error.startswith("async_rl: NeMo-RL's single-controller trainer")
