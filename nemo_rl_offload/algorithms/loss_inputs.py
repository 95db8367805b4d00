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
    sequences: Sequence[TokenSequence],
    generation: Sequence[np.ndarray],
    old: Sequence[np.ndarray],
    rewards: Sequence[float],
    threshold: float | None,
) -> tuple[dict[str, float], list[int]]:
    """NeMo-RL's per-sequence multiplicative probability error (the mean over a sequence's
    response tokens of exp(|generation - training log-probability|)): its max, mean and min
    over the sequences that train, and, with ``threshold``, the indices of the sequences above
    it, which leave the step (the caller sets their loss multiplier to 0, as NeMo-RL's sample
    mask does). Per sequence, before the micro-batches are laid out, so that it holds for padded
    rows, packs and token-budgeted batches alike."""
    errors, live = [], []
    for sequence, gen, prev in zip(sequences, generation, old, strict=True):
        mask = sequence.label_mask()
        n = len(mask)
        diff = np.abs(
            np.asarray(gen, dtype=np.float64)[:n] - np.asarray(prev, dtype=np.float64)[:n]
        )
        tokens = float(mask.sum())
        errors.append(float((np.exp(diff * mask) * mask).sum()) / max(tokens, 1.0))
        live.append(tokens > 0)
    error, valid = torch.tensor(errors), torch.tensor(live, dtype=torch.bool)
    metrics = _spread("seq_mult_prob_error", error[valid])
    if threshold is None:
        return metrics, []
    dropped = valid & (error > threshold)
    reward = torch.tensor(list(rewards), dtype=torch.float)
    masked = int(dropped.sum())
    metrics["num_masked_seqs_by_logprob_error"] = float(masked)
    metrics["masked_correct_pct"] = float((reward[dropped] == 1).sum()) / masked if masked else 0.0
    metrics.update(_spread("seq_mult_prob_error", error[valid & ~dropped], "_after_mask"))
    return metrics, torch.nonzero(dropped).flatten().tolist()


def _spread(name: str, values: torch.Tensor, suffix: str = "") -> dict[str, float]:
    if values.numel() == 0:
        return {f"{kind}_{name}{suffix}": 0.0 for kind in ("max", "mean", "min")}
    return {
        f"max_{name}{suffix}": float(values.max()),
        f"mean_{name}{suffix}": float(values.mean()),
        f"min_{name}{suffix}": float(values.min()),
    }


def positive_nll_scale(
    sequences: Sequence[TokenSequence], rewards: Sequence[float], *, token_level: bool
) -> float:
    """``loss_fn.positive_example_nll_weight``: the scale that makes the NLL term of the
    positive examples (reward > 0) a mean over the step's positive tokens once the step divides
    by its count (tokens, or sequences with ``token_level_loss`` false). NeMo-RL takes that mean
    per micro-batch; over a whole step it is the same when the step is one micro-batch. The
    rewards and this scale go on the micro-batches (``rewards``, ``positive_nll_scale``)."""
    positive_tokens, count = 0.0, 0.0
    for sequence, reward in zip(sequences, rewards, strict=True):
        tokens = float(sequence.label_mask().sum())
        positive_tokens += tokens if reward > 0 else 0.0
        count += tokens if token_level else float(tokens > 0)
    return count / positive_tokens if positive_tokens else 0.0
