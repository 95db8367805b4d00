"""The planner's prediction and choice, checked against the measured H100 benchmark tables
(benchmarks/results) and on synthetic profiles; its GPU runs go through the telemetry command,
tested apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl_offload import planner
from nemo_rl_offload.errors import UserInputError

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
TABLES = sorted(RESULTS.glob("*_benchmark_*.json"))


def _profile_from_table(table: dict) -> planner.Profile:
    """The planner's profile from a benchmark table: the no-offload case, and each module's
    bytes per micro-batch as the full-offload cases measured them."""
    cases = {c["case"]: c for c in table["cases"] if "peak_gib" in c}
    per_module: dict[str, float] = {}
    for case in cases.values():
        if case["settings"].get("activation_offload_fraction", 1.0) != 1.0:
            continue
        for key, value in case["steps"][1].items():
            if key.startswith("offloaded_gib_") and key != "offloaded_gib_per_step":
                module = key.removeprefix("offloaded_gib_")
                per_module.setdefault(module, value / table["microbatches"])
    return planner.Profile(
        cases["no_offload"]["peak_gib"], cases["no_offload"]["fwd_bwd_s"], per_module
    )


@pytest.mark.parametrize("path", TABLES, ids=[p.stem for p in TABLES])
def test_predicted_peaks_match_every_measured_offload_case(path):
    table = json.loads(path.read_text())
    profile = _profile_from_table(table)
    checked = 0
    for case in table["cases"]:
        settings = case.get("settings", {})
        modules = settings.get("offload_modules")
        if "peak_gib" not in case or not modules or settings.get("recompute_granularity"):
            continue
        fraction = settings.get("activation_offload_fraction", 1.0)
        predicted = planner.predict_peak(profile, tuple(modules), fraction)
        assert abs(predicted - case["peak_gib"]) <= 0.02 * case["peak_gib"], case["case"]
        checked += 1
    assert checked >= 6


def test_module_sets_respect_the_attn_proj_rule():
    sets = planner.module_sets(planner.DENSE_MODULES)
    assert all("core_attn" in s for s in sets if "attn_proj" in s)
    assert ("attn_proj",) not in sets and ("core_attn", "attn_proj") in sets
    assert len(planner.module_sets(planner.offloadable_modules(True))) > len(sets)


PROFILE = planner.Profile(
    peak_gib=20.0,
    fwd_bwd_s=1.0,
    bytes_per_microbatch_gib={
        "attn_norm": 0.25,
        "qkv_linear": 0.25,
        "core_attn": 0.75,
        "attn_proj": 0.25,
        "mlp_norm": 0.25,
    },
)


def test_candidates_fit_with_margin_and_rank_by_modules_then_bytes():
    ranked = planner.candidates_within(PROFILE, 19.8, is_moe=False)
    assert ranked, "core_attn alone saves 0.75 GiB"
    assert all(c.predicted_peak_gib <= 19.8 * (1 - planner.SAFETY_MARGIN) for c in ranked)
    assert ranked[0].modules == ("core_attn",) and ranked[0].fraction == 1.0
    counts = [len(c.modules) for c in ranked]
    assert counts == sorted(counts)
    assert planner.candidates_within(PROFILE, 18.0, is_moe=False) == []  # 1.75 GiB at most


def test_trials_take_one_candidate_per_module_count():
    ranked = planner.candidates_within(PROFILE, 19.8, is_moe=False)
    chosen = planner.trials(ranked, 3)
    assert [len(c.modules) for c in chosen] == [1, 2, 3]


def test_best_is_the_fastest_measured_within_the_budget():
    a = planner.Candidate(("core_attn",), 1.0, 19.0, measured_peak_gib=19.4, measured_fwd_bwd_s=1.3)
    b = planner.Candidate(("attn_norm", "core_attn"), 1.0, 18.8, 18.9, 1.2)
    c = planner.Candidate(("mlp_norm",), 1.0, 19.0, measured_peak_gib=19.8, measured_fwd_bwd_s=1.1)
    assert planner.best([a, b, c], 19.5) is b  # c is faster but its measured peak is over
    assert planner.best([c], 19.5) is None


def test_override_lines_are_recipe_overrides():
    candidate = planner.Candidate(("core_attn", "attn_proj"), 0.5, 0.0)
    assert candidate.overrides() == [
        "policy.megatron_cfg.fine_grained_activation_offloading=true",
        "'policy.megatron_cfg.offload_modules=[core_attn,attn_proj]'",
        "policy.megatron_cfg.activation_offload_fraction=0.5",
    ]


def test_cpu_recipes_and_bad_budgets_are_one_line():
    tiny = str(RESULTS.parents[1] / "examples" / "configs" / "tiny" / "sft.yaml")
    with pytest.raises(UserInputError, match="needs GPU workers"):
        planner.plan(tiny, [], budget_gib=10)
    with pytest.raises(UserInputError, match="--budget-gib: must be > 0"):
        planner.plan(tiny, [], budget_gib=0)
