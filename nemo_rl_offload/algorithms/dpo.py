"""Direct preference optimisation: raise the chosen response's likelihood ratio to the frozen
reference policy above the rejected one's (sigmoid loss with beta).

Each preference pair becomes two adjacent rows (chosen, rejected) of one micro-batch, so a
micro-batch of ``train_micro_batch_size`` pairs has twice as many rows.

Run: ``nemo-rl-offload dpo --config examples/configs/tiny/dpo.yaml``
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from nemo_rl_offload.algorithms import batching, loop
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.common import Run, prepare, token_sequence
from nemo_rl_offload.config.batch_checks import check_batch_sizes
from nemo_rl_offload.distributed import sharding
from nemo_rl_offload.policy.policy_group import PolicyGroup, holds_reference
from nemo_rl_offload.preflight import Report


def encode_pairs(run: Run, split: str) -> list[tuple[TokenSequence, ...]]:
    """One split's preference pairs: (chosen, rejected), sharing their prompt."""
    pairs = []
    for e in run.examples("preference", split):
        assert e.rejected_ids is not None, "preference examples carry the rejected response"
        rejected = dataclasses.replace(e, input_ids=list(e.rejected_ids), rejected_ids=None)
        pairs.append((token_sequence(e), token_sequence(rejected)))
    return pairs


def sequence_logprobs(arrays: list[np.ndarray], mbs: list[dict], average: bool) -> list:
    out = []
    for array, mb in zip(arrays, mbs, strict=True):
        total = (array * mb["loss_mask"]).sum(axis=-1)
        if average:
            total = total / np.maximum(mb["loss_mask"].sum(axis=-1), 1)
        out.append(total.astype(np.float32))
    return out


def with_reference(run: Run, policy: PolicyGroup, pairs: list, micro: int, average: bool):
    """Training micro-batches of ``micro`` pairs, each carrying the reference policy's
    sequence logprobs, computed in micro-batches of ``policy.logprob_batch_size`` rows."""
    rows = [seq for pair in pairs for seq in pair]
    mbs = batching.microbatches(rows, 2 * micro, pad_id=run.tokenizer.pad_id, round_to=run.round_to)

    def reference(forward: list[dict]) -> list[np.ndarray]:
        logprobs = policy.token_logprobs(forward, reference=True)
        return sequence_logprobs(logprobs, forward, average)

    batching.attach_rows(mbs, "reference_sequence_logprobs", run.forward_only(rows, reference))
    return mbs


def evaluate(run: Run, policy: PolicyGroup, pairs: list, rows: int, spec: dict) -> dict:
    """Held-out preference accuracy and DPO loss (forward passes only, ``rows`` per
    micro-batch)."""
    if not pairs:
        return {}
    average = bool(spec["preference_average_log_probs"])
    sequences = [seq for pair in pairs for seq in pair]
    mbs = batching.microbatches(sequences, rows, pad_id=run.tokenizer.pad_id, round_to=run.round_to)
    reference = np.concatenate(
        sequence_logprobs(policy.token_logprobs(mbs, reference=True), mbs, average)
    )
    current = np.concatenate(sequence_logprobs(policy.token_logprobs(mbs), mbs, average))
    chosen, rejected = current[0::2], current[1::2]
    margin = spec["beta"] * ((chosen - reference[0::2]) - (rejected - reference[1::2]))
    # Pairs cut by data.max_input_seq_length (no token counts) are no held-out pairs.
    counted = np.concatenate([mb["loss_mask"].sum(axis=-1) for mb in mbs])[0::2] > 0
    margin = margin[counted]
    if not margin.size:
        return {}
    return {
        "val_preference_accuracy": float((margin > 0).mean()),
        "val_loss": float(np.mean(np.logaddexp(0.0, -margin))),
    }


def run_dpo(report: Report, *, started: float | None = None) -> int:
    """Run dpo on a recipe checked for it (:func:`nemo_rl_offload.planning.plan_at_start.checked`);
    ``started``: when the command started, for checkpointing.checkpoint_must_save_by."""
    run = prepare(report, "dpo", started=started)
    return loop.drive(run, start)


def start(run: Run) -> loop.Steps:
    """Load the pairs, start the workers (with the reference), and give the loop DPO's step
    body."""
    schedule = run.settings.schedule
    seed = schedule.seed
    train = encode_pairs(run, "train")
    val = encode_pairs(run, "val")
    val = val[: schedule.val_examples]
    run.connect()
    policy = run.start_group(
        "policy", seed=seed, trainable=True, with_reference=holds_reference(run.recipe, "dpo")
    )
    gbs = run.policy_settings.train_global_batch_size
    check_batch_sizes(gbs, run.batching(), policy.dp_size)
    run.restore(policy, [chosen for chosen, _ in train])
    assert run.settings.dpo is not None
    spec = run.settings.dpo.loss_spec()
    micro = run.batching().train_rows
    # Validation is forward-only: val_micro_batch_size pairs, else logprob_batch_size rows.
    val_pairs = schedule.val_micro_batch_size
    val_rows = 2 * val_pairs if val_pairs else run.logprob_rows()
    sampler = run.sampler(len(train), seed)

    def train_step(step: int) -> loop.TrainResult:
        start = time.perf_counter()
        pairs = [train[i] for i in sampler.take(gbs)]
        run.progress.start("reference log-probabilities", 2 * len(pairs), unit="sequences")
        mbs = with_reference(run, policy, pairs, micro, spec["preference_average_log_probs"])
        run.progress.start("training", len(pairs), unit="pairs")
        metrics = policy.train(sharding.split(mbs, policy.dp_size), spec)
        elapsed = time.perf_counter() - start
        metrics.pop("num_pairs", None)
        return loop.TrainResult(
            metrics,
            elapsed=elapsed,
            tokens=sum(len(s.ids) for p in pairs for s in p),
            per_count={
                "preference_accuracy": "preference_accuracy_sum",
                "reward_margin": "reward_margin_sum",
            },
            values=run.truncated([pair[0] for pair in pairs]),
        )

    return loop.Steps(
        policy,
        sampler,
        train_step,
        validate=lambda step: evaluate(run, policy, val, val_rows, spec),
        schedule=schedule,
    )
