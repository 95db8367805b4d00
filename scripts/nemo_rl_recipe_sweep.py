"""Run every NeMo-RL recipe that validates for one step on one CPU worker, to find settings that
validate but do not run.

Each recipe gets the stand-ins that tests/functional/nemo_rl_recipes give NeMo-RL's four
exemplars:
- a tiny preset model (tiny-moe where the recipe's model name says experts);
- the built-in arithmetic data;
- small batches, every parallel size 1, one step, no validation and no checkpoints;
- quantization calibrated on the run's own data (``quant_calib_data`` null: NeMo-RL's is a
  Hugging Face dataset);
- fixed sink run names (NeMo-RL's interpolate the data they name).

Everything else in the recipe runs as written. The recipes are those of the committed key list
(tests/unit/reference_configs/nemo_rl_keys.json) in a NeMo-RL checkout (`fetch
github:NVIDIA-NeMo/RL`). It needs no GPU; each recipe is one CLI run:

    python3 scripts/nemo_rl_recipe_sweep.py --nemo-rl /path/to/RL --out sweep.json [--only a,b]

Writes, per recipe: the algorithm, the stand-in model, the exit code, the seconds taken, the
lines saying what the run applied (FP8 linears, quantizers), and the last lines of a failure.
Recipes that validate with errors beyond their Hugging Face model are listed as skipped, with
those errors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
KEYS = REPO / "tests" / "unit" / "reference_configs" / "nemo_rl_keys.json"
COMMANDS = {"grpo": "grpo", "sft": "sft", "dpo": "dpo", "distillation": "distill"}
# A recipe whose model name says experts gets the MoE preset.
EXPERTS = re.compile(r"a3b|a12b|a17b|a22b|moe|moonlight|mixtral|deepseek|gpt-oss|nano|super", re.I)
# The lines a run prints about what it applied (FP8 linears, quantizers), kept per recipe.
APPLIED = re.compile(r"linears make FP8 products|quantization-aware with")
DATA = {
    "_override_": True,
    "dataset_name": "arithmetic",
    "max_input_seq_length": "${policy.max_total_sequence_length}",
    "shuffle": True,
    "seed": 42,
    "arithmetic_ops": ["+"],
    "max_operand": 30,
    "num_train_samples": 64,
    "num_val_samples": 8,
}
ONE_RANK = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "sequence_parallel": False,
    "pipeline_dtype": None,
}
ONE_RANK_DTENSOR = {"tensor_parallel_size": 1, "context_parallel_size": 1}
SINKS = {"wandb": "name", "swanlab": "name", "tensorboard": "log_dir", "mlflow": "run_name"}


def _section(model: str, recipe_section: dict[str, Any], *, trains: bool) -> dict[str, Any]:
    section: dict[str, Any] = {
        "model_name": model,
        "tokenizer": {"name": None},
        "precision": "float32",
        "max_total_sequence_length": 64,
        "megatron_cfg": dict(ONE_RANK),
        "hf_config_overrides": None,
    }
    if recipe_section.get("quant_calib_data"):
        section["quant_calib_data"] = None  # NeMo-RL's is a Hugging Face dataset: the run's own
    if isinstance(recipe_section.get("dtensor_cfg"), dict):
        section["dtensor_cfg"] = dict(ONE_RANK_DTENSOR)
    if trains:
        section.update(train_global_batch_size=4, train_micro_batch_size=2, logprob_batch_size=2)
    return section


def stand_ins(recipe: dict[str, Any], algorithm: str, name: str) -> dict[str, Any]:
    """What the sweep changes in ``recipe`` (module docstring), as a recipe layered over it."""
    policy = recipe.get("policy") or {}
    model = "tiny-moe" if EXPERTS.search(str(policy.get("model_name"))) else "tiny-dense"
    layer: dict[str, Any] = {
        "policy": _section(model, policy, trains=True),
        "data": DATA,
        "checkpointing": {"enabled": False},
        "cluster": {"gpus_per_node": 0, "num_cpu_workers": 1, "num_nodes": 1},
    }
    sinks = recipe.get("logger") or {}
    layer["logger"] = {
        sink: {key: name} for sink, key in SINKS.items() if isinstance(sinks.get(sink), dict)
    }
    no_validation = {
        "max_num_steps": 1,
        "val_period": 0,
        "val_at_start": False,
        "val_at_end": False,
    }
    # What the algorithms that sample take per step (their own section).
    sampled = {"grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
               "distillation": {"num_prompts_per_step": 4, "topk_logits_k": 8}}  # fmt: skip
    if algorithm in sampled:
        layer["policy"]["generation"] = {"max_new_tokens": 8}
        layer["env"] = {"_override_": True, "math": {"num_workers": 1}}
        layer[algorithm] = {
            **no_validation,
            **sampled[algorithm],
            "max_val_samples": 4,
            "val_batch_size": 4,
        }
    if algorithm == "distillation":
        layer["teacher"] = _section("tiny-dense", recipe.get("teacher") or {}, trains=False)
    if algorithm not in sampled:
        layer[algorithm] = {
            **no_validation,
            "val_batches": 1,
            "val_global_batch_size": 4,
            "val_micro_batch_size": 1,
        }
    return layer


def beyond_model(errors: list[str]) -> list[str]:
    """The errors that are not about the recipe's model being absent here: a Hugging Face id
    not in the cache, or a name that is not a model at all (NeMo-RL's DeepSeek recipes hold a
    "follow these instructions" placeholder)."""
    return [
        e
        for e in errors
        if "not on this machine" not in e and not re.match(r"(policy|teacher)\.model_name: ", e)
    ]


def run_one(path: Path, work: Path) -> dict[str, Any]:
    from nemo_rl_offload.config.loader import load_recipe
    from nemo_rl_offload.config.validate import detect_algorithm
    from nemo_rl_offload.preflight import load_and_check

    others = beyond_model(load_and_check(str(path)).errors)
    if others:
        return {"skipped": others}
    recipe = load_recipe(str(path))
    algorithm = detect_algorithm(recipe)
    layer = stand_ins(recipe, algorithm, path.stem)
    layer["defaults"] = str(path.resolve())
    config = work / f"{path.stem}.yaml"
    config.write_text(yaml.safe_dump(layer))
    began = time.time()
    done = subprocess.run(
        [
            sys.executable, "-m", "nemo_rl_offload.cli", COMMANDS[algorithm],
            "--config", str(config), f"logger.log_dir={work / 'logs' / path.stem}",
        ],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [
        line for line in done.stderr.splitlines() if line.strip() and "(PolicyWorker" not in line
    ]
    return {
        "algorithm": algorithm,
        "model": layer["policy"]["model_name"],
        "rc": done.returncode,
        "seconds": round(time.time() - began),
        "tail": lines[-4:] if done.returncode else [],
        "applied": [line for line in lines if APPLIED.search(line)],
    }


def validate_all(root: Path, files: list[Path], out: Path) -> None:
    """Each recipe's errors beyond its Hugging Face model (the issue's bar for "it loads")."""
    from nemo_rl_offload.preflight import load_and_check

    failing: dict[str, list[str]] = {}
    for path in files:
        others = beyond_model(load_and_check(str(path)).errors)
        if others:
            failing[str(path.relative_to(root))] = others
            print(path.stem, *others, sep="\n  ", flush=True)
    out.write_text(json.dumps(failing, indent=1))
    print(f"{len(files) - len(failing)} of {len(files)} recipes validate beyond their model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nemo-rl", required=True, help="a NeMo-RL checkout")
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated recipe names (file stems)")
    parser.add_argument(
        "--validate-only",
        action="store_true",
        help="list each recipe's validation errors beyond its model; run nothing",
    )
    args = parser.parse_args()
    root = Path(args.nemo_rl)
    files = [root / r["file"] for r in json.loads(KEYS.read_text())["recipes"] if "file" in r]
    if args.only:
        files = [f for f in files if f.stem in args.only.split(",")]
    if args.validate_only:
        validate_all(root, files, Path(args.out))
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work:
        for path in files:
            results[str(path.relative_to(root))] = result = run_one(path, Path(work))
            print(path.stem, result.get("rc", "skipped"), result.get("tail", [""])[-1:], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    ran = [r for r in results.values() if "rc" in r]
    print(f"{sum(r['rc'] == 0 for r in ran)} of {len(ran)} recipes that validate ran one step")


if __name__ == "__main__":
    main()
