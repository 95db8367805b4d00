"""The math environment: NeMo-RL's math reward, 1.0 for a right answer and 0.0 otherwise.

``env.math.math_verify_impl`` picks the grader, as in NeMo-RL: ``hf_math_verify`` (the default;
math-verify compares the response's answer with ``\\boxed{ground truth}`` symbolically, so
``\\frac{8}{2}``, ``4.0`` and ``4`` all match ``4``) or ``dapo_math_verify`` (the last
``Answer: ...`` line, normalized, must equal the normalized ground truth). Responses are graded as
decoded (special tokens skipped, as NeMo-RL decodes them); any error or timeout scores 0.0.

math-verify's timeouts are signal alarms, which work only on a process's main thread: on the
main thread with one worker the batch is graded in this process; with ``env.math.num_workers``
above 1, or from any other thread, it goes to helper processes (:mod:`.grading_pool`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from nemo_rl_offload.config.env_settings import DEFAULT_MATH_VERIFY_IMPL, MathEnvSettings
from nemo_rl_offload.environments.dapo_answer import normalize_final_answer
from nemo_rl_offload.environments.grading_pool import GradingPool
from nemo_rl_offload.environments.math_graders import grade, warm_up

__all__ = ["MathEnvironment", "answer_is_gradable", "math_reward"]

_shared_helper: GradingPool | None = None
_shared_helper_lock = threading.Lock()


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _helper() -> GradingPool:
    """One helper process for single calls made off the main thread."""
    global _shared_helper
    with _shared_helper_lock:
        if _shared_helper is None:
            _shared_helper = GradingPool(1, warm_up=warm_up)
        return _shared_helper


def _checked(impl: str) -> str:
    return MathEnvSettings(math_verify_impl=impl).math_verify_impl  # refuses unknown graders


def math_reward(response: str, answer: str, impl: str = DEFAULT_MATH_VERIFY_IMPL) -> float:
    """NeMo-RL's reward of ``response`` for the ground truth ``answer`` under grader ``impl``."""
    _checked(impl)
    if _on_main_thread():
        return grade(response, answer, impl)
    return _helper().map(grade, [(response, answer, impl)], 0.0)[0]


def _canonical_responses(answer: str, impl: str) -> list[str]:
    """Responses that state ``answer`` as plainly as the grader reads answers."""
    if impl == "dapo_math_verify":
        return [f"Answer: {answer}", f"Answer: {normalize_final_answer(answer)}"]
    return ["\\boxed{" + answer + "}", f"${answer}$", answer]


def _gradable(answer: str, impl: str) -> bool:
    return any(grade(r, answer, impl) == 1.0 for r in _canonical_responses(answer, impl))


def answer_is_gradable(answer: str, impl: str = DEFAULT_MATH_VERIFY_IMPL) -> bool:
    """Whether some response can score 1.0 against the ground truth ``answer`` under ``impl``
    (tested with the answer itself stated plainly): one that cannot (math-verify reads nothing
    in it, or an ``Answer:`` line could never hold it) makes its example's reward always 0."""
    _checked(impl)
    if _on_main_thread():
        return _gradable(answer, impl)
    return _helper().map(_gradable, [(answer, impl)], False)[0]


class MathEnvironment:
    """Scores a batch of responses against their ground truths; results keep the input order,
    so scores are the same whatever the worker count."""

    def __init__(self, settings: MathEnvSettings) -> None:
        self.settings = settings
        self._helpers: GradingPool | None = None
        if settings.math_verify_impl == "hf_math_verify":
            warm_up()  # a missing math-verify is reported now, not as a run of zero rewards

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        impl = self.settings.math_verify_impl
        jobs = [(r, a, impl) for r, a in zip(responses, answers, strict=True)]
        if not jobs:
            return []
        if self.settings.num_workers == 1 and _on_main_thread():
            return [grade(*job) for job in jobs]
        if self._helpers is None:
            hf = self.settings.math_verify_impl == "hf_math_verify"
            self._helpers = GradingPool(self.settings.num_workers, warm_up=warm_up if hf else None)
        return self._helpers.map(grade, jobs, 0.0)

    def close(self) -> None:
        """Stop the helper processes, if any (they also stop when the environment is freed)."""
        if self._helpers is not None:
            self._helpers.close()
