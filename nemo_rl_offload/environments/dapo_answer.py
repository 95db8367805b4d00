"""The DAPO recipe's grader (NeMo-RL's ``dapo_math_verify``): a string match, no math-verify.

A response is right when the text after its last ``Answer:`` (to the end of that line, within
the response's last 300 characters) equals the ground truth once both are normalized the
Minerva way: the part after the last ``=``, without units, spaces, ``$``, ``\\text{}`` and
``\\boxed{}`` wrappers, with ``\\frac12``-style shorthand spelled out and thousands separators
dropped from plain integers. The rules and word lists follow NeMo-RL's exactly, since a reward
that differs from NeMo-RL's on any answer changes what a recipe trains.
"""

from __future__ import annotations

import re

__all__ = ["dapo_reward", "normalize_final_answer"]

# Only the tail of a response is read (NeMo-RL's window).
_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# An answer line that was never written normalizes to this, which no real answer does.
_NO_ANSWER = "[INVALID]"

# Applied in this order, each as a plain substring replacement.
_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Units, filler words and spacing commands, deleted in this order.
_DELETED: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
)
# (pattern, replacement), applied in order with re.sub.
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(.*?)\$(.*?)\$(.*)"), r"$\2$"),  # keep the first $...$ only
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_final_answer(answer: str) -> str:
    """``answer`` in the canonical form both sides are compared in."""
    text = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    for junk in _DELETED:
        text = text.replace(junk, "")
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_reward(response: str, answer: str) -> float:
    """1.0 when the last ``Answer:`` line of ``response`` matches ``answer``, else 0.0."""
    lines = _ANSWER_LINE.findall(response[-_TAIL_CHARS:])
    given = normalize_final_answer(lines[-1] if lines else _NO_ANSWER)
    return 1.0 if given == normalize_final_answer(answer) else 0.0
