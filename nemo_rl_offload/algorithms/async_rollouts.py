"""``grpo.async_grpo``: rollouts generated ahead of the step that trains on them.

This backend generates on the training GPUs, so it cannot overlap generation with training as
NeMo-RL does; :class:`RolloutPipeline` keeps NeMo-RL's schedule instead (each step trains on
rollouts of weights up to ``max_trajectory_age_steps`` older). The schedule: docs/training.md.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.environments.nemo_gym_results import GymTurn

# The driver state's key for the rollouts waiting for their step (checkpoint state.json).
STATE_KEY = "async_rollouts"


@dataclass
class Rollouts:
    """One step's rollouts: the step they train at, the step whose weights sampled them, the
    prompt groups and the metrics of their gathering."""

    target: int
    generated_at: int
    groups: list[Any]  # grpo.PromptGroup
    metrics: dict[str, float]


class RolloutPipeline:
    """The rollouts of the steps to come, each generated ``lead`` steps before it trains (see
    docs/training.md). ``collect(target)`` samples a step's groups with the weights of
    now; ``exhausted()`` says the data epochs are used up (no more steps to generate for);
    ``last_step``: the run's last step (nothing is generated beyond it)."""

    def __init__(
        self,
        lead: int,
        collect: Callable[[int], tuple[list[Any], dict[str, float]]],
        *,
        exhausted: Callable[[], bool],
        last_step: int,
        pending: list[Rollouts] | None = None,
    ) -> None:
        if lead < 1:
            raise ValueError(f"the pipeline's lead must be >= 1, got {lead}")
        self.lead = lead
        self._collect = collect
        self._exhausted = exhausted
        self.last_step = last_step
        self.pending: list[Rollouts] = list(pending or [])

    def _next_target(self, step: int) -> int:
        return self.pending[-1].target + 1 if self.pending else step

    def take(self, step: int) -> Rollouts:
        """Generate, with the current weights, every step's rollouts up to ``step + lead`` not
        generated yet (within the run and its data), then hand over ``step``'s."""
        target = self._next_target(step)
        while target <= min(step + self.lead, self.last_step) and (
            target == step or not self._exhausted()
        ):
            groups, metrics = self._collect(target)
            self.pending.append(Rollouts(target, step, groups, metrics))
            target += 1
        if not self.pending or self.pending[0].target != step:
            have = [r.target for r in self.pending]
            raise RuntimeError(f"async GRPO: no rollouts for step {step} (pending: {have})")
        return self.pending.pop(0)

    def state(self) -> dict[str, Any]:
        """The rollouts waiting for their step, as JSON (the checkpoint's driver state)."""
        return {STATE_KEY: [_rollouts_json(r) for r in self.pending]}

    @staticmethod
    def restored(state: Mapping[str, Any], group_type: type) -> list[Rollouts]:
        """The waiting rollouts of a checkpoint's driver state (none in a synchronous one)."""
        return [_rollouts_from_json(r, group_type) for r in state.get(STATE_KEY) or []]


def age(rollouts: Rollouts) -> int:
    """Steps between the weights that sampled the rollouts and the step that trains on them
    (NeMo-RL's ``avg_trajectory_age``: every group of a step here has the same age)."""
    return rollouts.target - rollouts.generated_at


def _rollouts_json(rollouts: Rollouts) -> dict[str, Any]:
    return {
        "target": rollouts.target,
        "generated_at": rollouts.generated_at,
        "metrics": rollouts.metrics,
        "groups": [
            {
                "prompt": {
                    "ids": g.prompt.ids,
                    "prompt_len": g.prompt.prompt_len,
                    "extras": g.prompt.extras,
                    "loss_multiplier": g.prompt.loss_multiplier,
                },
                "responses": g.responses,
                # float32 (or float64) values: exact through JSON's float64
                "dtype": str(g.rewards.dtype).removeprefix("torch."),
                "rewards": g.rewards.tolist(),
                "scaled": g.scaled.tolist(),
                "truncated": g.truncated,
                "logprobs": g.logprobs,
                "routes": [_array_json(r) for r in g.routes],
                # NeMo-Gym rollouts (algorithms/gym_rollouts.py): empty otherwise
                "env_spans": [[list(span) for span in spans] for spans in g.env_spans],
                "turns": [[dataclasses.asdict(t) for t in turns] for turns in g.turns],
                "masked": g.masked,
                "agents": g.agents,  # on-policy distillation routes by them
            }
            for g in rollouts.groups
        ],
    }


def _rollouts_from_json(data: Mapping[str, Any], group_type: type) -> Rollouts:
    groups = [
        group_type(
            prompt=TokenSequence(**g["prompt"]),
            responses=[list(r) for r in g["responses"]],
            rewards=torch.tensor(g["rewards"], dtype=getattr(torch, g["dtype"])),
            scaled=torch.tensor(g["scaled"], dtype=getattr(torch, g["dtype"])),
            truncated=list(g["truncated"]),
            logprobs=[list(lp) for lp in g["logprobs"]],
            routes=[_array_from_json(r) for r in g.get("routes") or []],
            env_spans=[tuple(tuple(span) for span in spans) for spans in g.get("env_spans", [])],
            turns=[tuple(GymTurn(**t) for t in turns) for turns in g.get("turns", [])],
            masked=list(g.get("masked", [])),
            agents=list(g.get("agents", [])),
        )
        for g in data["groups"]
    ]
    return Rollouts(int(data["target"]), int(data["generated_at"]), groups, dict(data["metrics"]))


def _array_json(array: np.ndarray) -> dict[str, Any]:
    """An integer array (a sequence's sampled routes, ``policy.router_replay``) as JSON: its
    bytes in base64 (a nested list would take several times the room in state.json)."""
    return {
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii"),
    }


def _array_from_json(data: Mapping[str, Any]) -> np.ndarray:
    raw = base64.b64decode(data["data"])
    return np.frombuffer(raw, dtype=np.dtype(data["dtype"])).reshape(data["shape"]).copy()
