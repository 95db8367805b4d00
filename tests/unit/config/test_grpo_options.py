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
    (
        ["+grpo.use_dynamic_sampling=true", "grpo.num_generations_per_prompt=2"],
        "grpo.num_generations_per_prompt",
    ),
    (
        [
            "+grpo.use_dynamic_sampling=true",
            "grpo.num_generations_per_prompt=1",
            "grpo.use_leave_one_out_baseline=false",
        ],
        "grpo.num_generations_per_prompt",
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
    [
        "+grpo.use_dynamic_sampling=true",
        "grpo.num_generations_per_prompt=2",
        "grpo.use_leave_one_out_baseline=false",
    ],
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


def _lead(**sampler) -> int:
    return grpo_options.async_lead({"grpo": {}, "async_rl": {"sampler": sampler}})


@pytest.mark.parametrize("name", ["ready_first", "weight_fifo", "windowed"])
def test_a_staleness_samplers_lead_is_its_window(name):
    """Generation here never overlaps training, so these select what the in-order sampler with
    the same window does (tests/unit/algorithms/test_async_samplers.py checks the schedules)."""
    assert _lead(name=name) == 1  # NeMo-RL's default window
    assert _lead(name=name, max_staleness_versions=0) == 0
    assert _lead(name=name, max_staleness_versions=3) == 3
    # the in-order sampler's key is not theirs
    assert _lead(name=name, max_lookahead_versions=3) == 1


def test_the_windowed_sampler_taking_the_freshest_first_is_synchronous():
    assert _lead(name="windowed", sample_freshest_first=True, max_staleness_versions=3) == 0
    assert _lead(name="windowed", sample_freshest_first=False, max_staleness_versions=3) == 3
    # only the windowed sampler reads the switch
    assert _lead(name="weight_fifo", sample_freshest_first=True, max_staleness_versions=3) == 3


def test_a_custom_sampler_has_no_lead():
    with pytest.raises(ValueError, match="async_rl.sampler.name: 'custom'"):
        _lead(name="custom", target="module:Sampler")


READY_FIRST_LOSS = [
    "++loss_fn.use_importance_sampling_correction=true",
    "++loss_fn.force_on_policy_ratio=false",
]


@pytest.mark.parametrize(
    "sampler",
    [
        "{name: in_order, max_lookahead_versions: 0}",
        "{name: in_order, max_lookahead_versions: 2}",
        "{name: ready_first}",
        "{name: weight_fifo, max_staleness_versions: 2}",
        "{name: windowed, max_staleness_versions: 2}",
        "{name: windowed, sample_freshest_first: true}",
    ],
)
def test_the_single_controllers_samplers_pass(sampler):
    report = report_for(f"++async_rl={{sampler: {sampler}}}", *READY_FIRST_LOSS)
    assert report.errors == [] and report.warnings == []


def test_a_custom_sampler_is_one_line_naming_what_to_set():
    (error,) = report_for("++async_rl={sampler: {name: custom, target: 'pkg.mod:Sampler'}}").errors
    assert error.startswith("async_rl.sampler.name: 'custom' is not supported")
    assert error.endswith(
        "; set async_rl.sampler.name to in_order, ready_first, weight_fifo or windowed"
    )


@pytest.mark.parametrize(
    ("sampler", "key"),
    [
        ("{name: in_order, max_lookahead_versions: -1}", "max_lookahead_versions"),
        ("{name: ready_first, max_staleness_versions: -1}", "max_staleness_versions"),
        ("{name: weight_fifo, max_staleness_versions: -2}", "max_staleness_versions"),
        ("{name: windowed, max_staleness_versions: -1}", "max_staleness_versions"),
    ],
)
def test_a_negative_window_is_one_line(sampler, key):
    (error,) = report_for(f"++async_rl={{sampler: {sampler}}}", *READY_FIRST_LOSS).errors
    assert error.startswith(f"async_rl.sampler.{key}: -"), error
    assert "must be an integer >= 0" in error


@pytest.mark.parametrize("value", ["1.5", "true", "two"])
def test_a_window_that_is_not_an_integer_is_one_line(value):
    (error,) = report_for(
        f"++async_rl={{sampler: {{name: windowed, max_staleness_versions: {value}}}}}"
    ).errors
    assert error.startswith("async_rl.sampler.max_staleness_versions: "), error


def test_ready_first_needs_nemo_rls_loss_settings():
    ready_first = "++async_rl={sampler: {name: ready_first}}"
    (error,) = report_for(ready_first, "++loss_fn.force_on_policy_ratio=false").errors
    assert error.startswith("loss_fn.use_importance_sampling_correction: the ready_first")
    (error,) = report_for(
        ready_first,
        "++loss_fn.use_importance_sampling_correction=true",
        "++loss_fn.force_on_policy_ratio=true",
    ).errors
    assert error.startswith("loss_fn.force_on_policy_ratio: the ready_first")
    # the other samplers ask nothing of the loss
    assert report_for("++async_rl={sampler: {name: weight_fifo}}").errors == []


def test_streaming_below_a_step_warns_that_each_step_trains_on_all_its_groups():
    """Every group of a step is ready when it selects here, so min_groups_for_streaming_train
    changes nothing from one group to the step's; below one group NeMo-RL refuses it too."""
    report = report_for("++async_rl={min_groups_for_streaming_train: 1}")
    assert report.errors == []
    (warning,) = report.warnings
    assert warning.startswith("warning: async_rl.min_groups_for_streaming_train: ")
    assert "all grpo.num_prompts_per_step" in warning
    for whole_step in ("16", "32"):
        report = report_for(f"++async_rl={{min_groups_for_streaming_train: {whole_step}}}")
        assert report.errors == [] and report.warnings == []
    for none in ("0", "-1"):
        report = report_for(f"++async_rl={{min_groups_for_streaming_train: {none}}}")
        (error,) = report.errors
        assert error.startswith(f"async_rl.min_groups_for_streaming_train: {none} must be")
        assert report.warnings == []


def test_async_rl_and_async_grpo_together_are_one_line():
    (error,) = report_for(
        "++async_rl={}",
        "++grpo.async_grpo.enabled=true",
        "++loss_fn.use_importance_sampling_correction=true",
    ).errors
    assert error.startswith("async_rl: NeMo-RL's single-controller trainer")
