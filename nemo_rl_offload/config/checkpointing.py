"""What the ``checkpointing`` keys mean: which metric ``metric_name`` names, and which checkpoints
``keep_top_k`` keeps.

NeMo-RL's meaning, which recipes brought from NeMo-RL rely on:

- ``metric_name`` is ``"val:<name>"`` or ``"train:<name>"`` (a bare ``<name>`` is read as a
  validation metric when the algorithm validates with that name, else as a training one). A
  checkpoint records the value the step that saved it produced; a step that did not validate
  records no validation metric, and such a checkpoint ranks last.
- ``keep_top_k`` keeps the k best checkpoints by that metric (ties go to the newer one), or the
  k newest without a metric, and always the newest of all, which resume needs.

Pure functions on plain data: the recipe checks (:mod:`nemo_rl_offload.preflight`) and the
algorithm loop's saving (:mod:`nemo_rl_offload.algorithms.common`) share them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The metrics each algorithm logs, by phase: what a metric_name can name.
METRICS: dict[str, dict[str, tuple[str, ...]]] = {
    "sft": {"val": ("val_loss",), "train": ("loss", "grad_norm")},
    "dpo": {
        "val": ("val_loss", "val_preference_accuracy"),
        "train": ("loss", "preference_accuracy", "grad_norm"),
    },
    "grpo": {
        "val": ("val_reward", "val_reward_greedy", "val_pass_k"),
        "train": ("loss", "reward", "kl", "grad_norm"),
    },
    "distillation": {
        "val": ("val_reward", "val_reward_greedy", "val_pass_k"),
        "train": ("loss", "kl", "reward", "grad_norm"),
    },
}
# NeMo-RL's names for the same quantities: its math environment's accuracy is this backend's
# mean held-out reward (the math reward is 1 for a right answer, else 0).
# NeMo-RL's pass_k (a prompt counts when any of its held-out samples is rewarded) is val_pass_k.
# NeMo-RL's DPO names its validation metrics after the validation dataset ("default" for one).
ALIASES: dict[str, dict[str, str]] = {
    "dpo": {"validation-default_loss": "val_loss"},
    "grpo": {"accuracy": "val_reward", "pass_k": "val_pass_k"},
    "distillation": {"accuracy": "val_reward", "pass_k": "val_pass_k"},
}
# Names that mean different metrics in each phase. NeMo-RL's NeMo-Gym rollouts log
# ``total_reward/mean`` (the mean total reward over the batch's samples) in both phases: in
# validation that is the mean held-out reward, in training the step's mean reward.
PHASE_ALIASES: dict[str, dict[str, dict[str, str]]] = {
    "grpo": {"val": {"total_reward/mean": "val_reward"}, "train": {"total_reward/mean": "reward"}},
}


@dataclass(frozen=True)
class Metric:
    """A metric as checkpoints record it: ``phase`` (val or train) and the logged ``key``."""

    phase: str
    key: str

    @property
    def name(self) -> str:
        return f"{self.phase}:{self.key}"


def resolve_metric(metric_name: str, algorithm: str) -> Metric:
    """The metric ``metric_name`` names for ``algorithm``; ValueError with the names it can
    name otherwise (the caller adds the recipe path)."""
    produced = METRICS[algorithm]
    phase, sep, key = metric_name.partition(":")
    if not sep:
        phase, key = "", metric_name
    key = ALIASES.get(algorithm, {}).get(key, key)
    phases = (phase,) if phase else ("val", "train")
    if phase and phase not in produced:
        raise ValueError(
            f"'{metric_name}' starts with '{phase}:'; write val:<name> or train:<name>"
        )
    for candidate in phases:
        named = PHASE_ALIASES.get(algorithm, {}).get(candidate, {}).get(key, key)
        if named in produced[candidate]:
            return Metric(candidate, named)
    names = [f"{p}:{k}" for p in ("val", "train") for k in produced[p]]
    raise ValueError(
        f"{algorithm} does not produce a metric '{metric_name}'; use one of " + ", ".join(names)
    )


def record(metric: Metric | None, step_metrics: Mapping[str, Mapping[str, float]]) -> dict:
    """What a checkpoint records of ``metric`` from the metrics its step logged by phase
    (empty when the step did not produce it)."""
    if metric is None:
        return {}
    value = step_metrics.get(metric.phase, {}).get(metric.key)
    return {} if value is None else {metric.name: float(value)}


def steps_to_delete(
    history: Sequence[tuple[int, Mapping[str, float]]],
    *,
    keep_top_k: int | None,
    metric: Metric | None,
    higher_is_better: bool,
) -> list[int]:
    """The checkpoint steps ``keep_top_k`` lets go, from ``history``: (step, recorded metrics)
    per checkpoint. The newest is always kept; checkpoints without the metric rank last."""
    if not keep_top_k or not history:
        return []
    newest = max(step for step, _ in history)
    if metric is None:
        ranked = sorted(history, key=lambda item: item[0], reverse=True)
    else:
        worst = float("-inf") if higher_is_better else float("inf")

        def score(item: tuple[int, Mapping[str, float]]) -> tuple[float, int]:
            value = item[1].get(metric.name, worst)
            return (value if higher_is_better else -value, item[0])

        ranked = sorted(history, key=score, reverse=True)
    kept = {step for step, _ in ranked[:keep_top_k]} | {newest}
    return sorted(step for step, _ in history if step not in kept)


DEADLINE_FORMAT = "DD:HH:MM:SS"


def parse_deadline(text: str) -> int:
    """Seconds in a ``checkpoint_must_save_by`` string: ``DD:HH:MM:SS`` as NeMo-RL reads it
    (four non-negative integers, e.g. ``00:03:45:00`` for 3 h 45 min; a field may exceed its
    usual range, ``00:00:90:00`` is 90 minutes, as there). ValueError otherwise (the caller adds
    the recipe path)."""
    parts = text.split(":")
    if len(parts) != 4 or not all(part.isascii() and part.isdigit() for part in parts):
        raise ValueError(f"{text!r} is not {DEADLINE_FORMAT} (e.g. '00:03:45:00')")
    days, hours, minutes, seconds = (int(part) for part in parts)
    return days * 86400 + hours * 3600 + minutes * 60 + seconds
