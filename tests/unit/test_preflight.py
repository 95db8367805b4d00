"""The whole pre-start check: schema, rules and Megatron's own checks reported together."""

from __future__ import annotations

import copy

import pytest

from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.preflight import check_recipe

pytest.importorskip("megatron.core")

FGO_RECIPE = "examples/configs/grpo_math_1B_megatron_fgo.yaml"


@pytest.fixture(scope="module")
def fgo_recipe():
    return load_recipe(FGO_RECIPE)


def test_valid_recipe_reports_resolved_settings(fgo_recipe):
    report = check_recipe(copy.deepcopy(fgo_recipe))
    assert report.ok, report.errors
    (policy,) = report.sections
    assert policy.offload["offload_modules"] == (
        ["core_attn", "attn_proj"],
        "policy.megatron_cfg.offload_modules",
    )
    assert policy.offload["fine_grained_activation_offloading"][0] is True


def test_a_moe_recipe_shows_its_token_dispatch_and_a_dense_one_does_not(fgo_recipe):
    graphed = check_recipe(load_recipe("examples/configs/grpo_moe_1B_megatron_fgo_graphs.yaml"))
    assert graphed.ok, graphed.errors
    shown = graphed.sections[0].offload
    assert shown["moe_token_dispatcher_type"] == ("alltoall", "policy.model_name")
    assert shown["moe_expert_capacity_factor"] == (
        1.0,
        "policy.megatron_cfg.model_overrides.moe_expert_capacity_factor",
    )
    assert shown["moe_pad_expert_input_to_capacity"][0] is True
    eager = check_recipe(load_recipe("examples/configs/grpo_moe_1B_megatron_fgo.yaml"))
    assert eager.sections[0].offload["moe_expert_capacity_factor"] == (
        None,
        "megatron-core default",
    )
    dense = check_recipe(copy.deepcopy(fgo_recipe)).sections[0].offload
    assert not any(key.startswith("moe_") for key in dense)


@pytest.mark.parametrize(
    ("fraction", "placement", "shown"),
    [
        (1.0, None, None),
        (0.5, None, ("spread", "default")),
        (
            0.5,
            "earliest",
            ("earliest", "policy.megatron_cfg.activation_offload_fraction_placement"),
        ),
    ],
)
def test_fraction_placement_is_shown_when_a_fraction_applies(
    fgo_recipe, fraction, placement, shown
):
    recipe = copy.deepcopy(fgo_recipe)
    megatron = recipe["policy"]["megatron_cfg"]
    megatron["activation_offload_fraction"] = fraction
    if placement:
        megatron["activation_offload_fraction_placement"] = placement
    report = check_recipe(recipe)
    assert report.ok, report.errors
    value = report.sections[0].offload.get("activation_offload_fraction_placement")
    if shown is None:
        assert value is None
    else:
        assert value[0] == shown[0] and value[1].startswith(shown[1])


def test_schema_and_rule_errors_come_together(fgo_recipe):
    recipe = copy.deepcopy(fgo_recipe)
    megatron = recipe["policy"]["megatron_cfg"]
    megatron["offload_modules"] = ["attn_proj"]
    megatron["fine_grained_activation_offload"] = True  # a typo: schema
    recipe["policy"]["train_micro_batch_size"] = "one"  # a type error: schema
    report = check_recipe(recipe)
    text = "\n".join(report.errors)
    assert "policy.megatron_cfg.fine_grained_activation_offload: unknown key" in text
    assert "policy.train_micro_batch_size: input should be a valid integer" in text
    assert "'attn_proj' needs 'core_attn'" in text


def test_megatron_crosscheck_catches_what_no_rule_covers(fgo_recipe):
    recipe = copy.deepcopy(fgo_recipe)
    # Top-1 routing without pre-softmax: not an offload rule, but Megatron rejects it.
    recipe["policy"]["megatron_cfg"]["model_overrides"] = {
        "num_moe_experts": 4,
        "moe_router_topk": 1,
    }
    report = check_recipe(recipe)
    assert len(report.errors) == 1
    assert report.errors[0].startswith("policy.megatron_cfg: megatron-core 0.19")
    assert "rejects these settings" in report.errors[0] and "pre-softmax" in report.errors[0]


def test_unknown_preset_names_the_key(fgo_recipe):
    recipe = copy.deepcopy(fgo_recipe)
    recipe["policy"]["model_name"] = "llama-1bb"
    report = check_recipe(recipe)
    assert any(
        line.startswith("policy.model_name: 'llama-1bb' is neither") and "llama-1b" in line
        for line in report.errors
    )


def test_trained_policy_needs_an_optimizer(fgo_recipe):
    recipe = copy.deepcopy(fgo_recipe)
    del recipe["policy"]["megatron_cfg"]["optimizer"]
    report = check_recipe(recipe)
    assert any(line.startswith("policy.megatron_cfg.optimizer: required") for line in report.errors)


def test_no_algorithm_section():
    report = check_recipe({"policy": {}})
    assert not report.ok
    assert report.errors[0].startswith("recipe: no algorithm section")


def test_worker_environment_adds_required_variables_and_logs(fgo_recipe, caplog):
    from support.policies import TE_2_10

    recipe = copy.deepcopy(fgo_recipe)
    recipe["policy"]["megatron_cfg"]["env_vars"] = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"
    }
    report = check_recipe(recipe, caps=TE_2_10, megatron_crosscheck=False)
    assert report.ok, report.errors
    with caplog.at_level("INFO", logger="nemo_rl_offload.preflight"):
        env = report.worker_environment("policy")
    assert env == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "NVTE_CPU_OFFLOAD_V1": "1",
    }
    assert "NVTE_CPU_OFFLOAD_V1=1" in caplog.text
    plain = check_recipe(copy.deepcopy(fgo_recipe), megatron_crosscheck=False)
    assert plain.worker_environment("policy") == {}


TP4_DIFFERS = [
    "policy.logprob_batch_size=64",
    "++policy.megatron_cfg.tensor_model_parallel_size=4",
]


def _tp4_report(*overrides: str, starting: bool = True):
    recipe = load_recipe("examples/configs/tiny/grpo.yaml", [*TP4_DIFFERS, *overrides])
    return check_recipe(recipe, megatron_crosscheck=False, starting=starting)


def test_tp4_batch_variance_is_refused_without_nemo_rls_switch_naming_four_ways_out(monkeypatch):
    monkeypatch.delenv("NRL_IGNORE_TP_ACCURACY_CHECK", raising=False)
    report = _tp4_report()
    (error,) = [e for e in report.errors if "logprob_batch_size" in e]
    assert error.startswith("policy.logprob_batch_size: 64 differs from train_micro_batch_size")
    assert "NeMo-RL refuses this too" in error
    for way_out in (
        "set them equal",
        "tensor_model_parallel_size below 4",
        "loss_fn.force_on_policy_ratio: true",
        "NRL_IGNORE_TP_ACCURACY_CHECK=1",
    ):
        assert way_out in error
    assert not [w for w in report.warnings if "logprob_batch_size" in w]


def test_validate_without_the_switch_warns_that_a_run_will_refuse(monkeypatch):
    """The switch is the launch environment's: validate on another machine cannot know it, so
    it warns (naming what a run does and the ways out) where a starting run refuses."""
    monkeypatch.delenv("NRL_IGNORE_TP_ACCURACY_CHECK", raising=False)
    report = _tp4_report(starting=False)
    assert not [e for e in report.errors if "logprob_batch_size" in e]
    (warning,) = [w for w in report.warnings if "logprob_batch_size" in w]
    assert "a run refuses it unless NRL_IGNORE_TP_ACCURACY_CHECK is set" in warning
    assert "set them equal" in warning


@pytest.mark.parametrize("value", ["1", "yes"])
def test_tp4_batch_variance_warns_with_nemo_rls_switch(monkeypatch, value):
    """Read from the environment when the recipe is checked, as NeMo-RL reads it: any
    non-empty value; an empty one refuses as unset does."""
    monkeypatch.setenv("NRL_IGNORE_TP_ACCURACY_CHECK", value)
    report = _tp4_report()
    assert not [e for e in report.errors if "logprob_batch_size" in e]
    (warning,) = [w for w in report.warnings if "logprob_batch_size" in w]
    assert warning.startswith("warning: policy.logprob_batch_size: 64 differs")
    assert "NRL_IGNORE_TP_ACCURACY_CHECK is set" in warning
    assert "importance ratios" in warning
    monkeypatch.setenv("NRL_IGNORE_TP_ACCURACY_CHECK", "")
    assert [e for e in _tp4_report().errors if "logprob_batch_size" in e]


def test_a_forced_on_policy_ratio_needs_neither_the_switch_nor_a_warning(monkeypatch):
    """NeMo-RL's GRPO sets the switch itself under force_on_policy_ratio: the ratio is 1 and the
    old log-probabilities are not computed, so nothing is at risk."""
    monkeypatch.delenv("NRL_IGNORE_TP_ACCURACY_CHECK", raising=False)
    report = _tp4_report("++loss_fn.force_on_policy_ratio=true")
    assert not [line for line in report.errors + report.warnings if "logprob_batch_size" in line]
