"""GRPO with NeMo-RL's loss options through the CLI (local Ray, 2 CPU workers, untrained tiny
model, two steps): the sampler's log-probabilities reach the loss aligned with the training
forward's (their error metrics are 1 and the importance weights 1), and per-sequence averaging
makes the step count sequences."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "examples" / "configs" / "tiny" / "grpo.yaml"
PROMPTS, GENERATIONS = 4, 8


def test_gspo_with_truncated_importance_sampling_runs_on_the_sampler_logprobs(tmp_path):
    overrides = [
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
        "checkpointing.enabled=false",
        "policy.init_checkpoint=null",
        "grpo.max_num_steps=2",
        "grpo.val_period=2",
        "grpo.val_at_start=false",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        f"grpo.num_prompts_per_step={PROMPTS}",
        f"grpo.num_generations_per_prompt={GENERATIONS}",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "++loss_fn.sequence_level_importance_ratios=true",
        "loss_fn.token_level_loss=false",
        "loss_fn.use_importance_sampling_correction=true",
        "++loss_fn.truncated_importance_sampling_type=tis",
        "++loss_fn.truncated_importance_sampling_ratio=2",
        "++grpo.seq_logprob_error_threshold=2.0",
        "++loss_fn.positive_example_nll_weight=0.1",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "nemo_rl_offload.cli", "grpo", "--config", str(GRPO), *overrides],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert record["num_tokens"] == PROMPTS * GENERATIONS  # sequences, not tokens
        # Sampler and training forward agree (same weights, float32): a misaligned or missing
        # generation log-probability would move these far from 1.
        assert record["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
        assert record["max_seq_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
        assert record["sampling_importance_ratio"] == pytest.approx(1.0, abs=1e-3)
        assert record["num_masked_seqs_by_logprob_error"] == 0
        assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
