"""``policy.megatron_cfg.offload_plan_budget_gib``: the job plans for the budget at start and
trains with the chosen settings. The planner's measurements need GPU workers; here its result
is given, and what the job does with it is checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.planning import plan_at_start, planner

RECIPE = str(
    Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_math_1B_megatron.yaml"
)
PROFILE = planner.Profile(23.0, 0.5, {"core_attn": 1.5}, resident_gib=13.0)


def _fake_plan(chosen, calls):
    def plan(config, overrides, *, budgets_gib, **_):
        calls.append((config, list(overrides), budgets_gib))
        entry = {"budget_gib": budgets_gib[0], "fitting": 1, "tried": [chosen], "chosen": chosen}
        if chosen is not None and chosen.measured_peak_gib > budgets_gib[0]:
            entry["chosen"] = None
        return {"profile": PROFILE, "plans": [entry], "measured_with": {}}

    return plan


def _checked(budget_gib, plan):
    return plan_at_start.checked(
        RECIPE, [f"+policy.megatron_cfg.offload_plan_budget_gib={budget_gib}"], "grpo", plan=plan
    )


def test_the_chosen_offload_set_becomes_the_recipes_settings(capsys):
    calls: list = []
    chosen = planner.Candidate(("core_attn", "attn_proj"), 1.0, 19.5, 19.4, 0.55)
    report = _checked(20, _fake_plan(chosen, calls))
    ((config, overrides, budgets),) = calls
    assert config == RECIPE and budgets == [20.0]
    assert overrides[-1] == "~policy.megatron_cfg.offload_plan_budget_gib"  # no recursion
    megatron = report.recipe["policy"]["megatron_cfg"]
    assert megatron["fine_grained_activation_offloading"] is True
    assert megatron["offload_modules"] == ["core_attn", "attn_proj"]
    assert "offload_plan_budget_gib" not in megatron
    assert report.errors == []
    assert "plan applied: core_attn+attn_proj" in capsys.readouterr().err


def test_full_recompute_can_be_the_plan():
    chosen = planner.Candidate((), 1.0, 15.2, 15.2, 0.62, full_recompute=True)
    megatron = _checked(16, _fake_plan(chosen, [])).recipe["policy"]["megatron_cfg"]
    assert megatron["activation_checkpointing"] is True
    assert megatron["recompute_granularity"] == "full"
    assert megatron["fine_grained_activation_offloading"] is False


def test_no_plan_stops_the_job_with_the_reason():
    too_big = planner.Candidate((), 1.0, 15.2, 15.2, 0.62, full_recompute=True)
    with pytest.raises(UserInputError) as raised:
        _checked(12, _fake_plan(too_big, []))
    message = str(raised.value)
    assert message.startswith("policy.megatron_cfg.offload_plan_budget_gib: ")
    assert "alone hold 13.00 GiB" in message  # the budget is under the resident state


def test_without_a_budget_nothing_is_planned_and_the_algorithm_must_match():
    def plan(*_, **__):
        raise AssertionError("no budget: the planner must not run")

    report = plan_at_start.checked(RECIPE, [], "grpo", plan=plan)
    assert "offload_plan_budget_gib" not in report.recipe["policy"]["megatron_cfg"]
    with pytest.raises(
        UserInputError, match="a recipe for grpo, not sft; run nemo-rl-offload grpo"
    ):
        plan_at_start.checked(RECIPE, [], "sft", plan=plan)


def test_planning_measures_the_reference_copy_the_job_holds():
    from nemo_rl_offload.policy.policy_group import holds_reference

    with_kl = {"loss_fn": {"reference_policy_kl_penalty": 0.01}}
    assert holds_reference(with_kl, "grpo") and holds_reference({}, "dpo")
    assert not holds_reference({"loss_fn": {"reference_policy_kl_penalty": 0}}, "grpo")
    assert not holds_reference(with_kl, "sft")


def test_a_host_optimizer_plan_is_applied_with_the_settings_the_rules_require():
    """A plan with the optimizer state on the host sets the hybrid optimizer's keys on the
    loaded recipe; the patched recipe passes the rules (distributed, precision-aware Adam)."""
    chosen = planner.Candidate((), 1.0, 15.2, 15.2, 0.62, full_recompute=True, host_optimizer=0.5)
    report = _checked(16, _fake_plan(chosen, []))
    optimizer = report.recipe["policy"]["megatron_cfg"]["optimizer"]
    assert optimizer["optimizer_cpu_offload"] is True
    assert optimizer["optimizer_offload_fraction"] == 0.5
    assert optimizer["use_precision_aware_optimizer"] is True
    assert report.errors == []
