"""The graphed GPU tests' step times, this tree against an earlier one, from the results of
benchmarks/graphs_ab.sh: per test and run kind, the median step and forward-backward times of
both trees, their ratio, and each tree's ratio to its own plain run (which cancels the drift
between the two processes).

    python3 benchmarks/graphs_ab.py DIR   (DIR holds before/ and after/)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _summaries(directory: Path) -> dict[str, dict]:
    return {
        path.stem: json.loads(path.read_text())["summary"]
        for path in sorted(directory.glob("cuda_graphs_*.json"))
    }


def table(root: Path) -> str:
    before, after = _summaries(root / "before"), _summaries(root / "after")
    lines = [
        "| test | run | before step s | after step s | after / before "
        "| before vs its plain | after vs its plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for test in sorted(set(before) & set(after)):
        for run, late in after[test].items():
            early = before[test].get(run)
            if not isinstance(late, dict) or not isinstance(early, dict):
                continue
            b, a = early["median_step_time_s"], late["median_step_time_s"]
            lines.append(
                f"| {test} | {run} | {b:.4f} | {a:.4f} | {a / b:.3f} "
                f"| {early['step_time_s_vs_plain']:+.3f} | {late['step_time_s_vs_plain']:+.3f} |"
            )
    missing = sorted(set(before) ^ set(after))
    if missing:
        lines.append(f"\nOnly one tree has results for: {', '.join(missing)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
