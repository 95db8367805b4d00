"""grpo.async_grpo's schedule (algorithms/async_rollouts.py): which weights sample which step's
rollouts, NeMo-RL's trajectory collector's when generation keeps up; the run's last step and
the data's end bound the lead; the waiting rollouts go through a checkpoint's JSON unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_rl_offload.algorithms.async_rollouts import RolloutPipeline, age
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.grpo import PromptGroup
from nemo_rl_offload.environments.nemo_gym_results import GymTurn


class Trainer:
    """Steps 1..N; ``collect`` records the step (weights) that sampled each target."""

    def __init__(self) -> None:
        self.step = 0
        self.sampled_by: dict[int, int] = {}

    def collect(self, target: int) -> tuple[list, dict[str, float]]:
        self.sampled_by[target] = self.step
        return [target], {"reward": float(target)}


def _run(lead: int, steps: int, *, data_steps: int | None = None) -> tuple[list, Trainer]:
    """``steps`` training steps over data for ``data_steps`` steps (None: endless), stopping
    as the loop does (loop.Steps.data_done: the data drawn and nothing waiting)."""
    trainer = Trainer()

    def exhausted() -> bool:
        return data_steps is not None and len(trainer.sampled_by) >= data_steps

    pipeline = RolloutPipeline(lead, trainer.collect, exhausted=exhausted, last_step=steps)
    taken = []
    for step in range(1, steps + 1):
        if exhausted() and not pipeline.pending:
            break
        trainer.step = step
        taken.append(pipeline.take(step))
    return taken, trainer


@pytest.mark.parametrize("lead", [1, 2, 3])
def test_each_step_trains_on_rollouts_of_the_weights_lead_steps_before(lead):
    """As NeMo-RL's collector gives the first weights steps 0..K and version v step v + K."""
    taken, trainer = _run(lead, 8)
    assert [r.target for r in taken] == list(range(1, 9))
    assert [r.groups for r in taken] == [[t] for t in range(1, 9)]
    assert [age(r) for r in taken] == [min(t - 1, lead) for t in range(1, 9)]
    assert all(trainer.sampled_by[t] == max(1, t - lead) for t in range(1, 9))
    assert max(trainer.sampled_by) == 8  # nothing sampled past the run's last step


def test_nothing_is_sampled_past_the_data_and_the_drawn_steps_still_train():
    taken, trainer = _run(2, 10, data_steps=4)
    assert sorted(trainer.sampled_by) == [1, 2, 3, 4]
    assert [r.target for r in taken] == [1, 2, 3, 4]


def test_a_lead_below_one_is_refused():
    with pytest.raises(ValueError, match=">= 1"):
        RolloutPipeline(0, Trainer().collect, exhausted=lambda: False, last_step=3)


def test_waiting_rollouts_survive_the_checkpoints_json_exactly():
    group = PromptGroup(
        prompt=TokenSequence([5, 6, 7], 2, {"id": 3}, 1.0),
        responses=[[1, 2], [3]],
        rewards=torch.tensor([0.1, -1.0 / 3.0], dtype=torch.float32),
        scaled=torch.tensor([0.2, 0.7], dtype=torch.float32),
        truncated=[False, True],
        logprobs=[[-0.1234567, -2.5], [-1e-7]],
        # a NeMo-Gym group: the environment's span, the turns and their flags, a masked sample
        env_spans=[((4, 5),), ()],
        turns=[(GymTurn(3, 4, invalid_tool_call=True), GymTurn(5, 6)), (GymTurn(3, 4),)],
        masked=[False, True],
        agents=["math_agent", None],  # on-policy distillation's teacher routing
    )
    pipeline = RolloutPipeline(
        1, lambda target: ([group], {"reward": 0.25}), exhausted=lambda: False, last_step=5
    )
    pipeline.take(1)  # samples steps 1 and 2; step 2's waits
    state = json.loads(json.dumps(pipeline.state()))
    (waiting,) = RolloutPipeline.restored(state, PromptGroup)
    assert (waiting.target, waiting.generated_at, waiting.metrics) == (2, 1, {"reward": 0.25})
    (back,) = waiting.groups
    assert back.prompt == group.prompt and back.responses == group.responses
    assert back.truncated == group.truncated and back.logprobs == group.logprobs
    assert (back.env_spans, back.turns, back.masked, back.agents) == (
        group.env_spans,
        group.turns,
        group.masked,
        group.agents,
    )
    for name in ("rewards", "scaled"):
        assert torch.equal(getattr(back, name), getattr(group, name))
        assert getattr(back, name).dtype == torch.float32
    assert RolloutPipeline.restored({"position": 3}, PromptGroup) == []
