"""The RL step a user runs, per stage, against each stage's floor measured in the same run.

Runs a recipe's real job (``nemo-rl-offload grpo|distill|sft|dpo``) for ``--steps`` steps on the
GPU and reports, per stage (generation, policy and reference log-probabilities, training, the
rest of the step: weight refit, rewards, logging), its seconds, tokens/s per GPU and its floor:

- generation: every decode step reads the weights once and each row's keys and values up to its
  length (``generation_decode_steps``, ``generation_attended_positions`` from the job's
  metrics), at the HBM copy bandwidth measured here before the job;
- training: the step's model FLOPs (``train_flops_per_gpu``) at the bf16 matmul rate measured
  here; forward-only passes: a third of that per pass (``logprob_passes``).

The first step is reported against the median of the steady ones. The component benchmarks
(generation_benchmark.py, offload_benchmark.py) stay; this is the number users see.

On a GPU machine, from the repository root (dependencies as in docs/gpu.md):
    python3 benchmarks/rl_step.py --config examples/configs/grpo_math_1B_megatron_fgo.yaml \\
        --steps 4 --out /tmp/rl_step [OVERRIDES...]
Output in --out: ``rl_step.json`` (every step's stages, the floors, device, versions, date),
``rl_step.md`` (the table), the job's log and metrics.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from generation_benchmark import hbm_bandwidth  # noqa: E402  (the sampler benchmark's floor)

STAGES = ("generation", "policy_and_reference_logprobs", "policy_training")
ALGORITHMS = {"grpo": "grpo", "distillation": "distill", "sft": "sft", "dpo": "dpo"}


def matmul_rate(size: int = 8192, repeats: int = 10) -> float:
    """bf16 FLOP/s of a large square matrix product on this GPU."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * size**3 * repeats / seconds


def model_bytes(recipe: dict[str, Any]) -> dict[str, float]:
    """Bytes one GPU reads per decode step for the weights, and per cached position."""
    from nemo_rl_offload.config.megatron_settings import effective_settings
    from nemo_rl_offload.config.model_presets import section_architecture
    from nemo_rl_offload.planning.memory_estimate import kv_cache_bytes, parameter_counts

    policy = recipe["policy"]
    architecture = section_architecture(policy, base_dir=Path.cwd())
    effective = effective_settings(policy, architecture, te_installed=False)
    element = 2 if str(policy.get("precision", "bfloat16")) in ("bfloat16", "float16") else 4
    counts = parameter_counts(effective, architecture)
    # The embedding lookup reads only the rows' entries; every matrix is read.
    return {
        "weight_bytes": (counts.layers + counts.output) * element,
        "kv_bytes_per_position": kv_cache_bytes(effective, 1, 1, element),
    }


def algorithm_of(recipe: dict[str, Any], config: Path) -> str:
    for section, command in ALGORITHMS.items():
        if section in recipe:
            return command
    raise SystemExit(f"{config}: no grpo, distillation, sft or dpo section; which job is it?")


def job_gpus(recipe: dict[str, Any]) -> int:
    cluster = recipe.get("cluster") or {}
    return int(cluster.get("gpus_per_node") or 1) * int(cluster.get("num_nodes") or 1)


def run_job(command: str, config: Path, steps: int, overrides: list[str], out: Path) -> int:
    section = next(s for s, c in ALGORITHMS.items() if c == command)
    argv = [
        sys.executable,
        "-m",
        "nemo_rl_offload.cli",
        command,
        "--config",
        str(config),
        f"{section}.max_num_steps={steps}",
        f"logger.log_dir={out / 'logs'}",
        f"checkpointing.checkpoint_dir={out / 'ckpt'}",
        "checkpointing.enabled=false",
        *overrides,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with (out / "job.log").open("w") as log:
        return subprocess.run(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode


def stage_report(row: dict[str, Any], floors: dict[str, float], gpus: int) -> dict[str, Any]:
    """One step's stages: seconds, tokens/s per GPU, floor seconds and the share of it."""
    timing = {stage: float(row.get(f"timing/train/{stage}", 0.0)) for stage in STAGES}
    step_s = float(row.get("step_time_s", sum(timing.values())))
    out: dict[str, Any] = {"step": int(row["step"]), "step_s": step_s, "stages": {}}
    generation = timing["generation"]
    if generation > 0 and row.get("generation_decode_steps"):
        floor = (
            row["generation_decode_steps"] * floors["weight_bytes"]
            + row["generation_attended_positions"] / gpus * floors["kv_bytes_per_position"]
        ) / floors["hbm_bytes_per_s"]
        out["stages"]["generation"] = {
            "seconds": generation,
            "new_tokens_per_s_per_gpu": row.get("generation_new_tokens_per_sec_per_gpu"),
            "floor_s": floor,
            "of_floor": floor / generation,
        }
    training = timing["policy_training"]
    flops = float(row.get("train_flops_per_gpu", 0.0)) * 1e12 * training  # per GPU
    if training > 0:
        out["stages"]["policy_training"] = {
            "seconds": training,
            "tokens_per_s_per_gpu": row.get("policy_training_tokens_per_sec_per_gpu"),
            "mfu": row.get("train_fp_utilization"),
            "floor_s": flops / floors["matmul_flops_per_s"],
            "of_floor": flops / floors["matmul_flops_per_s"] / training,
        }
    logprobs = timing["policy_and_reference_logprobs"]
    passes = float(row.get("logprob_passes", 0.0))
    if logprobs > 0:
        floor = passes * flops / 3.0 / floors["matmul_flops_per_s"]
        tokens = row.get("policy_and_reference_logprobs_tokens_per_sec_per_gpu")
        out["stages"]["policy_and_reference_logprobs"] = {
            "seconds": logprobs,
            "passes": passes,
            "tokens_per_s_per_gpu": tokens,
            "floor_s": floor,
            "of_floor": floor / logprobs,
            # per pass, against training's tokens/s: the forward-only target is >= 2x
            "pass_tokens_per_s_vs_training": (
                tokens * passes / row["policy_training_tokens_per_sec_per_gpu"]
                if tokens and passes and row.get("policy_training_tokens_per_sec_per_gpu")
                else None
            ),
        }
    out["stages"]["other"] = {"seconds": max(0.0, step_s - sum(timing.values()))}
    return out


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    first, steady = steps[0], steps[1:] or steps[:1]
    median = statistics.median(s["step_s"] for s in steady)
    stages = {}
    for stage in (*STAGES, "other"):
        values = [s["stages"][stage] for s in steady if stage in s["stages"]]
        if not values:
            continue
        stages[stage] = {
            key: statistics.median(v[key] for v in values)
            for key in values[0]
            if all(isinstance(v.get(key), (int, float)) for v in values)
        }
    return {
        "first_step_s": first["step_s"],
        "steady_step_s": median,
        "first_over_steady": first["step_s"] / median if median else None,
        "steady_stages": stages,
    }


def table(payload: dict[str, Any]) -> str:
    env, s = payload["environment"], payload["summary"]
    lines = [
        f"RL step of `{payload['config']}` {' '.join(payload['overrides'])} on {env['device']} "
        f"x{payload['gpus']} (torch {env['torch']}, megatron-core {env['megatron_core']}, "
        f"{payload['date']}); HBM copy {payload['floors']['hbm_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"bf16 matmul {payload['floors']['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s.",
        "",
        f"Steady step {s['steady_step_s']:.2f} s (median of steps 2..{len(payload['steps'])}); "
        f"first step {s['first_step_s']:.2f} s ({s['first_over_steady']:.2f}x).",
        "",
        "| stage | seconds | tokens/s per GPU | floor s | of floor | MFU |",
        "|---|---|---|---|---|---|",
    ]
    for stage, v in s["steady_stages"].items():
        rate = v.get("new_tokens_per_s_per_gpu") or v.get("tokens_per_s_per_gpu")
        lines.append(
            f"| {stage} | {v['seconds']:.2f} | {f'{rate:,.0f}' if rate else '-'} | "
            f"{f'{v["floor_s"]:.2f}' if 'floor_s' in v else '-'} | "
            f"{f'{v["of_floor"]:.0%}' if v.get('of_floor') else '-'} | "
            f"{f'{v["mfu"]:.1%}' if v.get('mfu') else '-'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4, help="steps to run (the first is cold)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides of the recipe")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step is reported against the steady ones)")

    import megatron.core
    import torch

    if not torch.cuda.is_available():
        print("rl_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    from nemo_rl_offload.config.loader import load_recipe

    args.out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(args.config, args.overrides)
    floors = {
        "hbm_bytes_per_s": hbm_bandwidth(),
        "matmul_flops_per_s": matmul_rate(),
        **model_bytes(recipe),
    }
    torch.cuda.empty_cache()  # the job's workers get the whole GPU
    command = algorithm_of(recipe, args.config)
    began = time.perf_counter()
    code = run_job(command, args.config, args.steps, args.overrides, args.out)
    wall = time.perf_counter() - began
    rows_path = args.out / "logs" / "metrics.jsonl"
    rows = []
    if rows_path.exists():
        rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("phase") == "train"]
    if code != 0 or len(rows) < 2:
        print(
            f"rl_step: the job exited {code} after {len(rows)} steps; see {args.out / 'job.log'}",
            file=sys.stderr,
        )
        return 1
    gpus = job_gpus(recipe)
    steps = [stage_report(r, floors, gpus) for r in rows]
    payload = {
        "config": str(args.config),
        "overrides": args.overrides,
        "gpus": gpus,
        "environment": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "megatron_core": megatron.core.__version__,
        },
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "job_wall_s": wall,
        "floors": floors,
        "steps": steps,
        "summary": summary(steps),
    }
    (args.out / "rl_step.json").write_text(json.dumps(payload, indent=1))
    text = table(payload)
    (args.out / "rl_step.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
