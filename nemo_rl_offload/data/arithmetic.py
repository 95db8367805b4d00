"""The built-in arithmetic task: small problems with exactly checkable answers.

It exists so that every algorithm (SFT, DPO, GRPO, distillation) can run end to end with no
download: the data is generated locally from a seed, the reward is exact, and the format is short
enough that a 2-layer byte-level model learns it within a few hundred steps. A prompt reads
``"Q: 37+48=? A:"`` and the expected response is ``" 85"`` (the model then emits eos).

Determinism: everything comes from ``random.Random(seed)`` (and a second stream derived from the
seed for wrong answers), so the same seed gives the same data in every process and Python run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from nemo_rl_offload.errors import UserInputError

__all__ = [
    "DEFAULT_SPEC",
    "ArithmeticSpec",
    "Kind",
    "Problem",
    "make_problems",
    "preference_pairs",
    "prompts_with_answers",
    "sft_examples",
    "split",
]

Kind = Literal["sft", "preference", "prompts"]
_OPS = ("+", "-", "*")


@dataclass(frozen=True)
class Problem:
    """One problem: the prompt shown to the model and the answer as digits (no leading space)."""

    prompt: str
    answer: str

    @property
    def response(self) -> str:
        """The target completion; the leading space separates it from ``A:``."""
        return f" {self.answer}"


@dataclass(frozen=True)
class ArithmeticSpec:
    """Which problems to draw: operators, and operand ranges (0..max inclusive).

    Multiplication has its own, smaller range because products grow fast and long answers slow
    down learning for the tiny models. Subtraction puts the larger operand first so answers are
    never negative.
    """

    ops: tuple[str, ...] = _OPS
    max_operand: int = 99
    max_factor: int = 12

    def __post_init__(self) -> None:
        if not self.ops or any(op not in _OPS for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {_OPS}, got {self.ops}")
        if self.max_operand < 1 or self.max_factor < 1:
            raise ValueError("max_operand and max_factor must be at least 1")

    def num_distinct(self) -> int:
        """How many different problems this spec can produce."""
        n, f = self.max_operand + 1, self.max_factor + 1
        sizes = {"+": n * n, "-": n * (n + 1) // 2, "*": f * f}
        return sum(sizes[op] for op in set(self.ops))


DEFAULT_SPEC = ArithmeticSpec()


def _draw(rng: random.Random, spec: ArithmeticSpec) -> Problem:
    op = rng.choice(spec.ops)
    top = spec.max_factor if op == "*" else spec.max_operand
    a, b = rng.randint(0, top), rng.randint(0, top)
    if op == "-" and a < b:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(prompt=f"Q: {a}{op}{b}=? A:", answer=str(value))


def make_problems(n: int, seed: int, spec: ArithmeticSpec = DEFAULT_SPEC) -> list[Problem]:
    """``n`` problems drawn independently (so repeats are possible)."""
    rng = random.Random(seed)
    return [_draw(rng, spec) for _ in range(n)]


def _wrong_answer(answer: str, rng: random.Random) -> str:
    """A near miss (off by one, two or ten), the kind of mistake a model actually makes; never
    the right answer and never negative."""
    right = int(answer)
    candidates = [right + d for d in (-10, -2, -1, 1, 2, 10) if right + d >= 0]
    return str(rng.choice(candidates))


def _as_kind(problems: list[Problem], kind: Kind, seed: int) -> list[dict[str, str]]:
    if kind == "sft":
        return [{"prompt": p.prompt, "response": p.response} for p in problems]
    if kind == "prompts":
        return [{"prompt": p.prompt, "answer": p.answer} for p in problems]
    if kind == "preference":
        # A separate stream keeps the problems identical to the sft/prompts data of this seed.
        rng = random.Random(f"{seed}:rejected")
        return [
            {
                "prompt": p.prompt,
                "chosen": p.response,
                "rejected": f" {_wrong_answer(p.answer, rng)}",
            }
            for p in problems
        ]
    raise ValueError(f"unknown kind {kind!r}; use sft, preference or prompts")


def sft_examples(n: int, seed: int, spec: ArithmeticSpec = DEFAULT_SPEC) -> list[dict[str, str]]:
    """``{"prompt", "response"}`` pairs for supervised fine-tuning."""
    return _as_kind(make_problems(n, seed, spec), "sft", seed)


def preference_pairs(
    n: int, seed: int, spec: ArithmeticSpec = DEFAULT_SPEC
) -> list[dict[str, str]]:
    """``{"prompt", "chosen", "rejected"}`` triples for DPO; ``rejected`` is a wrong answer."""
    return _as_kind(make_problems(n, seed, spec), "preference", seed)


def prompts_with_answers(
    n: int, seed: int, spec: ArithmeticSpec = DEFAULT_SPEC
) -> list[dict[str, str]]:
    """``{"prompt", "answer"}`` pairs for GRPO and distillation (the reward checks ``answer``)."""
    return _as_kind(make_problems(n, seed, spec), "prompts", seed)


def split(
    kind: Kind, n_train: int, n_val: int, seed: int, spec: ArithmeticSpec = DEFAULT_SPEC
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Train and validation data with no problem in both, so validation measures generalisation.

    Validation problems are distinct and drawn first; train problems are drawn from everything
    else. Train may repeat a problem: the default spec has about 15 thousand distinct problems,
    fewer than the recipes' 20 thousand training samples.
    """
    if n_train < 0:
        raise UserInputError(f"data.num_train_samples: must not be negative, got {n_train}")
    if n_val < 0:
        raise UserInputError(f"data.num_val_samples: must not be negative, got {n_val}")
    distinct = spec.num_distinct()
    if n_val > distinct // 2:
        raise UserInputError(
            f"data.num_val_samples: {n_val} is too many; the arithmetic task has {distinct} "
            f"distinct problems and at most half ({distinct // 2}) may go to validation"
        )
    rng = random.Random(seed)
    val: list[Problem] = []
    held_out: set[str] = set()
    while len(val) < n_val:
        problem = _draw(rng, spec)
        if problem.prompt not in held_out:
            held_out.add(problem.prompt)
            val.append(problem)
    train: list[Problem] = []
    while len(train) < n_train:
        problem = _draw(rng, spec)
        if problem.prompt not in held_out:
            train.append(problem)
    return _as_kind(train, kind, seed), _as_kind(val, kind, seed + 1)
