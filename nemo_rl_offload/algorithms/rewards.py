"""GRPO's transforms between scoring a step's responses and training on them, in NeMo-RL's
order: scale the rewards (``grpo.reward_scaling``), shape them (``grpo.reward_shaping``),
keep only the samples whose reward spread is not 0 (``grpo.use_dynamic_sampling``), take the
truncated responses out of the loss (``grpo.overlong_filtering``), and clamp the advantages
(``grpo.advantage_clip_low`` / ``advantage_clip_high``); the advantages themselves are
:mod:`nemo_rl_offload.algorithms.advantages`'.

Pure functions on plain values, so that each option's effect is testable without workers; the
recipe checks of these keys are :func:`nemo_rl_offload.config.grpo_options.check`'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_rl_offload.algorithms import advantages
from nemo_rl_offload.errors import UserInputError


def truncated(response: Sequence[int], stop_ids: Sequence[int]) -> bool:
    """Whether a response hit the length limit without ending: it does not end with a stop
    token (NeMo-RL's ``truncated``, a generation that finished for "length")."""
    return not response or response[-1] not in stop_ids


def scale_rewards(rewards: torch.Tensor, cfg: Mapping[str, Any] | None) -> torch.Tensor:
    """``grpo.reward_scaling``: clamp each reward to [source_min, source_max] and map that
    range linearly onto [target_min, target_max] (NeMo-RL's defaults 0, 1, 0, 1)."""
    if not cfg or not cfg.get("enabled"):
        return rewards
    source_min, source_max = float(cfg.get("source_min", 0.0)), float(cfg.get("source_max", 1.0))
    target_min, target_max = float(cfg.get("target_min", 0.0)), float(cfg.get("target_max", 1.0))
    clamped = rewards.clamp(min=source_min, max=source_max)
    return target_min + (clamped - source_min) / (source_max - source_min) * (
        target_max - target_min
    )


def shaping_enabled(cfg: Mapping[str, Any] | None) -> bool:
    return bool(cfg and cfg.get("enabled"))


def shape_rewards(
    rewards: torch.Tensor,
    response_lengths: Sequence[int],
    truncated_flags: Sequence[bool],
    cfg: Mapping[str, Any] | None,
) -> torch.Tensor:
    """``grpo.reward_shaping``. With ``stop_properly_penalty_coef`` set, a truncated
    response's reward is multiplied by it (the DAPO keys are then not used, as in NeMo-RL).
    Otherwise DAPO's soft overlong penalty: a response longer than ``max_response_length -
    overlong_buffer_length`` tokens loses ``overlong_buffer_penalty`` per buffer length of
    excess, linearly (never a bonus for short ones)."""
    if not shaping_enabled(cfg):
        return rewards
    assert cfg is not None
    coef = cfg.get("stop_properly_penalty_coef")
    if coef is not None:
        mask = torch.tensor(list(truncated_flags), dtype=torch.bool)
        return torch.where(mask, rewards * float(coef), rewards)
    buffer = float(cfg["overlong_buffer_length"])
    penalty = float(cfg["overlong_buffer_penalty"])
    expected = float(cfg["max_response_length"]) - buffer
    excess = torch.tensor([float(n) for n in response_lengths], dtype=rewards.dtype) - expected
    return rewards + torch.clamp(-excess / buffer * penalty, max=0.0)


def clip_advantages(
    advantages: torch.Tensor, low: float | None, high: float | None
) -> torch.Tensor:
    """``grpo.advantage_clip_low`` / ``advantage_clip_high``: clamp the (normalised)
    advantages from below and above; null leaves that side open."""
    if low is not None:
        advantages = advantages.clamp(min=float(low))
    if high is not None:
        advantages = advantages.clamp(max=float(high))
    return advantages


def dynamic_sampling_keep(
    scaled: Sequence[torch.Tensor], keys: Sequence[Hashable], *, leave_one_out: bool
) -> list[list[bool]]:
    """``grpo.use_dynamic_sampling``: which samples of a generation batch's prompt groups
    (their rewards after scaling, before shaping, as NeMo-RL filters; ``keys`` each group's
    prompt) are kept. NeMo-RL keeps a sample when its own standard deviation is not 0, which
    with ``grpo.use_leave_one_out_baseline`` is the spread of the *other* samples of its
    prompt: in a group with one right answer the right one is dropped and the rest kept."""
    flat_keys = [key for key, group in zip(keys, scaled, strict=True) for _ in range(len(group))]
    _, std = advantages.baseline_and_std(
        torch.cat(list(scaled)), flat_keys, leave_one_out=leave_one_out
    )
    kept = (std != 0).tolist()
    out, start = [], 0
    for group in scaled:
        out.append(kept[start : start + len(group)])
        start += len(group)
    return out


@dataclass
class DynamicSampling[T]:
    """``grpo.use_dynamic_sampling`` (DAPO): samples kept by :func:`dynamic_sampling_keep`
    collected over generation batches until a step has ``needed`` of them (prompts x
    generations per prompt), as NeMo-RL counts them: samples, not whole groups.

    After the n-th generation batch of a step leaves the step short, another batch is
    generated while n <= ``max_gen_batches``; past that the run stops with an error. The
    first ``needed`` kept samples train (the last group may be cut); the rest are discarded
    (their count is a metric). Without dynamic sampling every sample is kept, and one batch
    is the step."""

    needed: int
    max_gen_batches: int
    # Each group with the indices of its kept samples, in generation order.
    kept: list[tuple[T, list[int]]] = field(default_factory=list)
    batches: int = 0
    # The unfiltered rewards of the generation batches that kept any sample (NeMo-RL's
    # ``reward`` metric: the first ``needed`` of them).
    counted: list[torch.Tensor] = field(default_factory=list)

    def add(
        self, groups: Sequence[T], keep: Sequence[Sequence[bool]], batch_rewards: torch.Tensor
    ) -> bool:
        """Add one generation batch's groups (``keep``: per group, per sample); whether the
        step now has enough."""
        self.batches += 1
        before = len(self.kept)
        for group, flags in zip(groups, keep, strict=True):
            indices = [i for i, flag in enumerate(flags) if flag]
            if indices:
                self.kept.append((group, indices))
        if len(self.kept) > before:
            self.counted.append(batch_rewards)
        have = self.samples()
        if have >= self.needed:
            return True
        if self.batches <= self.max_gen_batches:
            return False
        raise UserInputError(
            f"grpo.dynamic_sampling_max_gen_batches: {self.batches} generation batches gave "
            f"only {have} of the {self.needed} samples with a non-zero reward spread a step "
            "needs; raise it, raise grpo.batch_multiplier or "
            "grpo.num_generations_per_prompt, or use prompts of mixed difficulty (with "
            "grpo.use_leave_one_out_baseline a sample's spread is the other samples': a "
            "group of 2 never has one)"
        )

    def samples(self) -> int:
        return sum(len(indices) for _, indices in self.kept)

    def take(self) -> tuple[list[tuple[T, list[int]]], int]:
        """The step's groups with the indices of the samples that train, and how many kept
        samples were discarded beyond ``needed``."""
        out: list[tuple[T, list[int]]] = []
        room = self.needed
        for group, indices in self.kept:
            if room <= 0:
                break
            out.append((group, indices[:room]))
            room -= len(out[-1][1])
        return out, self.samples() - self.needed

    def reward(self) -> float:
        """NeMo-RL's ``reward``: the mean of the first ``needed`` unfiltered rewards of the
        generation batches that kept a sample."""
        return float(torch.cat(self.counted)[: self.needed].mean())
