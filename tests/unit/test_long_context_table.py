"""benchmarks/long_context_table.py: the long-context matrix's summary rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "long_context_table", ROOT / "benchmarks/long_context_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(name: str, seconds: float, activations: float, step_peak: float) -> dict:
    steps = [
        {
            "peak_activation_gpu_memory_gib": activations,
            "peak_gpu_memory_gib": step_peak,
        }
    ] * 3
    return {"case": name, "peak_gib": 40 + activations, "fwd_bwd_s": seconds, "steps": steps}


PAYLOAD = {
    "recipe": str(ROOT / "examples/configs/grpo_math_1B_megatron.yaml"),
    "recipe_overrides": ["++policy.megatron_cfg.model_overrides.num_layers=2"],
    "model": "llama-1b",
    "seq": 4096,
    "microbatches": 2,
    "rows": 1,
    "environment": {"gpus": ["NVIDIA H100 80GB HBM3"]},
    "cases": [
        _case("no_offload", 0.5, 20.0, 60.0),
        _case("recompute_full", 1.0, 2.0, 55.0),
        _case("fgo:core_attn__rc:layernorm+mlp_act", 0.8, 5.0, 55.0),
        {"case": "fgo_all5", "failed": "out of memory: tried to allocate 1.00 GiB"},
    ],
}


def test_rows_give_throughput_mfu_removed_share_and_speed_against_full_recompute():
    module = _module()
    flops = module.step_flops(PAYLOAD)
    rows = module.rows(PAYLOAD, peak_flops=1e15)
    plain, recompute, plan, failed = rows
    assert plan["tokens_per_s"] == pytest.approx(2 * 4096 / 0.8)
    assert plan["mfu"] == pytest.approx(flops / 0.8 / 1e15)
    assert plan["removed"] == pytest.approx(1 - 5.0 / 20.0)
    assert plan["vs_recompute"] == pytest.approx(1.0 / 0.8)
    assert plan["step_peak_gib"] == 55.0 and plain["removed"] == 0.0
    assert recompute["vs_recompute"] == 1.0
    assert failed["failed"].startswith("out of memory")
    text = module.markdown(rows)
    assert "| 4096 | fgo:core_attn__rc:layernorm+mlp_act | 45.00 | 55.00 | 5.00 | 75% |" in text
    assert "| 4096 | fgo_all5 | out of memory" in text


def test_the_model_flops_grow_with_the_layers_of_the_recipe():
    module = _module()
    deeper = {**PAYLOAD, "recipe_overrides": ["++policy.megatron_cfg.model_overrides.num_layers=4"]}
    assert module.step_flops(deeper) > module.step_flops(PAYLOAD)


def test_a_results_file_without_its_recipe_is_one_line(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({k: v for k, v in PAYLOAD.items() if k != "recipe"}))
    assert _module().main([str(path)]) == 2
    assert "names no recipe" in capsys.readouterr().err
