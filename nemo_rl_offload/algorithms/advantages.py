"""GRPO's advantages, as NeMo-RL's ``grpo`` advantage estimator computes them, so that a
NeMo-RL recipe trains on the same numbers here.

Each sample gets a baseline and a standard deviation from the samples of its prompt (samples
are grouped by their prompt's tokens, as NeMo-RL groups them). With the leave-one-out
baseline both are those of the *other* samples of the prompt; the advantage is the reward
minus the baseline, divided (``normalize``) by that standard deviation plus 1e-6 wherever
the standard deviation is not exactly 0, and left as it is where it is. A prompt with one
sample gets baseline = reward, so advantage 0.

The sums go through a 0/1 matrix and the variance is the mean of squares minus the squared
mean, in the rewards' float32, the steps NeMo-RL takes: a near-constant group rounds to the
same tiny (but non-zero, hence normalised) spread as there.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Added to the standard deviation before dividing by it (NeMo-RL's estimator's epsilon).
EPSILON = 1e-6


@dataclass(frozen=True)
class AdvantageSettings:
    """``grpo.adv_estimator.normalize_rewards`` and ``use_leave_one_out_baseline``."""

    normalize: bool = True
    leave_one_out: bool = True

    @classmethod
    def from_recipe(cls, grpo: Mapping[str, Any]) -> AdvantageSettings:
        """Read as NeMo-RL reads them: from ``grpo.adv_estimator``, each absent key at the
        estimator's default (true). ``grpo.normalize_rewards`` and
        ``grpo.use_leave_one_out_baseline`` reach the advantages only through the section
        (NeMo-RL's recipes interpolate them into it)."""
        section = grpo.get("adv_estimator") or {}
        return cls(
            normalize=bool(section.get("normalize_rewards", True)),
            leave_one_out=bool(section.get("use_leave_one_out_baseline", True)),
        )


def prompt_indices(keys: Sequence[Hashable]) -> list[list[int]]:
    """The sample indices of each distinct key (a prompt's tokens), in order of first
    appearance."""
    found: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        found.setdefault(key, []).append(index)
    return list(found.values())


def baseline_and_std(
    rewards: torch.Tensor, keys: Sequence[Hashable], *, leave_one_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's baseline and standard deviation (Bessel-corrected) over its prompt's
    samples, or over the others with ``leave_one_out``. A prompt of one sample: baseline =
    reward, std 0; a leave-one-out spread of a single other sample is 0."""
    if len(keys) != rewards.shape[0]:
        raise ValueError(f"{len(keys)} prompt keys for {rewards.shape[0]} rewards")
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for picked in prompt_indices(keys):
        index = torch.tensor(picked, dtype=torch.long, device=rewards.device)
        own = rewards[index]
        size = len(picked)
        if size <= 1:
            baseline[index] = own
            continue
        weights = torch.ones(size, size, dtype=rewards.dtype, device=rewards.device)
        if leave_one_out:
            weights -= torch.eye(size, dtype=rewards.dtype, device=rewards.device)
        # float32 counts, so that one other sample gives 0 * inf = nan -> 0, as in NeMo-RL
        count = torch.tensor(float(size - int(leave_one_out)), device=rewards.device)
        mean = torch.matmul(weights, own) / count
        mean_square = torch.matmul(weights, own.pow(2)) / count
        variance = (mean_square - mean.square()) * (count / (count - 1))
        baseline[index] = mean
        std[index] = variance.sqrt().nan_to_num(0)
    return baseline, std


def group_advantages(
    rewards: torch.Tensor, keys: Sequence[Hashable], settings: AdvantageSettings
) -> torch.Tensor:
    """One advantage per sample (rewards [samples], ``keys`` each sample's prompt): reward
    minus baseline, normalised where the standard deviation is not 0 (a group of one right
    answer among 16 gives it 1.0 with leave-one-out: the others' spread is 0)."""
    baseline, std = baseline_and_std(rewards, keys, leave_one_out=settings.leave_one_out)
    advantages = rewards - baseline
    if settings.normalize:
        spread = std > 0
        advantages[spread] = advantages[spread] / (std[spread] + EPSILON)
    return advantages
