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


def _write(directory: Path, name: str, step: float, vs_plain: float, steps=None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    run = {"median_step_time_s": step, "step_time_s_vs_plain": vs_plain}
    summary = {"fgo_graph_1": run, "plain_spread": 0.0}
    payload = {"summary": summary, "runs": {"fgo_graph_1": steps or []}}
    (directory / f"{name}.json").write_text(json.dumps(payload))


def test_the_table_pairs_each_run_of_both_trees(tmp_path):
    _write(tmp_path / "before", "cuda_graphs_sft", 0.30, 0.50)
    _write(tmp_path / "after", "cuda_graphs_sft", 0.27, 0.40)
    _write(tmp_path / "after", "cuda_graphs_grpo", 0.27, 0.40)
    text = _module().table(tmp_path)
    assert (
        "| cuda_graphs_sft | fgo_graph_1 | 0.3000 | 0.2700 | 0.900 | - | +0.500 | +0.400 |" in text
    )
    assert "plain_spread" not in text
    assert "Only one tree has results for: cuda_graphs_grpo" in text


def _steps(times: list[float], replayed_from: int) -> list[dict]:
    return [
        {"step_time_s": t, "cuda_graph_replayed": float(i >= replayed_from)}
        for i, t in enumerate(times)
    ]


def test_the_paired_ratio_compares_each_replayed_step_with_the_same_step(tmp_path):
    """Steps of two shapes: the medians of the two runs fall on different shapes (a ratio of
    1.5 between identical runs), the paired ratio compares like with like (1.0); the steps
    before the replays (warm-up, capture) are left out, and results of two directories (two
    GPUs of one run) make one table."""
    before = _steps([9.0, 9.0, 1.0, 2.0, 1.0, 2.0, 2.0], replayed_from=2)
    after = _steps([5.0, 5.0, 1.0, 2.0, 1.0, 2.0, 1.0], replayed_from=2)
    module = _module()
    assert module.paired_ratio(after, before) == 1.0
    _write(tmp_path / "gpu0" / "before", "cuda_graphs_sft", 2.0, 0.5, before)
    _write(tmp_path / "gpu0" / "after", "cuda_graphs_sft", 1.0, 0.4, after)
    _write(tmp_path / "gpu1" / "before", "cuda_graphs_grpo", 0.3, 0.5, before)
    _write(tmp_path / "gpu1" / "after", "cuda_graphs_grpo", 0.3, 0.5, after)
    text = module.table(tmp_path / "gpu0", tmp_path / "gpu1")
    assert "| cuda_graphs_sft | fgo_graph_1 | 2.0000 | 1.0000 | 0.500 | 1.000 |" in text
    assert "cuda_graphs_grpo" in text and "Only one tree" not in text
