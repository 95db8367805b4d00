"""The long-context matrix's summary (docs/offloading.md, "Choosing a plan at long context"):
per length and case, from results of benchmarks/long_context_matrix.sh (offload_benchmark.py
JSON files), the forward-backward and whole-step peaks (the optimizer step has its own peak),
the activation peak and the share of it removed against the step without offloading where
that ran, the forward-backward time, tokens per second per GPU, model FLOPs utilization
(models/flops.py: recompute is time, not model FLOPs) and the speed against full recompute.

    python3 benchmarks/long_context_table.py RESULTS.json [RESULTS.json ...] > TABLE.md

A results file names its recipe and overrides (``recipe``, ``recipe_overrides``); the model's
FLOPs come from the policy they load, on this machine's CPU.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def step_flops(payload: dict[str, Any]) -> float:
    """Model FLOPs of one benchmark step (``microbatches`` x ``rows`` sequences of ``seq``),
    as the algorithms count them for their throughput metrics (:class:`StepMeter`)."""
    from nemo_rl_offload.algorithms.throughput import StepMeter
    from nemo_rl_offload.preflight import load_and_check

    report = load_and_check(payload["recipe"], payload.get("recipe_overrides", []))
    if report.errors:
        raise SystemExit("\n".join(report.errors))
    sequences = int(payload["microbatches"]) * int(payload.get("rows") or 1)
    meter = StepMeter.for_policy(report.policies["policy"], gpus=1)
    return meter.training_flops([int(payload["seq"])] * sequences)


def _later(record: dict[str, Any]) -> list[dict[str, Any]]:
    steps = record.get("steps") or []
    return steps[1:] or steps


def rows(payload: dict[str, Any], peak_flops: float) -> list[dict[str, Any]]:
    """One summary row per case of a results payload (failed cases keep their reason)."""
    records = payload["cases"]
    flops = step_flops(payload)
    tokens = int(payload["microbatches"]) * int(payload.get("rows") or 1) * int(payload["seq"])
    by_name = {r["case"]: r for r in records}
    recompute = by_name.get("recompute_full", {}).get("fwd_bwd_s")
    plain = by_name.get("no_offload", {})
    plain_activations = (
        statistics.median(s["peak_activation_gpu_memory_gib"] for s in _later(plain))
        if "peak_gib" in plain
        else None
    )
    out = []
    for r in records:
        row: dict[str, Any] = {"seq": payload["seq"], "case": r["case"]}
        if "peak_gib" not in r:
            row["failed"] = r.get("failed") or "; ".join(r.get("rejected", [])) or "no result"
            out.append(row)
            continue
        later = _later(r)
        activations = statistics.median(s["peak_activation_gpu_memory_gib"] for s in later)
        seconds = r["fwd_bwd_s"]
        row.update(
            peak_gib=r["peak_gib"],
            step_peak_gib=max(s.get("peak_gpu_memory_gib", r["peak_gib"]) for s in later),
            activation_gib=activations,
            removed=1 - activations / plain_activations if plain_activations else None,
            fwd_bwd_s=seconds,
            tokens_per_s=tokens / seconds,
            mfu=flops / seconds / peak_flops if peak_flops else None,
            vs_recompute=recompute / seconds if recompute else None,
        )
        out.append(row)
    return out


def markdown(all_rows: list[dict[str, Any]]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        "| tokens | case | fwd-bwd peak GiB | step peak GiB | activation peak GiB "
        "| removed | fwd-bwd s | tokens/s/GPU | MFU | x full recompute |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in all_rows:
        if "failed" in r:
            lines.append(f"| {r['seq']} | {r['case']} | {r['failed']} ||||||||")
            continue
        lines.append(
            f"| {r['seq']} | {r['case']} | {r['peak_gib']:.2f} | {r['step_peak_gib']:.2f} "
            f"| {r['activation_gib']:.2f} | {num(r['removed'], '.0%')} | {r['fwd_bwd_s']:.3f} "
            f"| {r['tokens_per_s']:,.0f} | {num(r['mfu'], '.1%')} "
            f"| {num(r['vs_recompute'], '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-4], file=sys.stderr)
        return 2
    from nemo_rl_offload.models.flops import peak_bf16_flops

    all_rows: list[dict[str, Any]] = []
    for path in argv:
        payload = json.loads(Path(path).read_text())
        if "recipe" not in payload:
            print(f"{path}: names no recipe (a results file of --recipe runs)", file=sys.stderr)
            return 2
        gpu = (payload.get("environment", {}).get("gpus") or [""])[0]
        all_rows += rows(payload, peak_bf16_flops(gpu))
    print(markdown(all_rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
