"""SFT and GRPO on the ~1B dense preset with fine-grained offloading on and off, side by side.

Runs the real CLI (embedded Ray, one GPU) for each case and collects, per step, the loss, peak
GPU memory and bytes offloaded from each run's metrics file. The plain run is repeated to give
the run-to-run spread that the FGO run's losses are compared against.

Usage (on the GPU machine, from the repository root):
    python benchmarks/training_fgo_check.py --out DIR [--steps 8] [--algorithms sft,grpo]
        [--cases plain_a,plain_b,fgo_all5] [--setup TAG=override,override ...]
e.g. two GPUs: --setup dp2=cluster.gpus_per_node=2
               --setup tp2=cluster.gpus_per_node=2,policy.megatron_cfg.tensor_model_parallel_size=2
Writes DIR/training_fgo_check.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DENSE_ALL = "[attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm]"
COMMON = [
    "policy.model_name=llama-1b",
    "checkpointing.enabled=false",
    # Arithmetic sequences are short; padding them to 4096 tokens gives the activations (and
    # offloaded bytes) of a realistic sequence length, large enough to dominate the step's peak.
    "policy.make_sequence_length_divisible_by=4096",
    "policy.max_total_sequence_length=4096",
    "policy.train_micro_batch_size=4",
    "policy.logprob_batch_size=4",
]
ALGORITHMS = {
    "sft": (
        "sft",
        "examples/configs/sft.yaml",
        ["policy.train_global_batch_size=16", "sft.val_period=0", "sft.val_at_start=false"],
        "max_num_steps",
    ),
    "grpo": (
        "grpo",
        "examples/configs/grpo_math_1B_megatron.yaml",
        [
            "policy.train_global_batch_size=16",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "policy.generation.max_new_tokens=8",
        ],
        "max_num_steps",
    ),
}
CASES = {
    "plain_a": [],
    "plain_b": [],
    "fgo_all5": [
        "policy.megatron_cfg.fine_grained_activation_offloading=true",
        f"policy.megatron_cfg.offload_modules={DENSE_ALL}",
    ],
}


def run_case(
    algorithm: str, case: str, steps: int, out: Path, extra_overrides: list[str], tag: str
) -> dict:
    command, recipe, extra, steps_key = ALGORITHMS[algorithm]
    log_dir = out / f"{tag}{algorithm}_{case}"
    args = [
        sys.executable,
        "-m",
        "nemo_rl_offload.cli",
        command,
        "--config",
        recipe,
        *COMMON,
        *extra,
        f"{command}.{steps_key}={steps}",
        f"logger.log_dir={log_dir}",
        *CASES[case],
        *extra_overrides,
    ]
    start = time.monotonic()
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=os.environ)
    wall = time.monotonic() - start
    (out / f"{tag}{algorithm}_{case}.stderr.txt").write_text(result.stderr[-20000:])
    record: dict = {
        "algorithm": algorithm,
        "case": case,
        "setup": tag.rstrip("_") or "1gpu",
        "overrides": extra_overrides,
        "rc": result.returncode,
        "wall_s": wall,
    }
    metrics_file = log_dir / "metrics.jsonl"
    if metrics_file.exists():
        train = [json.loads(x) for x in metrics_file.read_text().splitlines()]
        train = [r for r in train if r["phase"] == "train"]
        record.update(
            losses=[r["loss"] for r in train],
            peak_gib=max((r.get("peak_gpu_memory_gib", 0.0) for r in train), default=0.0),
            peak_fwd_bwd_gib=max(
                (r.get("peak_fwd_bwd_gpu_memory_gib", 0.0) for r in train), default=0.0
            ),
            offloaded_gib_per_step=max(
                (r.get("offloaded_gib_per_step", 0.0) for r in train), default=0.0
            ),
            median_step_s=sorted(r["step_time_s"] for r in train)[len(train) // 2]
            if train
            else None,
        )
    return record


def summarise(records: list[dict]) -> str:
    lines = [
        "| algorithm | case | rc | peak GiB (step) | peak GiB (fwd-bwd) | offloaded GiB/step"
        " | median step s | max abs loss diff vs plain_a |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["setup"], r["algorithm"], r["case"]): r for r in records}
    for r in records:
        base = by_key.get((r["setup"], r["algorithm"], "plain_a"), {}).get("losses") or []
        diff = max(
            (abs(a - b) for a, b in zip(r.get("losses") or [], base, strict=False)), default=0.0
        )
        step = r.get("median_step_s")
        lines.append(
            f"| {r['setup']} | {r['algorithm']} | {r['case']} | {r['rc']} | "
            f"{r.get('peak_gib', 0):.2f} | "
            f"{r.get('peak_fwd_bwd_gib', 0):.2f} | "
            f"{r.get('offloaded_gib_per_step', 0):.3f} | "
            f"{step if step is None else round(step, 3)} | {diff:.2e} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--algorithms", default="sft,grpo")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument(
        "--setup",
        action="append",
        default=[],
        help="TAG=override,override... (repeatable); default: one GPU",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setups = [s.split("=", 1) for s in args.setup] or [["", "cluster.gpus_per_node=1"]]
    records = []
    for tag, overrides in setups:
        for algorithm in args.algorithms.split(","):
            for case in args.cases.split(","):
                records.append(
                    run_case(
                        algorithm,
                        case,
                        args.steps,
                        out,
                        overrides.split(","),
                        f"{tag}_" if tag else "",
                    )
                )
                summary = {k: v for k, v in records[-1].items() if k != "losses"}
                print(json.dumps(summary), flush=True)
                (out / "training_fgo_check.json").write_text(json.dumps(records, indent=1))
    (out / "training_fgo_check.json").write_text(json.dumps(records, indent=1))
    table = summarise(records)
    (out / "training_fgo_check.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["rc"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
