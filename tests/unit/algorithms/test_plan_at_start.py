"""``policy.megatron_cfg.offload_plan_budget_gib``: the job plans for the budget at start and
trains with the chosen settings. The planner's measurements need GPU workers; here its result
is given, and what the job does with it is checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl_offload import planner
from nemo_rl_offload.algorithms import common
from nemo_rl_offload.errors import UserInputError

RECIPE = str(
    Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_math_1B_megatron.yaml"
)
BUDGET = "+policy.megatron_cfg.offload_plan_budget_gib=20"
PROFILE = planner.Profile(23.0, 0.5, {"core_attn": 1.5}, resident_gib=13.0)


def _fake_plan(chosen, calls):
    def plan(config, overrides, *, budgets_gib, **_):
        calls.append((config, list(overrides), budgets_gib))
        entry = {"budget_gib": budgets_gib[0], "fitting": 1, "tried": [chosen], "chosen": chosen}
        if chosen is not None and chosen.measured_peak_gib > budgets_gib[0]:
            entry["chosen"] = None
        return {"profile": PROFILE, "plans": [entry], "measured_with": []}

    return plan


def test_the_chosen_offload_set_becomes_the_recipes_settings(monkeypatch, capsys):
    calls: list = []
    chosen = planner.Candidate(("core_attn", "attn_proj"), 1.0, 19.5, 19.4, 0.55)
    monkeypatch.setattr(planner, "plan", _fake_plan(chosen, calls))
    report = common._apply_plan(RECIPE, [BUDGET], 20.0)
    ((config, overrides, budgets),) = calls
    assert config == RECIPE and budgets == [20.0]
    assert overrides[-1] == "~policy.megatron_cfg.offload_plan_budget_gib"  # no recursion
    megatron = report.recipe["policy"]["megatron_cfg"]
    assert megatron["fine_grained_activation_offloading"] is True
    assert megatron["offload_modules"] == ["core_attn", "attn_proj"]
    assert "offload_plan_budget_gib" not in megatron
    assert report.errors == []
    assert "plan applied: core_attn+attn_proj" in capsys.readouterr().err


def test_full_recompute_can_be_the_plan(monkeypatch):
    chosen = planner.Candidate((), 1.0, 15.2, 15.2, 0.62, full_recompute=True)
    monkeypatch.setattr(planner, "plan", _fake_plan(chosen, []))
    megatron = common._apply_plan(RECIPE, [BUDGET], 16.0).recipe["policy"]["megatron_cfg"]
    assert megatron["activation_checkpointing"] is True
    assert megatron["recompute_granularity"] == "full"
    assert megatron["fine_grained_activation_offloading"] is False


def test_no_plan_stops_the_job_with_the_reason(monkeypatch):
    too_big = planner.Candidate((), 1.0, 15.2, 15.2, 0.62, full_recompute=True)
    monkeypatch.setattr(planner, "plan", _fake_plan(too_big, []))
    with pytest.raises(UserInputError) as raised:
        common._apply_plan(RECIPE, [BUDGET], 12.0)
    message = str(raised.value)
    assert message.startswith("policy.megatron_cfg.offload_plan_budget_gib: ")
    assert "alone hold 13.00 GiB" in message  # the budget is under the resident state


def test_planning_measures_the_reference_copy_the_job_holds():
    from nemo_rl_offload.models.policy_group import holds_reference

    with_kl = {"loss_fn": {"reference_policy_kl_penalty": 0.01}}
    assert holds_reference(with_kl, "grpo") and holds_reference({}, "dpo")
    assert not holds_reference({"loss_fn": {"reference_policy_kl_penalty": 0}}, "grpo")
    assert not holds_reference(with_kl, "sft")
