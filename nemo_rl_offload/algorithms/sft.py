"""Supervised fine-tuning: token negative log-likelihood of the responses.

Run: ``nemo-rl-offload sft --config examples/configs/tiny/sft.yaml``
"""

from __future__ import annotations

import time

from nemo_rl_offload.algorithms import batching, loop
from nemo_rl_offload.algorithms.common import (
    Run,
    mean,
    prepare,
)
from nemo_rl_offload.config.batch_checks import check_batch_sizes
from nemo_rl_offload.policy.policy_group import PolicyGroup
from nemo_rl_offload.preflight import Report


def evaluate_nll(run: Run, policy: PolicyGroup, sequences: list, micro: int) -> float:
    if not sequences:
        return float("nan")
    mbs = batching.microbatches(
        sequences, micro, pad_id=run.tokenizer.pad_id, round_to=run.round_to
    )
    logprobs = policy.token_logprobs(mbs)
    total = sum(float(-(lp * mb["loss_mask"]).sum()) for lp, mb in zip(logprobs, mbs, strict=True))
    count = sum(float(mb["loss_mask"].sum()) for mb in mbs)
    return mean(total, count)


def run_sft(report: Report, *, started: float | None = None) -> int:
    """Run sft on a recipe checked for it (:func:`nemo_rl_offload.planning.plan_at_start.checked`);
    ``started``: when the command started, for checkpointing.checkpoint_must_save_by."""
    run = prepare(report, "sft", started=started)
    return loop.drive(run, start)


def start(run: Run) -> loop.Steps:
    """Load the data, start the workers, and give the loop SFT's step body."""
    schedule = run.settings.schedule
    train = run.encode("sft", "train")
    val = run.encode("sft", "val")
    val = val[: schedule.val_examples]
    run.connect()
    policy = run.start_group("policy", seed=schedule.seed, trainable=True)
    gbs = run.policy_settings.train_global_batch_size
    check_batch_sizes(gbs, run.batching(), policy.dp_size)
    run.restore(policy, train)
    sampler = run.sampler(len(train), schedule.seed)
    # Validation is a forward-only pass: val_micro_batch_size, else logprob_batch_size.
    val_micro = schedule.val_micro_batch_size or run.logprob_rows()

    def train_step(step: int) -> loop.TrainResult:
        batch = [train[i] for i in sampler.take(gbs)]
        shards = run.training_batches(batch, policy.dp_size).shards
        start = time.perf_counter()
        run.progress.start("training", len(batch), unit="sequences")
        metrics = policy.train(shards, {"name": "nll"})
        return loop.TrainResult(
            metrics,
            elapsed=time.perf_counter() - start,
            tokens=sum(len(seq.ids) for seq in batch),
            values={"epoch": sampler.epoch, **run.truncated(batch)},
        )

    return loop.Steps(
        policy,
        sampler,
        train_step,
        validate=lambda step: {"val_loss": evaluate_nll(run, policy, val, val_micro)},
        schedule=schedule,
    )
