"""benchmarks/rl_step.py's arithmetic on CPU: each stage's floor from the job's metrics and the
floors measured beside it, the steady step against the first."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RL_STEP = runpy.run_path(str(REPO / "benchmarks" / "rl_step.py"))

FLOORS = {
    "hbm_bytes_per_s": 4e12,
    "matmul_flops_per_s": 800e12,
    "weight_bytes": 2e9,
    "kv_bytes_per_position": 65536.0,
}


def _row(step: int, step_s: float) -> dict:
    return {
        "step": step,
        "step_time_s": step_s,
        "timing/train/generation": 4.0,
        "timing/train/policy_and_reference_logprobs": 1.0,
        "timing/train/policy_training": 2.0,
        "generation_decode_steps": 1000.0,
        "generation_attended_positions": 1e7,
        "generation_new_tokens_per_sec_per_gpu": 5000.0,
        "train_flops_per_gpu": 200.0,  # TFLOP/s over the training stage
        "train_fp_utilization": 0.2,
        "policy_training_tokens_per_sec_per_gpu": 10000.0,
        "policy_and_reference_logprobs_tokens_per_sec_per_gpu": 20000.0,
        "logprob_passes": 2.0,
    }


def test_each_stage_is_set_against_its_floor() -> None:
    report = RL_STEP["stage_report"](_row(2, 8.0), FLOORS, gpus=1)
    generation = report["stages"]["generation"]
    # 1000 steps x 2 GB of weights + 1e7 positions x 64 KiB, at 4 TB/s
    assert generation["floor_s"] == pytest.approx((1000 * 2e9 + 1e7 * 65536) / 4e12)
    training = report["stages"]["policy_training"]
    flops = 200e12 * 2.0
    assert training["floor_s"] == pytest.approx(flops / 800e12)
    logprobs = report["stages"]["policy_and_reference_logprobs"]
    assert logprobs["floor_s"] == pytest.approx(2 * flops / 3 / 800e12)
    # two passes at 20k tokens/s each run at 4x training's 10k tokens/s per pass
    assert logprobs["pass_tokens_per_s_vs_training"] == pytest.approx(4.0)
    assert report["stages"]["other"]["seconds"] == pytest.approx(1.0)


def test_two_gpus_share_the_rows_keys_and_values_not_the_weights() -> None:
    one = RL_STEP["stage_report"](_row(2, 8.0), FLOORS, gpus=1)["stages"]["generation"]
    two = RL_STEP["stage_report"](_row(2, 8.0), FLOORS, gpus=2)["stages"]["generation"]
    assert two["floor_s"] == pytest.approx((1000 * 2e9 + 0.5e7 * 65536) / 4e12)
    assert two["floor_s"] < one["floor_s"]


def test_the_first_step_is_reported_against_the_steady_median() -> None:
    steps = [RL_STEP["stage_report"](_row(i, s), FLOORS, 1) for i, s in enumerate([20, 8, 9, 7], 1)]
    summary = RL_STEP["summary"](steps)
    assert summary["steady_step_s"] == 8 and summary["first_over_steady"] == pytest.approx(2.5)
    assert summary["steady_stages"]["generation"]["seconds"] == 4.0
    payload = {
        "config": "x.yaml",
        "overrides": [],
        "gpus": 1,
        "environment": {"device": "GPU", "torch": "t", "megatron_core": "m"},
        "date": "d",
        "floors": FLOORS,
        "steps": steps,
        "summary": summary,
    }
    text = RL_STEP["table"](payload)
    assert "| generation | 4.00 | 5,000 |" in text and "first step 20.00 s (2.50x)" in text


def test_a_step_without_generation_has_no_generation_floor() -> None:
    row = {k: v for k, v in _row(2, 3.0).items() if "generation" not in k}
    report = RL_STEP["stage_report"](row, FLOORS, gpus=1)
    assert "generation" not in report["stages"] and "policy_training" in report["stages"]


def test_the_recipe_is_read_once_for_the_job_its_gpus_and_its_bytes() -> None:
    pytest.importorskip("megatron.core")
    from nemo_rl_offload.config.loader import load_recipe

    config = REPO / "examples" / "configs" / "grpo_math_1B_megatron_fgo.yaml"
    recipe = load_recipe(config, ["cluster.gpus_per_node=2"])
    assert RL_STEP["algorithm_of"](recipe, config) == "grpo"
    assert RL_STEP["job_gpus"](recipe) == 2
    sizes = RL_STEP["model_bytes"](recipe)
    # llama-1b in bfloat16: about a billion parameters besides the embedding; one cached
    # position holds every layer's keys and values of its query groups
    assert 1e9 < sizes["weight_bytes"] < 4e9
    assert sizes["kv_bytes_per_position"] == 65536
    with pytest.raises(SystemExit, match="no grpo, distillation, sft or dpo section"):
        RL_STEP["algorithm_of"]({"policy": {}}, config)
