"""On-policy distillation inside GRPO (``grpo.adv_estimator.name: opd``): the teachers'
worker groups and each token's advantage, the teacher's log-probability minus the student's
before the step. The rules and the routing are config/on_policy_distillation.py's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nemo_rl_offload.algorithms import rewards
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.config import on_policy_distillation as opd_config
from nemo_rl_offload.policy.policy_group import PolicyGroup

PREFIX = opd_config.SECTION


def token_advantages(
    sequence: TokenSequence, teacher: np.ndarray, student: np.ndarray
) -> np.ndarray:
    """A sequence's advantages on its label positions (position t holds token t+1's):
    teacher minus student log-probability on the response's tokens, 0 on the prompt's and on
    the tokens of an environment's turns (which do not train)."""
    length = len(sequence.ids)
    values = np.zeros(length - 1, dtype=np.float32)
    start = sequence.prompt_len - 1
    gap = (
        np.asarray(teacher, np.float32)[start : length - 1]
        - np.asarray(student, np.float32)[start : length - 1]
    )
    values[start:] = gap
    for begin, end in sequence.env_spans or ():
        values[begin - 1 : end - 1] = 0.0
    return values


def response_mask(sequence: TokenSequence) -> np.ndarray:
    """The label positions :func:`token_advantages` gives a value to."""
    mask = np.zeros(len(sequence.ids) - 1, dtype=bool)
    mask[sequence.prompt_len - 1 :] = True
    for begin, end in sequence.env_spans or ():
        mask[begin - 1 : end - 1] = False
    return mask


def gpu_share(recipe: Any, *, on_gpu: bool) -> float:
    """Each group's share of a GPU when the policy and its teacher groups share the workers'
    GPUs (one group per distinct teacher model); 1 on CPU workers."""
    return 1.0 / (len(opd_config.teacher_sections(recipe)) + 1) if on_gpu else 1.0


@dataclass
class Teachers:
    """The recipe's teacher groups (one per distinct model) and how samples reach them."""

    routing: opd_config.TeacherRouting
    groups: dict[str, PolicyGroup]
    # Each group's forward-only rows per micro-batch (its micro_batch_size; None: the policy's).
    rows: dict[str, int | None]

    @classmethod
    def start(cls, run: Any, *, seed: int, temperature: float) -> Teachers:
        """Start one forward-only group per teacher model. They share the policy's GPUs
        (:func:`gpu_share`), and take their log-probabilities at the sampling temperature, as
        the policy's are (NeMo-RL's teachers are built from the policy's config)."""
        sections = opd_config.teacher_sections(run.recipe)
        share = gpu_share(run.recipe, on_gpu=run.report.cluster.on_gpu)
        groups = {
            alias: run.start_group(
                f"teacher '{alias}'",
                seed=seed,  # a preset model's weights are the policy's own initial ones
                trainable=False,
                gpu_fraction=share,
                logits_temperature=temperature,
                section=section,
            )
            for alias, section in sections.items()
        }
        rows = {alias: section.get("logprob_batch_size") for alias, section in sections.items()}
        return cls(opd_config.routing(run.recipe), groups, rows)

    def advantages(
        self,
        run: Any,
        sequences: Sequence[TokenSequence],
        agents: Sequence[str | None],
        student: Sequence[np.ndarray],
        clip: tuple[float | None, float | None] = (None, None),
    ) -> dict[str, float]:
        """Set each sequence's per-token advantages (``extras["advantages"]``) from its
        teacher's log-probabilities and ``student``'s (the policy's before the step), then
        bounded by ``clip`` (grpo.advantage_clip_low / high, which NeMo-RL applies after its
        estimator); the step's distillation metrics, under NeMo-RL's names (before the
        bounds, as NeMo-RL's estimator logs them; :func:`distillation_metrics`)."""
        aliases = self.routing.aliases(agents)
        teacher: list[np.ndarray | None] = [None] * len(sequences)
        for group_key, group in self.groups.items():
            picked = [i for i, a in enumerate(aliases) if self.routing.group_of[a] == group_key]
            if not picked:
                continue
            scored = run.forward_only(
                [sequences[i] for i in picked], group.token_logprobs, rows=self.rows[group_key]
            )
            for index, row in zip(picked, scored, strict=True):
                teacher[index] = row
        gaps = []
        for sequence, own, theirs in zip(sequences, student, teacher, strict=True):
            assert theirs is not None  # every alias has a group
            values = token_advantages(sequence, theirs, own)
            gaps.append(values[response_mask(sequence)])
            sequence.extras["advantages"] = rewards.clip_advantages(
                torch.from_numpy(values), *clip
            ).numpy()
        in_loss = [s.loss_multiplier != 0 for s in sequences]
        return {**distillation_metrics(gaps, in_loss), **self.routing.metrics(aliases)}


def distillation_metrics(gaps: Sequence[np.ndarray], in_loss: Sequence[bool]) -> dict[str, float]:
    """NeMo-RL's OPD metrics over the response tokens of the samples in the loss only (its
    mask is the token mask times the sample mask: a sample that overlong filtering, its
    environment or the log-probability error check took out of the loss does not count):
    the mean teacher-student gap, and the mean and (Bessel) spread of the advantages, which
    are that gap before any clamping."""
    picked = [gap for gap, counted in zip(gaps, in_loss, strict=True) if counted]
    every = np.concatenate(picked) if picked else np.zeros(0, np.float32)
    mean = float(every.mean()) if every.size else 0.0
    return {
        f"{PREFIX}/teacher_student_logprob_gap_mean": mean,
        f"{PREFIX}/adv_mean": mean,
        f"{PREFIX}/adv_std": float(every.std(ddof=1)) if every.size > 1 else 0.0,
    }
