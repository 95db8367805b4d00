"""benchmarks/graphs_ab.py: the A/B table of the graphed GPU tests' results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("graphs_ab", ROOT / "benchmarks/graphs_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(directory: Path, name: str, step: float, vs_plain: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    run = {"median_step_time_s": step, "step_time_s_vs_plain": vs_plain}
    summary = {"fgo_graph_1": run, "plain_spread": 0.0}
    (directory / f"{name}.json").write_text(json.dumps({"summary": summary}))


def test_the_table_pairs_each_run_of_both_trees(tmp_path):
    _write(tmp_path / "before", "cuda_graphs_sft", 0.30, 0.50)
    _write(tmp_path / "after", "cuda_graphs_sft", 0.27, 0.40)
    _write(tmp_path / "after", "cuda_graphs_grpo", 0.27, 0.40)
    text = _module().table(tmp_path)
    assert "| cuda_graphs_sft | fgo_graph_1 | 0.3000 | 0.2700 | 0.900 | +0.500 | +0.400 |" in text
    assert "plain_spread" not in text
    assert "Only one tree has results for: cuda_graphs_grpo" in text
