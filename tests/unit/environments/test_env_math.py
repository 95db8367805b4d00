"""Number extraction and the 0/1 math reward."""

from __future__ import annotations

import pytest

from nemo_rl_offload.environments.math import MathEnvironment, extract_final_number, math_reward
from nemo_rl_offload.errors import UserInputError


@pytest.mark.parametrize(
    ("text", "number"),
    [
        (" 85", "85"),
        ("85.", "85"),
        ("The answer is 85.", "85"),
        ("-3", "-3"),
        ("it is -3 degrees", "-3"),
        ("10-3", "3"),
        ("1,234", "1234"),
        ("total: 12,345,678 units", "12345678"),
        ("2.5", "2.5"),
        ("37+48 = 85", "85"),
        (" 85<|endoftext|> 99", "85"),
        (" 85</s>12", "85"),
        (" 85<eos>", "85"),
        ("no digits here", None),
        ("", None),
        ("<|im_end|> 7", None),
    ],
)
def test_extract_final_number(text: str, number: str | None) -> None:
    assert extract_final_number(text) == number


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        (" 85", "85", 1.0),  # right
        (" 84", "85", 0.0),  # wrong
        (" eighty-five", "85", 0.0),  # no number
        ("", "85", 0.0),
        (" -3", "-3", 1.0),  # negative
        (" 3", "-3", 0.0),
        (" 85 is the answer, I think", "85", 1.0),  # trailing text
        (" 85 because 37 and 48", "85", 0.0),  # the last number counts
        (" 1,234", "1234", 1.0),  # commas
        (" 1234", "1,234", 1.0),
        (" 85.0", "85", 1.0),
        (" 85.5", "85", 0.0),
        (" 85", "n/a", 0.0),  # an answer without a number never matches
    ],
)
def test_math_reward(response: str, answer: str, reward: float) -> None:
    assert math_reward(response, answer) == reward


def test_environment_scores_in_order() -> None:
    responses = [" 1", " 2", " x", " 4"] * 10
    answers = ["1", "3", "5", "4"] * 10
    expected = [1.0, 0.0, 0.0, 1.0] * 10
    assert MathEnvironment().score(responses, answers) == expected
    assert MathEnvironment(num_workers=4).score(responses, answers) == expected
    assert MathEnvironment().score([], []) == []


def test_environment_from_config() -> None:
    assert MathEnvironment.from_config({"math": {"num_workers": 3}}).num_workers == 3
    assert MathEnvironment.from_config(None).num_workers == 1
    with pytest.raises(UserInputError) as info:
        MathEnvironment.from_config({"math": {"num_workers": 0}})
    assert info.value.problems == ["env.math.num_workers: must be at least 1, got 0"]


def test_environment_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        MathEnvironment().score([" 1", " 2"], ["1"])
