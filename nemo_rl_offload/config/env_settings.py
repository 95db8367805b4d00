"""``env.math``, read once: how the math environment grades (NeMo-RL's keys and defaults).

The one reader of ``env.math.num_workers`` and ``env.math.math_verify_impl``: the algorithms
build the environment from these settings, never from the recipe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from nemo_rl_offload.errors import UserInputError

__all__ = ["DEFAULT_MATH_VERIFY_IMPL", "MATH_VERIFY_IMPLS", "MathEnvSettings", "math_env_settings"]

# NeMo-RL's graders: math-verify's symbolic comparison against the boxed ground truth, or the
# DAPO recipe's string match of the last "Answer: ..." line.
MATH_VERIFY_IMPLS: Final = ("hf_math_verify", "dapo_math_verify")
DEFAULT_MATH_VERIFY_IMPL: Final = "hf_math_verify"


@dataclass(frozen=True)
class MathEnvSettings:
    """``num_workers``: processes grading a batch (1 grades in this process);
    ``math_verify_impl``: the grader, one of :data:`MATH_VERIFY_IMPLS`."""

    num_workers: int = 1
    math_verify_impl: str = DEFAULT_MATH_VERIFY_IMPL

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int):
            problems.append(f"env.math.num_workers: must be an integer, got {self.num_workers!r}")
        elif self.num_workers < 1:
            problems.append(f"env.math.num_workers: must be at least 1, got {self.num_workers}")
        if self.math_verify_impl not in MATH_VERIFY_IMPLS:
            problems.append(
                f"env.math.math_verify_impl: unknown grader {self.math_verify_impl!r}; "
                f"use one of {', '.join(MATH_VERIFY_IMPLS)}"
            )
        if problems:
            raise UserInputError(problems)


def math_env_settings(recipe: Mapping[str, Any]) -> MathEnvSettings:
    """The recipe's ``env.math`` settings; NeMo-RL's defaults where the section or a key is
    absent (one worker, ``hf_math_verify``). A null ``math_verify_impl`` means the default."""
    math = (recipe.get("env") or {}).get("math") or {}
    impl = math.get("math_verify_impl")
    return MathEnvSettings(
        num_workers=math.get("num_workers", 1),
        math_verify_impl=DEFAULT_MATH_VERIFY_IMPL if impl is None else impl,
    )
