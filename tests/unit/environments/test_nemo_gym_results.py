"""NeMo-Gym results as GRPO's sequences: a real two-turn tool-call rollout (NeMo-Gym's own
vllm_model server against nemo-rl-offload serve, data/nemo_gym_tool_call_rollout.json), the
contiguity NeMo-RL requires, the turn flags and the message-level penalties."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.environments.nemo_gym_results import (
    GymRollout,
    GymTurn,
    NonContiguousRollout,
    penalized_advantages,
    rollout_from_result,
    turn_flags,
)
from nemo_rl_offload.errors import UserInputError

RESULT = json.loads(
    (Path(__file__).parent / "data" / "nemo_gym_tool_call_rollout.json").read_text()
)


def _generated(result):
    return [item for item in result["response"]["output"] if item.get("generation_token_ids")]


def test_a_tool_call_rollout_is_one_sequence_whose_tool_turn_never_trains():
    first, second = _generated(RESULT)
    rollout = rollout_from_result(RESULT)
    assert rollout.reward == 1.0
    assert rollout.ids[: rollout.prompt_len] == first["prompt_token_ids"]
    assert rollout.ids == second["prompt_token_ids"] + second["generation_token_ids"]
    turn1, turn2 = rollout.turns
    assert rollout.ids[turn1.start : turn1.end] == first["generation_token_ids"]
    assert rollout.ids[turn2.start : turn2.end] == second["generation_token_ids"]
    # between the turns: the call and its output as the chat template rendered them
    (span,) = rollout.env_spans
    assert span == (turn1.end, turn2.start)
    sequence = TokenSequence(rollout.ids, rollout.prompt_len, env_spans=rollout.env_spans)
    trained = np.flatnonzero(sequence.label_mask()) + 1  # the tokens the labels are
    assert trained.tolist() == [*range(turn1.start, turn1.end), *range(turn2.start, turn2.end)]
    # log-probabilities: the sampler's on its tokens, 0 over the environment's
    after = rollout.logprobs
    assert len(after) == len(rollout.ids) - rollout.prompt_len
    offset = rollout.prompt_len
    assert after[turn2.start - offset : turn2.end - offset] == second["generation_log_probs"]
    assert set(after[span[0] - offset : span[1] - offset]) == {0.0}


def test_a_turn_whose_prompt_lost_earlier_tokens_is_refused():
    broken = copy.deepcopy(RESULT)
    _generated(broken)[1]["prompt_token_ids"][5] += 1  # the history was changed
    with pytest.raises(NonContiguousRollout, match="first difference at token 5"):
        rollout_from_result(broken)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda r: r.pop("reward"), "numeric reward"),
        (lambda r: [i.pop("generation_token_ids") for i in _generated(r)], "no generated turn"),
        (lambda r: _generated(r)[0]["generation_log_probs"].pop(), "log-probabilities"),
    ],
)
def test_a_malformed_result_is_one_line(change, expected):
    broken = copy.deepcopy(RESULT)
    change(broken)
    with pytest.raises(UserInputError, match=expected):
        rollout_from_result(broken)


def _message(text):
    return {"type": "message", "content": [{"type": "output_text", "text": text}]}


def _reasoning(text):
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


@pytest.mark.parametrize(
    ("item", "flags"),
    [
        (_message("The answer is 19."), (False, False)),
        (_message('<tool_call>{"name": "add"}</tool_call>'), (True, False)),
        (_message("<think>hmm</think>19"), (False, True)),
        (_reasoning("<think>one</think>"), (False, False)),  # one pair is expected
        (_reasoning("<think>a</think><think>b"), (False, True)),
        (_reasoning("call <function_call>"), (True, False)),
        ({"type": "function_call", "name": "add"}, (False, False)),
    ],
)
def test_turn_flags_as_nemo_rl_sets_them(item, flags):
    assert turn_flags(item) == flags


def test_flags_use_the_recipes_patterns():
    assert turn_flags(_message("[TOOL]x"), invalid_tool_call_patterns=["[TOOL]"]) == (True, False)


def test_penalties_overwrite_the_flagged_turns_advantages_only():
    rollout = GymRollout(
        ids=list(range(12)),
        prompt_len=3,
        env_spans=((6, 8),),
        turns=(GymTurn(3, 6, invalid_tool_call=True, malformed_thinking=True), GymTurn(8, 12)),
        logprobs=[0.0] * 9,
        reward=1.0,
    )
    values = penalized_advantages(
        len(rollout.ids), rollout.turns, 0.5, invalid_tool_call=-5.0, malformed_thinking=-2.0
    )
    # labels 2..4 are the first turn's tokens 3..5: the invalid call's penalty wins
    assert values.tolist() == [0.5, 0.5, -5, -5, -5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    only_thinking = penalized_advantages(
        len(rollout.ids), rollout.turns, 0.5, invalid_tool_call=None, malformed_thinking=-2.0
    )
    assert only_thinking[2:5].tolist() == [-2, -2, -2]
    assert (
        penalized_advantages(
            len(rollout.ids), rollout.turns, 0.5, invalid_tool_call=None, malformed_thinking=None
        )
        is None
    )
    clean = GymRollout(rollout.ids, 3, (), (GymTurn(3, 12),), [0.0] * 9, 1.0)
    assert (
        penalized_advantages(
            len(clean.ids), clean.turns, 0.5, invalid_tool_call=-5.0, malformed_thinking=-2.0
        )
        is None
    )


def test_a_rollouts_routes_are_stitched_from_its_turns_as_nemo_rl_does():
    """policy.router_replay through NeMo-Gym: each turn's item carries the experts of its
    prompt and generated tokens. The sequence takes each turn's new rows; the previous turn's
    last token, which only the next turn's prefill fed, takes that prefill's row."""
    result = copy.deepcopy(RESULT)
    first, second = _generated(result)
    for turn, item in enumerate((first, second), start=1):
        rows = len(item["prompt_token_ids"]) + len(item["generation_token_ids"])
        item["routed_experts"] = [[[turn * 1000 + row]] for row in range(rows)]
    rollout = rollout_from_result(result)
    routes = rollout.routes
    assert routes is not None and routes.shape == (len(rollout.ids), 1, 1)
    end1 = len(first["prompt_token_ids"]) + len(first["generation_token_ids"])
    expected = [1000 + row for row in range(end1 - 1)]
    expected += [2000 + row for row in range(end1 - 1, len(rollout.ids))]
    assert routes[:, 0, 0].tolist() == expected


def test_routes_of_the_wrong_shape_are_one_line():
    result = copy.deepcopy(RESULT)
    first, _ = _generated(result)
    first["routed_experts"] = [[[1]]]
    with pytest.raises(UserInputError, match="routed_experts has shape"):
        rollout_from_result(result)
    assert rollout_from_result(RESULT).routes is None  # a server that returns none
