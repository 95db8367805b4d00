"""The comparison table of benchmarks/two_gpu_grpo.sh: per run (one GPU twice, DP 2, TP 2, PP 2)
and step, the loss, reward, gradient norm, the sampler-vs-training log-probability error,
generation throughput, peak memory and offloaded bytes, each rank's too; and per layout, how far
its losses and rewards are from the first one-GPU run against how far the second one-GPU run is
(the spread of identical runs).

    python3 benchmarks/two_gpu_grpo.py DIR   # writes DIR/two_gpu_grpo.json and .md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RUNS = ("one_gpu_a", "one_gpu_b", "dp2", "tp2", "pp2")
KEYS = (
    "loss",
    "reward",
    "grad_norm",
    "token_mult_prob_error",
    "generation_new_tokens_per_sec_per_gpu",
    "response_tokens_mean",
    "peak_fwd_bwd_gpu_memory_gib",
    "offloaded_gib_per_step",
    "step_time_s",
)
COMPARED = ("loss", "reward", "grad_norm")


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in records if r.get("phase") == "train"]


def _per_rank(step: dict[str, Any]) -> dict[str, dict[str, float]]:
    ranks: dict[str, dict[str, float]] = {}
    for key, value in step.items():
        if key.startswith("rank") and "/" in key:
            rank, name = key.split("/", 1)
            if name in ("offloaded_gib_per_step", "peak_fwd_bwd_gpu_memory_gib"):
                ranks.setdefault(rank, {})[name] = value
    return ranks


def _gap(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> float | None:
    pairs = [(x.get(key), y.get(key)) for x, y in zip(a, b, strict=False)]
    values = [abs(x - y) for x, y in pairs if x is not None and y is not None]
    return max(values) if values else None


def main(out: Path) -> int:
    runs = {name: _steps(out / name) for name in RUNS}
    base, twin = runs["one_gpu_a"], runs["one_gpu_b"]
    spread = {key: _gap(base, twin, key) for key in COMPARED}
    report: dict[str, Any] = {"spread_of_identical_one_gpu_runs": spread, "runs": {}}
    lines = [
        "| run | step | " + " | ".join(KEYS) + " | per rank: offloaded GiB / peak GiB |",
        "|---|---|" + "---|" * len(KEYS) + "---|",
    ]
    for name, steps in runs.items():
        report["runs"][name] = {
            "steps": [{k: s.get(k) for k in KEYS} | {"ranks": _per_rank(s)} for s in steps],
            "max_gap_to_one_gpu_a": {key: _gap(base, steps, key) for key in COMPARED},
        }
        for s in steps:
            cells = [f"{s[k]:.4g}" if isinstance(s.get(k), float) else str(s.get(k)) for k in KEYS]
            ranks = ", ".join(
                f"{rank}: {v.get('offloaded_gib_per_step', 0):.2f} / "
                f"{v.get('peak_fwd_bwd_gpu_memory_gib', 0):.2f}"
                for rank, v in sorted(_per_rank(s).items())
            )
            lines.append(f"| {name} | {s.get('step')} | " + " | ".join(cells) + f" | {ranks} |")
    lines += ["", "| run | " + " | ".join(f"max gap in {k}" for k in COMPARED) + " |"]
    lines.append("|---|" + "---|" * len(COMPARED))
    for name, body in report["runs"].items():
        gaps = body["max_gap_to_one_gpu_a"]
        lines.append(
            f"| {name} | "
            + " | ".join("n/a" if gaps[k] is None else f"{gaps[k]:.3g}" for k in COMPARED)
            + " |"
        )
    (out / "two_gpu_grpo.json").write_text(json.dumps(report, indent=1))
    (out / "two_gpu_grpo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
