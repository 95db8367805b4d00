"""A stopped run resumes within the spread of two identical runs on one GPU, with the
distributed optimizer in bfloat16 (the exemplar recipes' setting), through the CLI.

CPU runs compare bitwise (tests/functional/test_resume_cpu.py); a GPU's kernels may differ
between two identical runs, so the resumed run's losses must differ from an uninterrupted run's
by no more than a second uninterrupted run's do (bitwise when those two agree bitwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
TINY_SFT = REPO / "examples" / "configs" / "tiny" / "sft.yaml"
ON_ONE_GPU = [
    "cluster.gpus_per_node=1",
    "policy.precision=bfloat16",
    "policy.megatron_cfg.pipeline_dtype=bfloat16",
    "policy.megatron_cfg.optimizer.bf16=true",
    "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
    "sft.val_period=0",
    "sft.val_at_start=false",
    "checkpointing.save_period=3",
]


def _sft(root: Path, steps: int) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_rl_offload.cli",
            "sft",
            "--config",
            str(TINY_SFT),
            *ON_ONE_GPU,
            f"sft.max_num_steps={steps}",
            f"checkpointing.checkpoint_dir={root / 'ckpt'}",
            f"logger.log_dir={root / 'logs'}",
        ],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def _losses(root: Path) -> dict[int, float]:
    lines = (root / "logs" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["phase"] == "train"}


def test_distributed_optimizer_resume_within_the_spread_of_identical_runs(tmp_path):
    first, second, stopped = tmp_path / "first", tmp_path / "second", tmp_path / "stopped"
    for root in (first, second):
        _sft(root, 6)
    _sft(stopped, 3)
    _sft(stopped, 6)  # resumes from step 3
    a, b, resumed = _losses(first), _losses(second), _losses(stopped)
    assert sorted(resumed) == sorted(a) == list(range(1, 7))
    spread = max(abs(a[step] - b[step]) for step in a)
    gaps = {step: abs(resumed[step] - a[step]) for step in a}
    results = os.environ.get("NEMO_RL_OFFLOAD_GPU_RESULTS")
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        record = {"first": a, "second": b, "resumed": resumed, "spread": spread, "gaps": gaps}
        (Path(results) / "resume_gpu.json").write_text(json.dumps(record, indent=1))
    assert max(gaps.values()) <= spread, (gaps, spread)
