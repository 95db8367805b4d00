"""The built-in arithmetic task: format, determinism, correct answers, disjoint splits."""

from __future__ import annotations

import re

import pytest

from nemo_rl_offload.data import arithmetic
from nemo_rl_offload.data.arithmetic import ArithmeticSpec, Problem
from nemo_rl_offload.errors import UserInputError

PROMPT = re.compile(r"^Q: (\d+)([+\-*])(\d+)=\? A:$")


def _evaluate(prompt: str) -> int:
    match = PROMPT.match(prompt)
    assert match, prompt
    a, op, b = int(match[1]), match[2], int(match[3])
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_problems_are_correct_and_non_negative() -> None:
    problems = arithmetic.make_problems(500, seed=0)
    assert len(problems) == 500
    for p in problems:
        assert isinstance(p, Problem)
        assert int(p.answer) == _evaluate(p.prompt) >= 0
        assert p.response == f" {p.answer}"
    assert {PROMPT.match(p.prompt)[2] for p in problems} == {"+", "-", "*"}


def test_same_seed_same_data_other_seed_other_data() -> None:
    assert arithmetic.make_problems(50, 1) == arithmetic.make_problems(50, 1)
    assert arithmetic.make_problems(50, 1) != arithmetic.make_problems(50, 2)
    for fn in (arithmetic.sft_examples, arithmetic.preference_pairs):
        assert fn(30, 7) == fn(30, 7)
        assert fn(30, 7) != fn(30, 8)


def test_kinds_share_the_problems_of_a_seed() -> None:
    problems = arithmetic.make_problems(20, 3)
    sft = arithmetic.sft_examples(20, 3)
    prefs = arithmetic.preference_pairs(20, 3)
    prompts = arithmetic.prompts_with_answers(20, 3)
    assert sft == [{"prompt": p.prompt, "response": f" {p.answer}"} for p in problems]
    assert prompts == [{"prompt": p.prompt, "answer": p.answer} for p in problems]
    assert [(d["prompt"], d["chosen"]) for d in prefs] == [
        (d["prompt"], d["response"]) for d in sft
    ]


def test_rejected_is_a_plausible_wrong_answer() -> None:
    for pair in arithmetic.preference_pairs(2000, 11):
        assert pair["rejected"] != pair["chosen"]
        wrong, right = int(pair["rejected"]), int(pair["chosen"])
        assert wrong >= 0 and abs(wrong - right) in (1, 2, 10)
        assert pair["rejected"] == f" {wrong}"


def test_spec_controls_ops_and_ranges() -> None:
    spec = ArithmeticSpec(ops=("-",), max_operand=9)
    problems = arithmetic.make_problems(200, 0, spec)
    for p in problems:
        match = PROMPT.match(p.prompt)
        assert match[2] == "-" and int(match[1]) <= 9 and int(match[3]) <= 9
        assert int(p.answer) >= 0
    assert spec.num_distinct() == 55
    with pytest.raises(ValueError):
        ArithmeticSpec(ops=("/",))


@pytest.mark.parametrize("kind", ["sft", "preference", "prompts"])
def test_split_is_disjoint_and_deterministic(kind: str) -> None:
    train, val = arithmetic.split(kind, 3000, 300, seed=42)
    assert (len(train), len(val)) == (3000, 300)
    val_prompts = {ex["prompt"] for ex in val}
    assert len(val_prompts) == 300  # validation problems are distinct
    assert not val_prompts & {ex["prompt"] for ex in train}
    assert arithmetic.split(kind, 3000, 300, seed=42) == (train, val)
    assert arithmetic.split(kind, 3000, 300, seed=43)[1] != val


def test_split_stays_disjoint_when_train_exceeds_the_space() -> None:
    spec = ArithmeticSpec(ops=("+",), max_operand=4)  # 25 distinct problems
    train, val = arithmetic.split("prompts", 200, 12, seed=0, spec=spec)
    val_prompts = {ex["prompt"] for ex in val}
    train_prompts = {ex["prompt"] for ex in train}
    assert len(val_prompts) == 12 and len(train) == 200
    assert not val_prompts & train_prompts
    assert len(train_prompts) == 25 - 12  # every remaining problem is used


def test_recipe_sizes_fit_the_default_space() -> None:
    train, val = arithmetic.split("sft", 20000, 256, seed=42)
    assert len(train) == 20000 and len(val) == 256


def test_split_rejects_impossible_val_size() -> None:
    spec = ArithmeticSpec(ops=("*",), max_factor=3)  # 16 distinct problems
    with pytest.raises(UserInputError) as info:
        arithmetic.split("sft", 10, 9, seed=0, spec=spec)
    assert info.value.problems[0].startswith("data.num_val_samples: 9 is too many")
    with pytest.raises(UserInputError, match=r"^data\.num_train_samples: must not be negative"):
        arithmetic.split("sft", -1, 0, seed=0)
