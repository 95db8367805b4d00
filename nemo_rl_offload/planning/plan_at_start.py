"""The check a training command runs before its algorithm starts, with plan-at-start.

``policy.megatron_cfg.offload_plan_budget_gib`` asks the job to plan for a peak-memory budget
before it trains: the planner profiles the recipe on its own workers and returns the fastest
fitting settings as a patch, which is merged onto the loaded recipe; the patched recipe is then
checked by the same rules as any recipe. This sits above the algorithms (it needs the planner,
which measures through the workers), so the algorithms receive a checked recipe and never plan.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.loader import deep_merge, load_recipe
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.planning import planner
from nemo_rl_offload.preflight import Report, check_recipe

BUDGET_KEY = "policy.megatron_cfg.offload_plan_budget_gib"


def _check(recipe: dict[str, Any], recipe_path: str) -> Report:
    report = check_recipe(recipe, base_dir=Path.cwd(), recipe_path=Path(recipe_path), starting=True)
    if report.errors:
        raise UserInputError(report.errors)
    return report


def checked(
    config_path: str,
    overrides: list[str],
    algorithm: str,
    *,
    plan: Callable[..., dict[str, Any]] = planner.plan,
) -> Report:
    """The recipe loaded and checked for a run of ``algorithm`` (every problem raised at once);
    with a budget, planned for it first and checked again with the plan's settings. ``plan``
    is the planner (a seam: its measurements need GPU workers)."""
    loaded = load_recipe(config_path, overrides)
    report = _check(loaded, config_path)
    if report.algorithm != algorithm:
        command = "distill" if report.algorithm == "distillation" else report.algorithm
        raise UserInputError(
            f"{config_path}: a recipe for {report.algorithm}, not {algorithm}; run "
            f"nemo-rl-offload {command} --config {config_path}"
        )
    budget = (report.recipe["policy"].get("megatron_cfg") or {}).get("offload_plan_budget_gib")
    if budget is None:
        return report
    budget = float(budget)
    print(f"plan: finding the fastest settings for {budget:g} GiB ...", file=sys.stderr)
    result = plan(config_path, [*overrides, f"~{BUDGET_KEY}"], budgets_gib=[budget])
    planner.format_plan(result, sys.stderr)
    (entry,) = result["plans"]
    chosen = entry["chosen"]
    if chosen is None:
        raise UserInputError(
            f"{BUDGET_KEY}: "
            + planner.why_none(
                result["profile"],
                budget,
                entry["tried"],
                entry.get("host_optimizer_offered", False),
            )
        )
    without_budget = deep_merge(loaded, {})
    (without_budget["policy"].get("megatron_cfg") or {}).pop("offload_plan_budget_gib", None)
    report = _check(deep_merge(without_budget, planner.plan_patch(result, chosen)), config_path)
    print(f"plan applied: {chosen.name}", file=sys.stderr)
    return report
