"""The math environment: reward 1.0 when a response's final number equals the answer, else 0.0.

Only the number is compared (``85``, ``85.0`` and ``85.`` are all right; so is ``1,234`` for
``1234``) because the tiny policies are graded on arithmetic, not on formatting. The *last* number
counts, so a response that works through steps ("37+48 = 85") is scored on its result, and text
after an end-of-sequence marker (what a tokenizer decodes past eos) is ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation
from typing import Any

from nemo_rl_offload.errors import UserInputError

__all__ = ["MathEnvironment", "extract_final_number", "math_reward"]

# Markers after which decoded text is junk: common eos/pad spellings of popular tokenizers.
_EOS_MARKERS = re.compile(
    r"</s>|<eos>|<pad>|<\|endoftext\|>|<\|end_of_text\|>|<\|im_end\|>|<\|eot_id\|>|<end_of_turn>"
)
# A number not glued to a preceding digit or dot, so "10-3" yields 10 and 3 (not -3); thousands
# separators only in groups of three; a trailing "." (end of sentence) is not part of it.
_NUMBER = re.compile(r"(?<![\d.])(-?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\d)")


def extract_final_number(text: str) -> str | None:
    """The last number in ``text`` before any eos-like marker, without thousands separators
    (``"-3"``, ``"1234"``, ``"2.5"``), or ``None`` when there is none."""
    text = _EOS_MARKERS.split(text, maxsplit=1)[0]
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    sign, digits, fraction = matches[-1]
    return f"{sign}{digits.replace(',', '')}{fraction}"


def _as_decimal(text: str) -> Decimal | None:
    number = extract_final_number(text)
    if number is None:
        return None
    try:
        return Decimal(number)
    except InvalidOperation:  # unreachable with the pattern above; kept as a guard
        return None


def math_reward(response: str, answer: str) -> float:
    """1.0 when the final number of ``response`` equals the number in ``answer``, else 0.0.

    An answer without any number can never be matched and scores 0.0.
    """
    got, want = _as_decimal(response), _as_decimal(answer)
    return 1.0 if got is not None and want is not None and got == want else 0.0


class MathEnvironment:
    """Scores a batch of responses against their answers, in this process.

    ``num_workers`` (``env.math.num_workers``) above 1 spreads the batch over a thread pool;
    results keep the input order, so scores are the same whatever the worker count.
    """

    def __init__(self, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise UserInputError(f"env.math.num_workers: must be at least 1, got {num_workers}")
        self.num_workers = num_workers

    @classmethod
    def from_config(cls, env_cfg: Mapping[str, Any] | None) -> MathEnvironment:
        """Build from the recipe's ``env`` section (absent means defaults)."""
        math_cfg = (env_cfg or {}).get("math") or {}
        return cls(num_workers=int(math_cfg.get("num_workers", 1)))

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        if self.num_workers == 1 or len(responses) < 2:
            return [math_reward(r, a) for r, a in zip(responses, answers, strict=True)]
        with ThreadPoolExecutor(max_workers=self.num_workers) as pool:
            return list(pool.map(math_reward, responses, answers))
