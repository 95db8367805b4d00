"""GRPO's NeMo-Gym samples: the rows' requests as NeMo-RL prepares them, a group's sequences
with their environment spans and masked samples, the message-level penalties, and the rows'
file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_rl_offload.algorithms import gym_rollouts
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.grpo import PromptGroup, training_sequences
from nemo_rl_offload.config.nemo_gym import uses_gym_rows
from nemo_rl_offload.data.nemo_gym_rows import load_gym_rows
from nemo_rl_offload.environments.nemo_gym import GymSettings
from nemo_rl_offload.environments.nemo_gym_results import GymTurn
from nemo_rl_offload.errors import UserInputError

REPO = Path(__file__).resolve().parents[3]
ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "hi"}], "top_p": 0.5},
    "agent_ref": {"name": "agent"},
    "answer": "19",
}


def test_requests_get_the_recipes_sampling_settings_and_the_smaller_token_limit():
    rows = [ROW, {**ROW, "responses_create_params": {"input": [], "max_output_tokens": 5}}]
    prepared = gym_rollouts.request_rows(rows, max_new_tokens=8, temperature=0.7, top_p=0.9)
    first, second = (row["responses_create_params"] for row in prepared)
    assert (first["temperature"], first["top_p"], first["max_output_tokens"]) == (0.7, 0.9, 8)
    assert second["max_output_tokens"] == 5  # the row's own limit is smaller
    assert prepared[0]["answer"] == "19"  # the rest of the row goes to the agent as it is
    assert ROW["responses_create_params"]["top_p"] == 0.5  # the data rows are not changed


NO_LOO = {"adv_estimator": {"use_leave_one_out_baseline": False}}


def _group() -> PromptGroup:
    """One row, two NeMo-Gym samples after a 3-token prompt: a two-turn rollout with a tool
    result at tokens 5..6, and a one-turn rollout its environment masked."""
    return PromptGroup(
        prompt=TokenSequence([1, 2, 3], 3),
        responses=[[4, 5, 6, 7, 8, 9], [4, 5]],
        rewards=torch.tensor([1.0, 0.0]),
        scaled=torch.tensor([1.0, 0.0]),
        truncated=[False, False],
        logprobs=[[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4], [-0.5, -0.6]],
        env_spans=[((5, 7),), ()],
        turns=[(GymTurn(3, 5, invalid_tool_call=True), GymTurn(7, 9)), (GymTurn(3, 5),)],
        masked=[False, True],
    )


def test_a_groups_sequences_keep_the_environments_spans_out_of_the_loss():
    sequences, advantages = training_sequences([_group()], NO_LOO)
    rollout, masked = sequences
    assert rollout.env_spans == ((5, 7),)
    # labels 2..3 and 6..7 are the policy's tokens 3..4 and 7..8
    assert np.flatnonzero(rollout.label_mask()).tolist() == [2, 3, 6, 7]
    # the masked sample still counts in the group's advantages, but trains on nothing
    assert masked.loss_multiplier == 0.0 and masked.label_mask().sum() == 0
    assert advantages.tolist()[0] > 0 > advantages.tolist()[1]


def test_penalties_make_every_sequences_advantages_per_token():
    sequences, _ = training_sequences([_group()], NO_LOO)
    metrics = gym_rollouts.advantages_with_penalties(
        sequences,
        [t for t in _group().turns],
        {"invalid_tool_call_advantage": -5.0},
    )
    rollout, other = sequences
    assert rollout.extras["advantages"][2:4].tolist() == [-5.0, -5.0]
    assert set(rollout.extras["advantages"][6:8].tolist()) != {-5.0}
    assert other.extras["advantages"].shape == (len(other.ids) - 1,)
    assert metrics["num_invalid_tool_calls"] == 1 and metrics["num_assistant_messages"] == 3
    assert metrics["invalid_tool_call_rate"] == pytest.approx(1 / 3)
    plain, _ = training_sequences([_group()], {})
    assert gym_rollouts.advantages_with_penalties(plain, _group().turns, {}) == {}
    assert np.isscalar(plain[0].extras["advantages"])


def test_a_row_whose_samples_start_differently_is_refused():
    same = [TokenSequence([1, 2], 2), TokenSequence([1, 2], 2)]
    gym_rollouts.check_group_prompts(same, 2)
    with pytest.raises(UserInputError, match="different prompt tokens"):
        gym_rollouts.check_group_prompts([*same[:1], TokenSequence([1, 3], 2)], 2)


def test_the_rows_file_is_checked_line_by_line(tmp_path):
    good = tmp_path / "rows.jsonl"
    good.write_text(json.dumps(ROW) + "\n\n" + json.dumps(ROW) + "\n")
    assert len(load_gym_rows(str(good), "data.train.data_path")) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        "{not json\n"
        + json.dumps({"agent_ref": {"name": "a"}})
        + "\n"
        + json.dumps({"responses_create_params": {}})
        + "\n"
    )
    with pytest.raises(UserInputError) as info:
        load_gym_rows(str(bad), "data.train.data_path")
    lines = info.value.problems
    assert [line.split(": ")[0] for line in lines] == [f"{bad}:1", f"{bad}:2", f"{bad}:3"]
    assert "agent_ref.name" in lines[2]
    with pytest.raises(UserInputError, match="is not a file"):
        load_gym_rows(str(tmp_path / "missing.jsonl"), "data.train.data_path")


def test_gym_rows_are_named_by_the_train_or_default_dataset():
    assert uses_gym_rows({"train": {"dataset_name": "NemoGymDataset"}})
    assert uses_gym_rows(
        {"train": {"data_path": "x"}, "default": {"dataset_name": "NemoGymDataset"}}
    )
    assert not uses_gym_rows({"dataset_name": "jsonl"})


def test_calibration_prompts_are_the_rows_first_requests_in_the_chat_template():
    from nemo_rl_offload.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    rows = [
        {
            "responses_create_params": {
                "input": [
                    {"role": "developer", "content": "be brief"},
                    {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
                    {"type": "function_call_output", "call_id": "x", "output": "4"},
                ],
                "tools": [{"type": "function", "name": "add"}],
            },
            "agent_ref": {"name": "a"},
        },
        {"responses_create_params": {"input": "3+3?"}, "agent_ref": {"name": "a"}},
        {"responses_create_params": {"input": []}, "agent_ref": {"name": "a"}},
    ]
    first, second = gym_rollouts.first_prompts(rows, tokenizer)
    assert first.ids == tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
        tools=[{"type": "function", "name": "add"}],
    )
    assert tokenizer.decode(second.ids).endswith("<|user|>\n3+3?\n<|assistant|>\n")
    assert first.prompt_len == len(first.ids)


def test_each_sample_keeps_the_agent_that_ran_it():
    """On-policy distillation routes each sample to a teacher by its row's agent name."""
    result = json.loads(
        (REPO / "tests/unit/environments/data/nemo_gym_tool_call_rollout.json").read_text()
    )

    class Gym:
        settings = GymSettings(("model.yaml",), {})

        def run(self, rows):
            return [result for _ in rows]

    rows = [
        {"agent_ref": {"name": "math_agent"}},
        {"agent_ref": {"name": "code_agent"}},
        {"responses_create_params": {}},
    ]
    batch = gym_rollouts.samples(Gym(), rows, max_len=4096)
    assert batch.agents == ["math_agent", "code_agent", None]
