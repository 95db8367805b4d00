"""Supervised fine-tuning: token negative log-likelihood of the responses.

Run: ``nemo-rl-offload sft --config examples/configs/tiny/sft.yaml``
"""

from __future__ import annotations

import time

from nemo_rl_offload.algorithms import batching
from nemo_rl_offload.algorithms.common import (
    Run,
    mean,
    prepare,
)
from nemo_rl_offload.config.batch_checks import check_batch_sizes
from nemo_rl_offload.data.datasets import load_split
from nemo_rl_offload.models.policy_group import PolicyGroup
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
    """Run sft on a recipe checked for it (:func:`nemo_rl_offload.plan_at_start.checked`);
    ``started``: when the command started, for checkpointing.checkpoint_must_save_by."""
    run = prepare(report, "sft", total_steps_key="max_num_steps", started=started)
    policy = None
    try:
        cfg, data_cfg, policy_cfg = run.recipe["sft"], run.recipe["data"], run.policy_cfg
        train = run.encode(load_split(data_cfg, "sft", "train"), "train")
        val = run.encode(load_split(data_cfg, "sft", "val"), "val")
        val = val[: int(cfg.get("val_batches", 8)) * int(cfg.get("val_global_batch_size", 32))]
        run.connect()
        policy = run.start_group("policy", seed=int(cfg["seed"]), trainable=True)
        check_batch_sizes(policy_cfg, policy.dp_size)
        run.restore(policy)
        sampler = run.sampler(len(train), int(cfg["seed"]))
        gbs = int(policy_cfg["train_global_batch_size"])
        # Validation is a forward-only pass: val_micro_batch_size, else logprob_batch_size.
        val_micro = int(cfg.get("val_micro_batch_size") or run.logprob_rows())
        if cfg.get("val_at_start") and run.start_step == 0:
            run.logger.log(0, {"val_loss": evaluate_nll(run, policy, val, val_micro)}, phase="val")
        for step in run.steps():
            if sampler.epoch >= int(cfg["max_num_epochs"]):
                break
            batch = [train[i] for i in sampler.take(gbs)]
            shards = run.training_batches(batch, policy.dp_size).shards
            start = time.perf_counter()
            metrics = policy.train(shards, {"name": "nll"})
            elapsed = time.perf_counter() - start
            run.log_train_step(
                step,
                metrics,
                elapsed=elapsed,
                tokens=sum(len(seq.ids) for seq in batch),
                epoch=sampler.epoch,
                **run.truncated(batch),
            )
            run.end_step(
                step,
                policy,
                sampler.position,
                val_period=int(cfg["val_period"]),
                data_done=sampler.epoch >= int(cfg["max_num_epochs"]),
                validate=lambda: {"val_loss": evaluate_nll(run, policy, val, val_micro)},
            )
        run.finish(policy)
        return 0
    finally:
        if policy is not None:
            policy.shutdown()
        run.close()
