"""The math reward on the built-in arithmetic task's responses, ground truths that can or cannot
be graded, and the environment's batch scoring in this process."""

from __future__ import annotations

import sys

import pytest

from nemo_rl_offload.config.env_settings import MathEnvSettings
from nemo_rl_offload.environments.math import (
    MathEnvironment,
    answer_is_gradable,
    math_reward,
)
from nemo_rl_offload.errors import UserInputError

HF, DAPO = "hf_math_verify", "dapo_math_verify"


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        # What the tiny policies write after "Q: 37+48=? A:": the same reward as the former
        # last-number grader...
        (" 85", "85", 1.0),
        (" 84", "85", 0.0),
        (" 855", "85", 0.0),
        (" 8", "85", 0.0),
        (" 85.", "85", 1.0),
        (" 85 85", "85", 1.0),
        (" 0", "0", 1.0),
        ("37+48 = 85", "85", 1.0),
        ("37+48 = 84", "85", 0.0),
        (" 85 because 37 and 48", "85", 0.0),  # the last expression counts
        (" 8 5", "85", 0.0),
        ("", "85", 0.0),
        (" eighty-five", "85", 0.0),
        # ...except a bare expression, which math-verify evaluates (as in NeMo-RL).
        (" 37+48", "85", 1.0),
        (" 12*3", "36", 1.0),
        (" 50-8", "42", 1.0),
        (" 37+48=?", "85", 0.0),
    ],
)
def test_arithmetic_responses_under_math_verify(response: str, answer: str, reward: float) -> None:
    assert math_reward(response, answer) == reward
    assert math_reward(response, answer, HF) == reward


def test_dapo_needs_an_answer_line() -> None:
    """The DAPO grader reads only an ``Answer:`` line: the arithmetic task's bare numbers are
    never rewarded under it."""
    assert math_reward(" 85", "85", DAPO) == 0.0
    assert math_reward("37+48 = 85\nAnswer: 85", "85", DAPO) == 1.0
    assert math_reward("Answer: 85 dollars", "85", DAPO) == 1.0
    assert math_reward("Answer: 84", "85", DAPO) == 0.0


def test_an_unknown_grader_is_refused() -> None:
    with pytest.raises(UserInputError) as info:
        math_reward(" 1", "1", "sympy")
    assert info.value.problems == [
        "env.math.math_verify_impl: unknown grader 'sympy'; use one of hf_math_verify, "
        "dapo_math_verify"
    ]
    with pytest.raises(UserInputError):
        answer_is_gradable("1", "sympy")


@pytest.mark.parametrize(
    ("answer", "hf", "dapo"),
    [
        ("85", True, True),
        ("-3", True, True),
        ("1,234", True, True),
        ("\\frac{1}{2}", True, True),
        ("2\\sqrt{3}", True, True),
        ("\\boxed{12}", True, True),
        ("x^2 + 1", True, True),
        ("", False, True),  # "Answer: " normalizes to "" as well
        ("  ", False, True),
        ("}", False, True),
        ("1\n2", True, False),  # an Answer: line ends at the newline
    ],
)
def test_answer_is_gradable(answer: str, hf: bool, dapo: bool) -> None:
    assert answer_is_gradable(answer) is hf
    assert answer_is_gradable(answer, HF) is hf
    assert answer_is_gradable(answer, DAPO) is dapo


def test_environment_scores_in_order_in_this_process() -> None:
    responses = [" 1", " 2", " x", " 4"] * 10
    answers = ["1", "3", "5", "4"] * 10
    env = MathEnvironment(MathEnvSettings())
    assert env.score(responses, answers) == [1.0, 0.0, 0.0, 1.0] * 10
    assert env.score([], []) == []
    dapo = MathEnvironment(MathEnvSettings(math_verify_impl=DAPO))
    assert dapo.score(["Answer: 1", " 1"], ["1", "1"]) == [1.0, 0.0]


def test_environment_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        MathEnvironment(MathEnvSettings()).score([" 1", " 2"], ["1"])


def test_a_missing_math_verify_is_reported_not_scored_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_rl_offload.environments import math_graders

    math_graders._math_verify.cache_clear()
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now fails
    try:
        with pytest.raises(UserInputError) as info:
            MathEnvironment(MathEnvSettings())
        assert info.value.problems[0].startswith(
            "env.math.math_verify_impl: hf_math_verify needs the math-verify package"
        )
        with pytest.raises(UserInputError):
            math_reward(" 1", "1")
        dapo = MathEnvironment(MathEnvSettings(math_verify_impl=DAPO))  # needs no math-verify
        assert dapo.score(["Answer: 1"], ["1"]) == [1.0]
    finally:
        monkeypatch.undo()
        math_graders._math_verify.cache_clear()
    assert math_reward(" 1", "1") == 1.0
