"""What GRPO's loss reads besides the model's output, prepared on the driver.

The sampler's log-probabilities of the generated tokens (``generation_logprobs``), NeMo-RL's
sequence log-probability error between sampler and training forward (a metric, and with
``grpo.seq_logprob_error_threshold`` a filter), and the inputs of the positive-example NLL
term. They are per-row arrays put on the training micro-batches, so the loss stays a sum over
each micro-batch divided once by the step's count (``losses`` module docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nemo_rl_offload import losses
from nemo_rl_offload.algorithms.batching import TokenSequence


def loss_spec(loss_cfg: dict[str, Any]) -> dict[str, Any]:
    """The worker-side loss settings of GRPO (``losses.make_loss_fn``)."""
    return {
        "name": "grpo",
        "ratio_clip_min": loss_cfg["ratio_clip_min"],
        "ratio_clip_max": loss_cfg["ratio_clip_max"],
        "ratio_clip_c": loss_cfg.get("ratio_clip_c"),
        "kl_penalty": losses.effective_kl_penalty(loss_cfg),
        "loss_fn": dict(loss_cfg),
    }


def generation_rows(
    sequences: Sequence[TokenSequence], logprobs: Sequence[Sequence[float]]
) -> list[np.ndarray]:
    """Each sequence's sampler log-probabilities at the positions of its labels (position t
    holds token t+1's), 0 over the prompt: the layout of the training log-probabilities."""
    rows = []
    for sequence, values in zip(sequences, logprobs, strict=True):
        row = np.zeros(len(sequence.ids) - 1, dtype=np.float32)
        start = sequence.prompt_len - 1
        row[start : start + len(values)] = values
        rows.append(row)
    return rows


def seq_logprob_error(
    mbs: list[dict[str, np.ndarray]], rewards: Sequence[float], threshold: float | None
) -> dict[str, float]:
    """NeMo-RL's per-sequence multiplicative probability error (the mean over a sequence's
    response tokens of exp(|generation - training log-probability|)): its max, mean and min
    over the sequences that train, and, with ``threshold``, every sequence above it leaves the
    step (its loss mask becomes 0), as NeMo-RL's sample mask does. Needs ``old_logprobs`` and
    ``generation_logprobs`` on ``mbs``."""
    errors, live = [], []
    for mb in mbs:
        mask = torch.from_numpy(mb["loss_mask"])
        gen = torch.from_numpy(mb["generation_logprobs"])
        old = torch.from_numpy(mb["old_logprobs"])
        error = losses.per_sequence_mean(torch.exp((gen - old).abs() * mask), mask)
        errors.append(error)
        live.append(losses.per_sequence_sum(torch.ones_like(mask), mask) > 0)
    error, valid = torch.cat(errors), torch.cat(live)
    metrics = _spread("seq_mult_prob_error", error[valid])
    if threshold is None:
        return metrics
    dropped = valid & (error > threshold)
    start = 0
    for mb in mbs:
        count = mb["loss_mask"].shape[0]
        mb["loss_mask"][dropped[start : start + count].numpy()] = 0.0
        start += count
    reward = torch.tensor(list(rewards), dtype=torch.float)
    masked = int(dropped.sum())
    metrics["num_masked_seqs_by_logprob_error"] = float(masked)
    metrics["masked_correct_pct"] = float((reward[dropped] == 1).sum()) / masked if masked else 0.0
    metrics.update(_spread("seq_mult_prob_error", error[valid & ~dropped], "_after_mask"))
    return metrics


def _spread(name: str, values: torch.Tensor, suffix: str = "") -> dict[str, float]:
    if values.numel() == 0:
        return {f"{kind}_{name}{suffix}": 0.0 for kind in ("max", "mean", "min")}
    return {
        f"max_{name}{suffix}": float(values.max()),
        f"mean_{name}{suffix}": float(values.mean()),
        f"min_{name}{suffix}": float(values.min()),
    }


def attach_positive_nll(
    mbs: list[dict[str, np.ndarray]], rewards: Sequence[float], *, token_level: bool
) -> None:
    """``loss_fn.positive_example_nll_weight``: each row's reward (positive ones are the
    examples) and the scale that makes the NLL term a mean over the step's positive tokens once
    the step divides by its count (tokens, or sequences with ``token_level_loss`` false).
    NeMo-RL takes that mean per micro-batch; over a whole step it is the same when the step is
    one micro-batch."""
    reward_rows = np.asarray(list(rewards), dtype=np.float32)
    start, positive_tokens, count = 0, 0.0, 0.0
    for mb in mbs:
        rows = mb["loss_mask"].shape[0]
        mb["rewards"] = reward_rows[start : start + rows]
        tokens = mb["loss_mask"].sum(axis=-1)
        positive_tokens += float(tokens[mb["rewards"] > 0].sum())
        count += float(tokens.sum()) if token_level else float((tokens > 0).sum())
        start += rows
    scale = count / positive_tokens if positive_tokens else 0.0
    for mb in mbs:
        mb["positive_nll_scale"] = np.full(mb["loss_mask"].shape[0], scale, dtype=np.float32)
