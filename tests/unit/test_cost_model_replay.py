"""The planner's cost model replayed against the long-context matrix measured on an H100
(benchmarks/results/2026-11-26_h100_long_context_3b_*.json, the 3B shape at 8k, 16k and 32k
tokens per micro-batch, measured with this tree's attention: values that own their memory):
calibrated as a plan run calibrates it (full recompute, the step without offloading where it
ran, then the first offload plan measured), it must predict every other measured plan's peak
within 5% and time within 10%, and put every plan that ran out of memory at what it needed when
it failed (allocated and asked), within the same 5%. Graphed cases are left out: the planner's
menu has none yet. The ledger is measured on the CPU here, as the planner measures it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.planning import planner
from nemo_rl_offload.planning.plan_menu import Candidate, predictor
from nemo_rl_offload.preflight import check_recipe

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "2026-11-26_h100_long_context_3b_{}.json"
PEAK_TOLERANCE, TIME_TOLERANCE = 0.05, 0.10


def candidate(settings: dict[str, Any]) -> Candidate:
    """The planner's candidate for a benchmark case's megatron_cfg settings."""
    modules = tuple(settings.get("offload_modules") or ())
    if not settings.get("fine_grained_activation_offloading"):
        modules = ()
    fraction = float(settings.get("activation_offload_fraction", 1.0))
    if not settings.get("activation_checkpointing"):
        return Candidate(modules, fraction, None)
    if settings.get("recompute_granularity") == "selective":
        return Candidate(
            modules, fraction, None, recompute_modules=tuple(settings["recompute_modules"])
        )
    block = settings.get("recompute_num_layers") if settings.get("recompute_method") else None
    return Candidate(modules, 1.0, None, full_recompute=True, recompute_num_layers=block)


def _costs(payload: dict[str, Any]) -> planner.RecipeCosts:
    seq = payload["seq"]
    overrides = [
        *payload["recipe_overrides"],
        f"policy.max_total_sequence_length={seq}",
        f"policy.make_sequence_length_divisible_by={seq}",
        f"policy.train_global_batch_size={payload['microbatches']}",
        "policy.train_micro_batch_size=1",
    ]
    report = check_recipe(load_recipe(str(ROOT / payload["recipe"]), overrides), base_dir=ROOT)
    assert not report.errors, report.errors
    return planner._layer_costs(report.recipe["policy"], ROOT, payload["microbatches"])


def _observe(calibrator: planner.Calibrator, record: dict[str, Any], seq: int) -> None:
    c = candidate(record["settings"])
    c.measured_peak_gib, c.measured_fwd_bwd_s = record["peak_gib"], record["fwd_bwd_s"]
    calibrator.observe(c, [{**step, "length": seq} for step in record["steps"]])


@pytest.mark.parametrize("name", ["seq8192", "seq16384", "seq32768"])
def test_the_cost_model_predicts_the_measured_matrix(name):
    payload = json.loads(Path(str(RESULTS).format(name)).read_text())
    seq, records = payload["seq"], payload["cases"]
    costs = _costs(payload)
    calibrator = planner.Calibrator(costs)
    by_name = {r["case"]: r for r in records}
    calibrator.recompute_s = by_name["recompute_full"]["fwd_bwd_s"]
    _observe(calibrator, by_name["recompute_full"], seq)
    if "peak_gib" in by_name["no_offload"]:
        calibrator.base_s = by_name["no_offload"]["fwd_bwd_s"]
        _observe(calibrator, by_name["no_offload"], seq)
    first = next(
        r
        for r in records
        if "peak_gib" in r
        and r["settings"].get("fine_grained_activation_offloading")
        and not candidate(r["settings"]).full_recompute
    )
    _observe(calibrator, first, seq)
    predict = predictor(costs.layers, calibrator.calibration())
    checked = fits = 0
    for record in records:
        if record["settings"].get("cuda_graph_impl"):
            continue  # the planner's menu has no graphed plans yet (README limitations)
        peak, seconds = predict(candidate(record["settings"]))
        checked += 1
        if "peak_gib" not in record:
            oom = record["failure"]["oom"]
            needed = oom["allocated_gib"] + oom["tried_gib"]
            assert peak >= needed * (1 - PEAK_TOLERANCE), (record["case"], peak, oom)
            continue
        assert abs(peak / record["peak_gib"] - 1) <= PEAK_TOLERANCE, (record["case"], peak)
        assert abs(seconds / record["fwd_bwd_s"] - 1) <= TIME_TOLERANCE, (record["case"], seconds)
        fits += 1
    # at least one fitting plan besides the two that calibrate (full recompute, the first
    # offload plan), among at least five plans predicted (fitting or out of memory)
    assert fits >= 3 and checked >= 5, (fits, checked)
