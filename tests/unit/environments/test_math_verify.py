"""The math reward equals NeMo-RL's: its own environment tests' cases, 200 pairs graded by
NeMo-RL's verify worker (tests/data/math_verify_pairs.json, whose note says how), both graders;
and the same rewards off the main thread, where math-verify's signal alarms cannot run."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_offload.config.env_settings import MathEnvSettings
from nemo_rl_offload.environments.grading_pool import GradingPool
from nemo_rl_offload.environments.math import MathEnvironment, math_reward
from nemo_rl_offload.environments.math_graders import hf_reward, warm_up

HF, DAPO = "hf_math_verify", "dapo_math_verify"
PAIRS: list[dict[str, Any]] = json.loads(
    (Path(__file__).resolve().parents[2] / "data" / "math_verify_pairs.json").read_text()
)["pairs"]

# NeMo-RL's unit tests of its math environment (tests/unit/environments/
# test_math_environment.py): (response, ground truth, reward). Its environment joins a
# conversation's assistant messages without a separator before grading.
TIMEOUT_RESPONSE = r"""We are given that \(x = (2 + \sqrt{3})^{1000}\), so \(n = \lfloor x \rfloor\), and \(f = x - n\). We want to find the value of \(x(1 - f)\).

First, let's examine the binomial expansion of \(x = (2 + \sqrt{3})^{1000}\). Notice that:
\[
(2 + \sqrt{3}) = 2 + \sqrt{3} = \left(2 - (\sqrt{3})\right)^{-1}
\]

Using the binomial theorem, we can expand \(x\):
\[
x = \sum_{k=0}^{1000} \binom{1000}{k} (2)^{1000-k} (\sqrt{3})^k
\]

Notice that \((2 - \sqrt{3}) = -1\), so we can use this to our advantage. We can rewrite \(x - 1\) as:
\[
x - 1 = (2 + \sqrt{3})^{1000} - 1 = \sum_{k=0}^{1000} \binom{1000}{k} (2)^{1000-k} (\sqrt{3})^k - 1
\]

Now, let's consider \(f = x - n = (2 + \sqrt{3})^{1000} - \lfloor (2 + \sqrt{3})^{10"""  # noqa: E501
NEMO_RL_CASES = [
    # basic
    ("2 + 2 = \\boxed{4}", "4", 1.0),
    ("3 * 4 = \\boxed{12}", "\\boxed{12}", 1.0),
    ("10 - 5 = \\boxed{5}", "\\boxed{5}", 1.0),
    # mixed
    ("2 + 2 = \\boxed{\\frac{8}{2}}", "4.0", 1.0),
    ("3 * 4 = 13", "\\boxed{12}", 0.0),
    # several assistant messages
    ("Let me think...2 + 2 = \\boxed{4}", "4", 1.0),
    ("I'll calculate that...3 * 4 = \\boxed{12}", "\\boxed{12}", 1.0),
    # the batch-size cases' sample
    ("2 + 1.333 = \\boxed{\\frac{10}{3}}", "3.33333333", 1.0),
    # a ground truth sympy cannot compare
    ("\\boxed{Eq(x**2/16 + y**2/12, 1)}", "Eq(x**2/4 + y**2/3, 1)", 0.0),
    # extracted answers stay aligned
    ("The answer is \\boxed{42}", "42", 1.0),
    ("I don't know.", "42", 0.0),
    ("The answer is \\boxed{137}", "42", 0.0),
]


@pytest.fixture(scope="module")
def helpers() -> Any:
    """Environments grading in two helper processes (started once for the module)."""
    envs = {impl: MathEnvironment(MathEnvSettings(2, impl)) for impl in (HF, DAPO)}
    yield envs
    for env in envs.values():
        env.close()


@pytest.mark.parametrize(("response", "answer", "reward"), NEMO_RL_CASES)
def test_nemo_rls_environment_cases(response: str, answer: str, reward: float) -> None:
    assert math_reward(response, answer, HF) == reward


def test_a_math_verify_timeout_scores_zero_without_hanging() -> None:
    """NeMo-RL's timeout case: sympy works on (2 + sqrt 3)^1000 until math-verify's alarm."""
    start = time.monotonic()
    assert math_reward(TIMEOUT_RESPONSE, "13", HF) == 0.0
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("impl", [HF, DAPO])
def test_the_200_pairs_score_as_in_nemo_rl(impl: str) -> None:
    got = [math_reward(p["response"], p["answer"], impl) for p in PAIRS]
    wrong = [
        (p["response"], p["answer"], p[impl], g)
        for p, g in zip(PAIRS, got, strict=True)
        if g != p[impl]
    ]
    assert wrong == []


def test_the_pairs_cover_each_kind_both_ways() -> None:
    """Every kind of pair has a right and a wrong response under math-verify, so a grader that
    always says the same thing fails the comparison above."""
    kinds = {p["kind"] for p in PAIRS}
    assert len(PAIRS) == 200
    for kind in kinds - {"wrong", "no_answer"}:
        assert {p[HF] for p in PAIRS if p["kind"] == kind} == {0.0, 1.0}, kind
    assert {p[DAPO] for p in PAIRS} == {0.0, 1.0}


@pytest.mark.parametrize("impl", [HF, DAPO])
def test_helper_processes_score_the_pairs_in_order(helpers: Any, impl: str) -> None:
    sample = PAIRS[::3]  # every kind; all 200 are compared on the main thread above
    expected = [p[impl] for p in sample]
    assert helpers[impl].score([p["response"] for p in sample], [p["answer"] for p in sample]) == (
        expected
    )


def test_helper_processes_keep_nemo_rls_cases_and_timeout(helpers: Any) -> None:
    responses = [r for r, _, _ in NEMO_RL_CASES] + [TIMEOUT_RESPONSE, " 85"]
    answers = [a for _, a, _ in NEMO_RL_CASES] + ["13", "85"]
    expected = [w for _, _, w in NEMO_RL_CASES] + [0.0, 1.0]
    assert helpers[HF].score(responses, answers) == expected
    batch = ["2 + 1.333 = \\boxed{\\frac{10}{3}}"] * 101  # NeMo-RL's largest batch case
    assert helpers[HF].score(batch, ["3.33333333"] * 101) == [1.0] * 101


def test_math_verify_alone_cannot_grade_off_the_main_thread() -> None:
    """Why the helpers exist: in a thread math-verify's alarm raises, so a right answer would
    score 0.0 there."""
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(hf_reward, " 85", "85").result() == 0.0
    assert hf_reward(" 85", "85") == 1.0


def test_the_environment_grades_correctly_from_a_thread() -> None:
    """One worker on a thread that is not the main one grades in a helper process."""
    env = MathEnvironment(MathEnvSettings(1, HF))
    sample = PAIRS[:40]
    found: list[list[float]] = []
    thread = threading.Thread(
        target=lambda: found.append(
            env.score([p["response"] for p in sample], [p["answer"] for p in sample])
        )
    )
    try:
        thread.start()
        thread.join(timeout=300)
    finally:
        env.close()
    assert found == [[p[HF] for p in sample]]


def test_math_reward_from_several_threads_at_once() -> None:
    sample = PAIRS[40:80]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: math_reward(p["response"], p["answer"], HF), sample))
    assert got == [p[HF] for p in sample]


def test_a_stuck_or_failing_call_gets_the_failed_value_and_the_rest_are_graded() -> None:
    """The backstop: a call past ``backstop_s`` (here a long sleep) is given up and the helpers
    replaced; a call that raises gets the failed value; the others keep their places."""
    pool = GradingPool(1, backstop_s=2.0, warm_up=warm_up)
    start = time.monotonic()
    try:
        assert pool.map(math_reward, [(" 1", "1"), (" 2", "1")], "failed") == [1.0, 0.0]
        assert pool.map(time.sleep, [(0,), (600,), (0,)], "failed") == [None, "failed", None]
        assert pool.map(int, [("7",), ("boom",)], "failed") == [7, "failed"]
        assert pool.map(math_reward, [(" 3", "3")], "failed") == [1.0]
    finally:
        pool.close()
    assert time.monotonic() - start < 300
