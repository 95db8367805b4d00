"""NeMo-RL's two math graders, one sample at a time, in this thread.

``hf_math_verify`` wraps the ground truth in ``\\boxed{...}``, extracts it as LaTeX, extracts the
response's answers as plain expressions or LaTeX, and rewards 1.0 when math-verify finds any of
them equal (numbers to 6 decimal places, symbolic equality otherwise). ``dapo_math_verify`` is
the string match of :mod:`.dapo_answer`. Any error or timeout scores 0.0, as in NeMo-RL.

math-verify bounds its parsing and comparisons with ``signal.alarm``, which only works on the
main thread: call these only there (``environments.math`` sends other threads' work to helper
processes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from typing import Any

from nemo_rl_offload.environments.dapo_answer import dapo_reward
from nemo_rl_offload.errors import UserInputError

__all__ = ["GRADERS", "grade", "hf_reward", "warm_up"]


@cache
def _math_verify() -> tuple[Callable[..., list[Any]], Callable[..., bool], tuple, tuple, type]:
    """math-verify's parse and verify, the gold and response extraction targets, and its
    timeout exception (imported on first use: sympy takes a second to import)."""
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    except ImportError as exc:
        raise UserInputError(
            "env.math.math_verify_impl: hf_math_verify needs the math-verify package, which is "
            f"not importable here ({exc}); install it (pip install 'math-verify>=0.9,<0.10') "
            "or use dapo_math_verify"
        ) from exc

    # Its warnings (a timeout, an answer it could not parse) are about the policy's text, once
    # per response: as NeMo-RL does, keep them out of the log.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    gold_targets = (LatexExtractionConfig(),)
    response_targets = (ExprExtractionConfig(), LatexExtractionConfig())
    return parse, verify, gold_targets, response_targets, TimeoutException


def hf_reward(response: str, answer: str) -> float:
    """NeMo-RL's ``hf_math_verify`` reward of one response (0.0 on any failure)."""
    parse, verify, gold_targets, response_targets, timeout_error = _math_verify()
    try:
        gold = parse("\\boxed{" + answer + "}", gold_targets)
        if not gold:  # a ground truth math-verify cannot read never matches
            return 0.0
        given = parse(response, response_targets)
        return 1.0 if verify(gold, given, 6) else 0.0
    except (Exception, timeout_error):  # its TimeoutException is a BaseException
        return 0.0


def warm_up() -> None:
    """Import math-verify (and sympy) now rather than in the first call."""
    _math_verify()


GRADERS: dict[str, Callable[[str, str], float]] = {
    "hf_math_verify": hf_reward,
    "dapo_math_verify": dapo_reward,
}


def grade(response: str, answer: str, impl: str) -> float:
    """The ``impl`` grader's reward of one response (main thread only, for math-verify)."""
    grader = GRADERS[impl]
    try:
        return grader(response, answer)
    except UserInputError:  # math-verify missing: not the response's fault
        raise
    except Exception:  # e.g. a ground truth that is not a string: NeMo-RL scores it 0.0
        return 0.0
