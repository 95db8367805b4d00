"""The graphed GPU tests' step times, this tree against an earlier one, from the results of
benchmarks/graphs_ab.sh: per test and run kind, the median step time of both trees, their
ratio, each tree's ratio to its own plain run, and the paired ratio: the median over steps of
after/before for the same step. The tests' steps change shape (one or two micro-batches of
different lengths), so a run's median step can jump between shapes; the paired ratio compares
each step with the same step of the other tree. The runs without offloading (plain, graphs
only) run the same code in both trees: their paired ratios show how far two processes drift.

    python3 benchmarks/graphs_ab.py DIR [DIR ...]   (each DIR holds before/ and after/)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _results(directories: list[Path], tree: str) -> dict[str, dict[str, Any]]:
    return {
        path.stem: json.loads(path.read_text())
        for directory in directories
        for path in sorted((directory / tree).glob("cuda_graphs_*.json"))
    }


def paired_ratio(after: list[dict], before: list[dict]) -> float | None:
    """Median over the steps both runs replayed (all steps after the first ten for eager
    runs) of after/before step time; None when the runs have no such step in common."""
    both = [
        i
        for i in range(min(len(after), len(before)))
        if after[i].get("cuda_graph_replayed") == 1.0
        and before[i].get("cuda_graph_replayed") == 1.0
    ]
    if not both:
        both = list(range(10, min(len(after), len(before))))
    ratios = [
        after[i]["step_time_s"] / before[i]["step_time_s"]
        for i in both
        if before[i].get("step_time_s") and after[i].get("step_time_s")
    ]
    return statistics.median(ratios) if ratios else None


def table(*roots: Path) -> str:
    before, after = _results(list(roots), "before"), _results(list(roots), "after")
    lines = [
        "| test | run | before step s | after step s | after / before | paired after / before "
        "| before vs its plain | after vs its plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for test in sorted(set(before) & set(after)):
        for run, late in after[test]["summary"].items():
            early = before[test]["summary"].get(run)
            if not isinstance(late, dict) or not isinstance(early, dict):
                continue
            b, a = early["median_step_time_s"], late["median_step_time_s"]
            paired = paired_ratio(
                after[test].get("runs", {}).get(run, []), before[test].get("runs", {}).get(run, [])
            )
            lines.append(
                f"| {test} | {run} | {b:.4f} | {a:.4f} | {a / b:.3f} "
                f"| {'-' if paired is None else f'{paired:.3f}'} "
                f"| {early['step_time_s_vs_plain']:+.3f} | {late['step_time_s_vs_plain']:+.3f} |"
            )
    missing = sorted(set(before) ^ set(after))
    if missing:
        lines.append(f"\nOnly one tree has results for: {', '.join(missing)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(*(Path(arg) for arg in sys.argv[1:])))
