"""NeMo-RL's own exemplar recipes run here as written: grpo_math_1B_megatron.yaml, sft.yaml
(a DTensor recipe), dpo.yaml and distillation_math_megatron.yaml, each with a preset model and
one or two steps (tests/functional/nemo_rl_recipes/short/*.yaml say what they change: model,
lengths, batch sizes, one rank, the sinks' run names): on CPU workers with their own data
sections (tests/data/nemo_rl/runs/*.yaml: only the data's location changed), on the GPU also
with the built-in data (tests/functional/nemo_rl_recipes/*.yaml).

NeMo-RL's base recipes turn on settings that validated but stopped a run at its start: the
precision-aware optimizer and RoPE fusion (both need Transformer Engine here: the distributed
optimizer and the unfused path run instead, with a warning each), and ``tokenizer.name:
${policy.model_name}`` (the model's own tokenizer). On CPU workers (CI) with the tiny model;
GRPO on a GPU with llama-1b, and moe-1b with and without router replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "tests" / "functional" / "nemo_rl_recipes"
COMMANDS = {"grpo": "grpo", "sft": "sft", "dpo": "dpo", "distillation": "distill"}


def _python_path() -> str:
    """The repository first, then whatever the caller's path holds (a GPU machine's wheels)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def _run(
    tmp_path: Path, recipe: str, *overrides: str, recipes: Path = RECIPES
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    done = subprocess.run(
        [
            sys.executable, "-m", "nemo_rl_offload.cli", COMMANDS[recipe],
            "--config", str(recipes / f"{recipe}.yaml"),
            f"logger.log_dir={tmp_path / 'logs'}", *overrides,
        ],
        cwd=REPO, env={**os.environ, "PYTHONPATH": _python_path()},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    metrics = tmp_path / "logs" / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return done, records


def _check(
    done: subprocess.CompletedProcess, records: list[dict], steps: int, warned: tuple[str, ...]
) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    for key in warned:
        assert f"{key}: ignored" in done.stderr  # said once, before the run
    trained = [r for r in records if r.get("phase") == "train"]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert all(abs(r["loss"]) < 1e3 for r in trained)


# Router replay (policy.router_replay, NeMo-RL's R3 recipes turn it on over this base recipe):
# the sampler's routes reach every packed training and log-probability forward. NeMo-RL's base
# recipe freezes the routers (freeze_moe_router: true), which runs as it does there.
REPLAY = "++policy.router_replay.enabled=true"

# policy.quant_cfg with the calibration keys of NeMo-RL's quantization-aware recipes.
QUANTIZED = [
    "++policy.quant_cfg=NVFP4_DEFAULT_CFG",
    "++policy.generation.quant_cfg=NVFP4_DEFAULT_CFG",
    "++policy.quant_calib_size=8",
    "++policy.quant_batch_size=2",
    "++policy.quant_sequence_length=32",
]

# NeMo-RL's recipes with their own data sections (tests/data/nemo_rl/runs/*.yaml: local copies of
# the named datasets in their hub columns, NeMo-RL's prompt files, processors, chat templates
# and the math environment).
OWN_DATA = REPO / "tests" / "data" / "nemo_rl" / "runs"

# What each CPU run changes beyond its recipe file. GRPO's file is the GPU run's: on one CPU
# rank a float32 tiny model and a short step, the MoE preset with router replay, so one run
# covers both (the GPU runs the dense model and the MoE with and without replay).
GRPO_ON_CPU = [
    "policy.precision=float32",
    "policy.generation.max_new_tokens=8",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=4",
    "policy.logprob_batch_size=4",
    "grpo.num_prompts_per_step=2",
    "grpo.max_num_steps=1",
    "++policy.megatron_cfg.pipeline_dtype=null",
    "++policy.megatron_cfg.optimizer.bf16=false",
    "cluster.gpus_per_node=0",
    "++cluster.num_cpu_workers=1",
]
CPU_OVERRIDES = {
    "grpo": ["policy.model_name=tiny-moe", REPLAY, *GRPO_ON_CPU],
    "sft": [],
    "dpo": [],
    # NeMo-RL's quantization-aware distillation (its qa_distillation recipe over this one):
    # the student trains and samples with ModelOpt's NVFP4 quantizers, calibrated on the
    # recipe's own prompts (its calibration dataset is a Hugging Face one).
    "distillation": QUANTIZED,
}


def _routed(records: list[dict]) -> list[float]:
    return [r["router_replay_routed"] for r in records if r.get("phase") == "train"]


@pytest.mark.parametrize("recipe", list(CPU_OVERRIDES))
def test_nemo_rls_recipe_trains_on_its_own_data_section_on_cpu_workers(tmp_path, recipe):
    done, records = _run(tmp_path, recipe, *CPU_OVERRIDES[recipe], recipes=OWN_DATA)
    # CPU workers always run the distributed optimizer: nothing to say about precision.
    _check(done, records, steps=1, warned=("apply_rope_fusion",) if recipe == "grpo" else ())
    if recipe == "distillation":
        assert "policy quantization-aware with NVFP4_DEFAULT_CFG: " in done.stderr
    if recipe == "grpo":
        assert _routed(records) == [1.0]
        changed = [r["router_replay_changed"] for r in records if r.get("phase") == "train"]
        assert len(changed) == 1 and 0.0 <= changed[0] <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nemo_rls_grpo_recipe_runs_on_a_gpu(tmp_path):
    done, records = _run(tmp_path, "grpo")
    _check(done, records, steps=2, warned=("apply_rope_fusion", "use_precision_aware_optimizer"))
    assert all(r["peak_gpu_memory_gib"] > 0 for r in records if r.get("phase") == "train")


# The same recipes on one GPU with llama-1b in bfloat16 (GRPO's file is the GPU run's already).
OWN_DATA_GPU = {
    "grpo": [],
    **{
        recipe: [
            "policy.model_name=llama-1b",
            "policy.precision=bfloat16",
            "cluster.gpus_per_node=1",
            *(["teacher.model_name=llama-1b", "teacher.precision=bfloat16"]
              if recipe == "distillation" else []),
        ]
        for recipe in ("sft", "dpo", "distillation")
    },
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", list(OWN_DATA_GPU))
def test_nemo_rls_recipe_trains_on_its_own_data_section_on_a_gpu(tmp_path, recipe):
    done, records = _run(tmp_path, recipe, *OWN_DATA_GPU[recipe], recipes=OWN_DATA)
    steps = 2 if recipe == "grpo" else 1
    _check(done, records, steps=steps, warned=())
    assert all(r["peak_gpu_memory_gib"] > 0 for r in records if r.get("phase") == "train")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_router_replay_on_an_moe_policy_on_a_gpu(tmp_path):
    """moe-1b with and without replay from the same weights and prompts: with it, every fed
    position is replayed. ``ROUTER_REPLAY_OUT``: a directory for both runs' metrics (the
    comparison under benchmarks/results)."""
    out = Path(os.environ.get("ROUTER_REPLAY_OUT") or tmp_path)
    runs = {}
    for name, extra in (("replay", [REPLAY]), ("no_replay", [])):
        done, records = _run(out / name, "grpo", "policy.model_name=moe-1b", *extra)
        _check(done, records, steps=2, warned=("apply_rope_fusion",))
        runs[name] = records
    assert _routed(runs["replay"]) == [1.0, 1.0]
    assert "router_replay_routed" not in json.dumps(runs["no_replay"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantization_aware_grpo_on_a_gpu(tmp_path):
    """llama-1b GRPO from the same weights and prompts: plain; NVFP4 MLP weights in training
    and rollouts (NeMo-RL's W4A16 recipes); the same with unquantized rollouts; NVFP4 weights
    and inputs in both (NeMo-RL's W4A4 recipes). Weight quantization is the same function of
    the weights in the sampler and the trainer, so with both quantized their log-probabilities
    agree as closely as the plain run's; with the sampler unquantized they do not.
    ``QUANTIZATION_OUT``: a directory for the runs' metrics (benchmarks/results)."""
    out = Path(os.environ.get("QUANTIZATION_OUT") or tmp_path)
    # As NeMo-RL's W4A16 recipe files write it (format names), read with ModelOpt's reader.
    mlp_weights = tmp_path / "nvfp4_mlp_weights.yaml"
    mlp_weights.write_text(
        "quantize:\n  algorithm: max\n  quant_cfg:\n"
        "    - {quantizer_name: '*', enable: false}\n"
        "    - quantizer_name: '*mlp*weight_quantizer'\n      enable: true\n"
        "      cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}}\n"
    )
    cases = {
        "plain": [],
        "nvfp4_mlp_weights": [
            f"++policy.quant_cfg={mlp_weights}",
            f"++policy.generation.quant_cfg={mlp_weights}",
        ],
        "nvfp4_mlp_weights_rollouts_plain": ["++policy.quant_cfg=NVFP4_MLP_WEIGHT_ONLY_CFG"],
        "nvfp4_w4a4": QUANTIZED,
    }
    error = {}
    for name, extra in cases.items():
        done, records = _run(out / name, "grpo", *extra)
        _check(done, records, steps=2, warned=("apply_rope_fusion",))
        if extra:
            assert "policy quantization-aware with " in done.stderr
        error[name] = [r["token_mult_prob_error"] for r in records if r.get("phase") == "train"]
    plain = abs(error["plain"][0] - 1)
    assert abs(error["nvfp4_mlp_weights"][0] - 1) < 2 * plain + 0.01, error
    assert abs(error["nvfp4_mlp_weights_rollouts_plain"][0] - 1) > 2 * plain + 0.01, error


def _fp8(recipe: str) -> list[str]:
    """NeMo-RL's fp8_cfg keys (its FP8 recipes: e4m3, no FP8 master weights)."""
    keys = {"enabled": "true", "fp8": "e4m3", "fp8_recipe": recipe, "fp8_param": "false"}
    return [f"++policy.megatron_cfg.fp8_cfg.{k}={v}" for k, v in keys.items()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_grpo_on_a_gpu(tmp_path):
    """llama-1b GRPO from the same weights and prompts, plain and with the layers' linears in
    FP8 (blockwise and tensorwise scaling), rollouts and training both. FP8 rounding turns the
    small differences between the KV-cached sampler and the packed trainer into whole steps,
    more so with one scale per tensor (taken over a decode step's few tokens in the sampler,
    over the whole batch in the trainer) than with per-token 1x128 blocks, which quantize a
    token the same wherever it is computed. ``FP8_OUT``: a directory for the runs' metrics
    (benchmarks/results)."""
    out = Path(os.environ.get("FP8_OUT") or tmp_path)
    error = {}
    for name, extra in (
        ("plain", []),
        ("fp8_blockwise", _fp8("blockwise")),
        ("fp8_tensorwise", _fp8("tensorwise")),
    ):
        done, records = _run(out / name, "grpo", *extra)
        _check(done, records, steps=2, warned=("apply_rope_fusion",))
        assert ("linears make FP8 products" in done.stderr) == bool(extra)
        assert "is emulated on this GPU" not in done.stderr
        error[name] = [r["token_mult_prob_error"] for r in records if r.get("phase") == "train"]
    off = {name: abs(values[0] - 1) for name, values in error.items()}
    assert off["plain"] < off["fp8_blockwise"] < off["fp8_tensorwise"] < 0.5, error
