"""scripts/nemo_rl_recipe_sweep.py's stand-ins: which preset a recipe gets, and what it changes
for each algorithm (the runs themselves need a NeMo-RL checkout: docs/recipes.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from nemo_rl_recipe_sweep import stand_ins  # noqa: E402


@pytest.mark.parametrize(
    "model,preset",
    [("Qwen/Qwen3-30B-A3B", "tiny-moe"), ("moonshotai/Moonlight-16B-A3B", "tiny-moe"),
     ("meta-llama/Llama-3.1-8B-Instruct", "tiny-dense"), ("Qwen/Qwen2.5-1.5B", "tiny-dense")],
)  # fmt: skip
def test_a_model_with_experts_gets_the_moe_preset(model, preset):
    layer = stand_ins({"policy": {"model_name": model}}, "grpo", "r")
    assert layer["policy"]["model_name"] == preset


def test_each_algorithm_gets_one_step_small_batches_and_one_rank():
    recipe = {
        "policy": {"model_name": "m", "dtensor_cfg": {"tensor_parallel_size": 8}},
        "teacher": {"model_name": "t"},
        "logger": {"wandb": {"name": "x-${data.train.dataset_name}"}, "tensorboard": None},
    }
    for algorithm in ("grpo", "sft", "dpo", "distillation"):
        layer = stand_ins(recipe, algorithm, "name")
        assert layer[algorithm]["max_num_steps"] == 1 and layer[algorithm]["val_period"] == 0
        assert layer["policy"]["megatron_cfg"]["tensor_model_parallel_size"] == 1
        assert layer["policy"]["dtensor_cfg"] == {
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
        }
        assert layer["cluster"] == {"gpus_per_node": 0, "num_cpu_workers": 1, "num_nodes": 1}
        assert layer["logger"] == {"wandb": {"name": "name"}}  # only the sinks the recipe has
        assert ("generation" in layer["policy"]) == (algorithm in ("grpo", "distillation"))
        assert ("teacher" in layer) == (algorithm == "distillation")


def test_named_calibration_data_is_replaced_by_the_runs_own():
    recipe = {"policy": {"model_name": "m", "quant_cfg": "X_CFG", "quant_calib_data": "cnn"}}
    assert stand_ins(recipe, "grpo", "r")["policy"]["quant_calib_data"] is None
    assert (
        "quant_calib_data" not in stand_ins({"policy": {"model_name": "m"}}, "grpo", "r")["policy"]
    )


def test_only_the_models_absence_is_not_counted_against_a_recipe():
    from nemo_rl_recipe_sweep import beyond_model

    errors = [
        "policy.model_name: Hugging Face model 'a/b' is not on this machine ...",
        "policy.model_name: 'Follow instructions in ...' is neither a preset nor a local directory",
        "teacher.model_name: 'x' is neither a preset nor a local directory",
        "policy.quant_cfg: 'f.yaml' is neither a ModelOpt config name nor a file",
    ]
    assert beyond_model(errors) == errors[3:]
