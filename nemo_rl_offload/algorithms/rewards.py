"""GRPO's transforms between scoring a step's responses and training on them, in NeMo-RL's
order: scale the rewards (``grpo.reward_scaling``), shape them (``grpo.reward_shaping``),
keep only prompt groups whose rewards vary (``grpo.use_dynamic_sampling``), take the truncated
responses out of the loss (``grpo.overlong_filtering``), and clamp the advantages
(``grpo.advantage_clip_low`` / ``advantage_clip_high``).

Pure functions on plain values, so that each option's effect is testable without workers; the
recipe checks of these keys are :func:`nemo_rl_offload.config.grpo_options.check`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

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


def varied(group_rewards: torch.Tensor) -> torch.Tensor:
    """Per prompt group ([prompts, generations] rewards): whether its rewards are not all
    equal, i.e. whether its advantages carry any signal (dynamic sampling keeps only these)."""
    return group_rewards.amax(dim=-1) != group_rewards.amin(dim=-1)


@dataclass
class DynamicSampling[T]:
    """``grpo.use_dynamic_sampling`` (DAPO): prompt groups with varied rewards collected over
    generation batches until a step has ``needed`` of them.

    NeMo-RL's count: after the n-th generation batch of a step leaves the step short, another
    batch is generated while n <= ``max_gen_batches``; past that the run stops with an error.
    Groups beyond ``needed`` are discarded (their count is a metric)."""

    needed: int
    max_gen_batches: int
    kept: list[T] = field(default_factory=list)
    batches: int = 0
    generated: int = 0

    def add(self, groups: Sequence[T], keep: Sequence[bool]) -> bool:
        """Add one generation batch's groups; whether the step now has enough."""
        self.batches += 1
        self.generated += len(groups)
        self.kept += [g for g, k in zip(groups, keep, strict=True) if k]
        if len(self.kept) >= self.needed:
            return True
        if self.batches <= self.max_gen_batches:
            return False
        raise UserInputError(
            f"grpo.dynamic_sampling_max_gen_batches: {self.batches} generation batches gave "
            f"only {len(self.kept)} of the {self.needed} prompt groups with varied rewards a "
            "step needs; raise it, raise grpo.batch_multiplier or "
            "grpo.num_generations_per_prompt, or use prompts of mixed difficulty"
        )

    def take(self) -> tuple[list[T], int]:
        """The step's groups and how many groups with varied rewards were discarded."""
        return self.kept[: self.needed], len(self.kept) - self.needed
