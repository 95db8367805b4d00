"""The step cost of optimizer state on the host (``optimizer.optimizer_cpu_offload`` with
``optimizer_offload_fraction``, NeMo-RL's keys; megatron-core's hybrid CPU optimizer).

Why: moving Adam's state to the host frees its GPU memory for the whole run, but the step then
copies gradients down and parameters up and runs (a fraction of) Adam on the CPU. The offload
benchmark times the forward-backward only; this times whole training steps (the optimizer's
included) of one model at each fraction against the same settings with nothing offloaded,
each case in a process of its own (the allocator starts empty), and
reports per case the optimizer's share of the step (step time minus the forward-backward's),
the step's peak and what stays allocated between steps, and the losses, which should follow the
baseline's (the host's Adam keeps float32 state as the GPU's does).

Run on a GPU machine from the repository root:
    python3 benchmarks/optimizer_offload.py --model llama-1b --seq 4096 --microbatches 2 \\
        --fractions 0,0.5,1 --steps 6 [--model-override num_layers=28 ...] --out DIR
Writes DIR/optimizer_offload_<model>_seq<N>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offload_benchmark as bench  # noqa: E402


def optimizer_settings(fraction: float) -> dict[str, Any]:
    """The optimizer section of a case: NeMo-RL's base settings (the distributed optimizer,
    precision-aware: what megatron-core's hybrid CPU optimizer runs through) with ``fraction``
    of the state on the host. At 0 (the baseline) nothing is offloaded, and without Transformer
    Engine the distributed optimizer runs (``apply.precision_aware_optimizer``)."""
    optimizer: dict[str, Any] = {
        "optimizer": "adam",
        "lr": 1e-6,
        "min_lr": 1e-6,
        "use_distributed_optimizer": True,
        "use_precision_aware_optimizer": True,
    }
    if fraction > 0:
        optimizer.update(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction)
    return optimizer


def case_section(
    model: str, seq: int, fraction: float, model_overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    section = bench.section_for(model, seq, {}, model_overrides=model_overrides)
    section["megatron_cfg"]["optimizer"] = optimizer_settings(fraction)
    return section


def summarize(fraction: float, steps: list[dict[str, float]]) -> dict[str, Any]:
    """A case's row from its steps' metrics: medians over the steps after the first (which
    allocates the optimizer's state), the highest peak, the losses."""
    timed = steps[1:] or steps
    step = statistics.median(s["step_time_s"] for s in timed)
    fwd_bwd = statistics.median(s["fwd_bwd_time_s"] for s in timed)
    return {
        "fraction": fraction,
        "step_time_s": step,
        "fwd_bwd_time_s": fwd_bwd,
        "optimizer_time_s": step - fwd_bwd,
        "peak_gpu_memory_gib": max(s["peak_gpu_memory_gib"] for s in steps),
        "between_steps_gpu_memory_gib": steps[-1]["gpu_memory_gib"],
        "losses": [s["loss"] / max(s["num_tokens"], 1) for s in steps],
    }


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row against the first (the baseline): the step's and the optimizer's time ratio,
    the memory saved, and the largest relative difference of the losses."""
    base = rows[0]
    out = []
    for row in rows:
        if "failed" in row:
            out.append(row)
            continue
        drift = max(
            abs(a - b) / max(abs(b), 1e-12)
            for a, b in zip(row["losses"], base["losses"], strict=True)
        )
        out.append(
            {
                **row,
                "step_time_x": row["step_time_s"] / base["step_time_s"],
                "optimizer_time_x": row["optimizer_time_s"] / max(base["optimizer_time_s"], 1e-9),
                "between_steps_saved_gib": base["between_steps_gpu_memory_gib"]
                - row["between_steps_gpu_memory_gib"],
                "peak_saved_gib": base["peak_gpu_memory_gib"] - row["peak_gpu_memory_gib"],
                "max_loss_rel_diff": drift,
            }
        )
    return out


def run_case(args: argparse.Namespace, fraction: float) -> dict[str, Any]:
    """One case in this process (the child :func:`main` starts): its steps' row. A failure
    (out of memory, a refused setting) raises; ``offload_benchmark.write_case_record`` makes it
    the case's record."""
    from nemo_rl_offload.config.model_presets import architecture_for

    section = case_section(args.model, args.seq, fraction, bench.parse_model_overrides(args))
    errors = bench.check_section(section)
    if errors:
        raise SystemExit("rejected: " + "; ".join(errors))
    vocab = architecture_for(args.model).vocab_size
    data = bench.batches(args.steps, args.microbatches, 1, args.seq, vocab)
    worker = bench.build_worker(section, True)
    try:
        steps = [worker.train(step, {"name": "nll"}) for step in data]
    finally:
        worker.close()
    return summarize(fraction, steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--fractions", default="0,0.5,1")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--model-override",
        action="append",
        default=[],
        help="KEY=VALUE: a TransformerConfig field for every case (e.g. num_layers=28)",
    )
    parser.add_argument("--one-case", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one_case is not None:  # the child: one case, its record (or failure) in --record
        fraction = args.one_case
        return bench.write_case_record(
            Path(args.record), str(fraction), optimizer_settings(fraction),
            lambda: run_case(args, fraction),
        )  # fmt: skip
    fractions = [float(f) for f in args.fractions.split(",")]
    if fractions[0] != 0:
        fractions.insert(0, 0.0)  # the baseline first
    rows = []
    for fraction in fractions:
        # One process per case (the allocator starts empty), as the offload benchmark runs.
        target = out / f".case_{fraction}.json"
        command = [
            sys.executable, __file__, *sys.argv[1:],
            f"--one-case={fraction}", f"--record={target}",
        ]  # fmt: skip
        record = bench.run_child(command, target, str(fraction), optimizer_settings(fraction))
        rows.append({**record, "fraction": fraction})
    if "failed" in rows[0]:
        print(f"baseline failed: {rows[0]['failed']}", file=sys.stderr)
        results = rows
    else:
        results = compare(rows)
    print("| fraction | step s | x | optimizer s | x | peak GiB | between steps GiB | loss diff |")
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        if "failed" in row:
            print(f"| {row['fraction']} | failed: {row['failed']} |||||||")
            continue
        print(
            f"| {row['fraction']} | {row['step_time_s']:.3f} | {row.get('step_time_x', 1):.2f} | "
            f"{row['optimizer_time_s']:.3f} | {row.get('optimizer_time_x', 1):.2f} | "
            f"{row['peak_gpu_memory_gib']:.2f} | {row['between_steps_gpu_memory_gib']:.2f} | "
            f"{row.get('max_loss_rel_diff', 0):.1e} |"
        )
    target = out / f"optimizer_offload_{args.model}_seq{args.seq}.json"
    target.write_text(
        json.dumps(
            {"environment": bench.environment(), "command": sys.argv, "cases": results}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
