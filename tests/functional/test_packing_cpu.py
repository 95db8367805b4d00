"""Micro-batches by tokens end to end through the CLI (2 CPU workers, data-parallel 2): SFT with
sequence packing learns; GRPO from its checkpoint with packing and chunked log-probabilities
takes steps whose first ratio is exactly 1 (the log-probabilities of the forward-only packs,
of another size, match the training packs'); distillation with a packed student and a teacher
on dynamic batching brings the KL down."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from functional.test_training_cpu import TINY, cli, metrics, outputs, window_mean

PACKING = [
    "+policy.sequence_packing.enabled=true",
    "+policy.sequence_packing.train_mb_tokens=256",
]


@pytest.fixture(scope="module")
def packed_sft(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("packed_sft")
    result = cli(
        "sft",
        "--config",
        str(TINY / "sft.yaml"),
        *outputs(root),
        "sft.max_num_steps=150",
        "sft.val_period=150",
        "checkpointing.save_period=150",
        *PACKING,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return root


def test_packed_sft_loss_falls(packed_sft):
    train = metrics(packed_sft, "train")
    assert len(train) == 150
    assert window_mean(train, "loss", first=False) < 0.5 * window_mean(train, "loss", first=True)


def test_packed_grpo_with_chunked_logprobs_and_loss_options_starts_on_policy(packed_sft, tmp_path):
    """Packed GRPO with chunked log-probabilities at a sampling temperature, and NeMo-RL's
    per-sequence loss options (GSPO, per-sequence averaging, truncated importance sampling,
    the log-probability error filter, the positive examples' NLL), whose reductions must find
    each sequence inside its pack: the sampler's and the training forward's log-probabilities
    agree (their error metrics are 1, the importance weights 1) and the step counts sequences."""
    prompts, generations = 16, 16
    result = cli(
        "grpo",
        "--config",
        str(TINY / "grpo.yaml"),
        *outputs(tmp_path),
        f"policy.init_checkpoint={packed_sft / 'ckpt'}",
        "grpo.max_num_steps=3",
        "grpo.val_period=3",
        "grpo.val_at_start=false",
        "grpo.max_val_samples=8",
        "checkpointing.save_period=3",
        "policy.generation.temperature=0.8",
        "+policy.sequence_packing.enabled=true",
        "+policy.sequence_packing.train_mb_tokens=512",
        "+policy.sequence_packing.logprob_mb_tokens=1024",
        "+policy.logprob_chunk_size=5",
        "++loss_fn.sequence_level_importance_ratios=true",
        "loss_fn.token_level_loss=false",
        "loss_fn.use_importance_sampling_correction=true",
        "++loss_fn.truncated_importance_sampling_type=tis",
        "++loss_fn.truncated_importance_sampling_ratio=2",
        "++grpo.seq_logprob_error_threshold=2.0",
        "++loss_fn.positive_example_nll_weight=0.1",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    train = metrics(tmp_path, "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train)
    # Step 1: the policy is the sampler and the reference, so no ratio is clipped and the KL is 0.
    assert train[0]["clip_fraction"] == 0 and train[0]["kl"] == pytest.approx(0, abs=1e-6)
    for record in train:
        assert record["num_tokens"] == prompts * generations  # sequences, not packs or tokens
        # a misaligned, untempered or missing sampler log-probability moves these far from 1
        assert record["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
        assert record["max_seq_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
        assert record["sampling_importance_ratio"] == pytest.approx(1.0, abs=1e-3)
        assert record["num_masked_seqs_by_logprob_error"] == 0


def test_packed_distillation_kl_falls(packed_sft, tmp_path):
    result = cli(
        "distill",
        "--config",
        str(TINY / "distillation.yaml"),
        *outputs(tmp_path),
        f"teacher.init_checkpoint={packed_sft / 'ckpt'}",
        "distillation.max_num_steps=20",
        "distillation.val_period=20",
        "distillation.val_at_start=false",
        "distillation.max_val_samples=8",
        "checkpointing.save_period=20",
        "+policy.sequence_packing.enabled=true",
        "+policy.sequence_packing.train_mb_tokens=384",
        "+teacher.dynamic_batching.enabled=true",
        "+teacher.dynamic_batching.logprob_mb_tokens=512",
        "+teacher.dynamic_batching.sequence_length_round=16",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    train = metrics(tmp_path, "train")
    assert window_mean(train, "kl", first=False, size=5) < 0.6 * window_mean(
        train, "kl", first=True, size=5
    )
