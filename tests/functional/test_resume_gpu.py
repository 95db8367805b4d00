"""A stopped run resumes within the spread of two identical runs, with the distributed optimizer
in bfloat16 (the exemplar recipes' setting), through the CLI: on one GPU and at data parallel 2
on two GPUs; and a checkpoint written at tensor parallel 2 resumes at tensor parallel 1.

CPU runs compare bitwise (tests/functional/test_resume_cpu.py); a GPU's kernels may differ
between two identical runs, so the resumed run's losses must differ from an uninterrupted run's
by no more than a second uninterrupted run's do (bitwise when those two agree bitwise).
Results go to $NEMO_RL_OFFLOAD_RESULTS (a directory) when set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.gpu_results import write_results

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
TINY_SFT = REPO / "examples" / "configs" / "tiny" / "sft.yaml"
IN_BF16_WITH_THE_DISTRIBUTED_OPTIMIZER = [
    "policy.precision=bfloat16",
    "policy.megatron_cfg.pipeline_dtype=bfloat16",
    "policy.megatron_cfg.optimizer.bf16=true",
    "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
    "sft.val_period=0",
    "sft.val_at_start=false",
    "checkpointing.save_period=3",
]
# A tensor-parallel change moves each step's rounding; the resumed steps of that test must stay
# this close (relative) to the uninterrupted run's.
TP_CHANGE_RELATIVE_GAP = 0.01


def _needs_gpus(count: int) -> None:
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA GPUs")


def _sft(root: Path, steps: int, *overrides: str, expect: int = 0) -> Any:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_rl_offload.cli",
            "sft",
            "--config",
            str(TINY_SFT),
            *IN_BF16_WITH_THE_DISTRIBUTED_OPTIMIZER,
            *overrides,
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
    assert done.returncode == expect, done.stderr[-4000:]
    return done


def _losses(root: Path) -> dict[int, float]:
    lines = (root / "logs" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["phase"] == "train"}


@pytest.mark.parametrize("gpus", [1, 2], ids=["one_gpu", "dp2"])
def test_distributed_optimizer_resume_within_the_spread_of_identical_runs(gpus, tmp_path):
    _needs_gpus(gpus)
    layout = [f"cluster.gpus_per_node={gpus}"]
    first, second, stopped = tmp_path / "first", tmp_path / "second", tmp_path / "stopped"
    for root in (first, second):
        _sft(root, 6, *layout)
    _sft(stopped, 3, *layout)
    _sft(stopped, 6, *layout)  # resumes from step 3
    a, b, resumed = _losses(first), _losses(second), _losses(stopped)
    assert sorted(resumed) == sorted(a) == list(range(1, 7))
    spread = max(abs(a[step] - b[step]) for step in a)
    gaps = {step: abs(resumed[step] - a[step]) for step in a}
    write_results(
        f"resume_distributed_optimizer_{'dp2' if gpus == 2 else 'one_gpu'}",
        {"layout": layout, "first": a, "second": b, "resumed": resumed, "spread": spread},
    )
    assert max(gaps.values()) <= spread, (gaps, spread)


def test_a_tensor_parallel_checkpoint_resumes_at_tensor_parallel_one(tmp_path):
    """Saved at TP 2 after 3 steps with the plain optimizer, resumed at TP 1 (weights and Adam's
    state resharded by dist_checkpointing): steps 4-6 follow the uninterrupted TP 2 run. With
    the distributed optimizer (its ``dp_reshardable`` state reshards over data-parallel sizes
    only) the same resume is refused in one line naming the setting, exit 2."""
    _needs_gpus(2)
    tp2 = ["cluster.gpus_per_node=2", "policy.megatron_cfg.tensor_model_parallel_size=2"]
    tp1 = ["cluster.gpus_per_node=1", "policy.megatron_cfg.tensor_model_parallel_size=1"]
    plain = ["policy.megatron_cfg.optimizer.use_distributed_optimizer=false"]
    uninterrupted, stopped, refused = (tmp_path / n for n in ("uninterrupted", "stopped", "dist"))
    _sft(uninterrupted, 6, *tp2, *plain)
    _sft(stopped, 3, *tp2, *plain)
    _sft(stopped, 6, *tp1, *plain)  # resumes from step 3 at TP 1
    a, resumed = _losses(uninterrupted), _losses(stopped)
    assert sorted(resumed) == sorted(a) == list(range(1, 7))
    gaps = {step: abs(resumed[step] - a[step]) / abs(a[step]) for step in (4, 5, 6)}
    _sft(refused, 3, *tp2)
    done = _sft(refused, 6, *tp1, expect=2)
    message = [line for line in done.stderr.splitlines() if "tensor_model_parallel_size" in line]
    write_results(
        "resume_tp2_at_tp1",
        {
            "uninterrupted_tp2": a,
            "stopped_tp2_resumed_tp1": resumed,
            "relative_gaps": gaps,
            "distributed_optimizer_refusal": message,
        },
    )
    assert max(gaps.values()) <= TP_CHANGE_RELATIVE_GAP, gaps
    assert len(message) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
