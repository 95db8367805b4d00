"""GRPO's advantages equal to NeMo-RL's (algorithms/advantages.py): the expected values of
NeMo-RL's own unit tests (tests/unit/algorithms/test_utils.py and test_grpo.py at 7ea279ab),
then every group size 2..16 with each setting of leave-one-out and normalisation against the
definition worked in float64, the zero-spread and near-constant cases, where the settings are
read from, and dynamic sampling's per-sample filter."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from nemo_rl_offload.algorithms import advantages, rewards
from nemo_rl_offload.algorithms.advantages import AdvantageSettings

BOTH = [(loo, norm) for loo in (True, False) for norm in (True, False)]


def keys_of(*sizes: int) -> list[int]:
    """Prompt keys for consecutive groups of the given sizes."""
    return [index for index, size in enumerate(sizes) for _ in range(size)]


# ------------------------------------------------------------- NeMo-RL's documented values


def test_baseline_and_std_leave_one_out_as_nemo_rls_tests_expect():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    baseline, std = advantages.baseline_and_std(values, keys_of(3, 3), leave_one_out=True)
    assert baseline.tolist() == pytest.approx([2.5, 2.0, 1.5, 5.5, 5.0, 4.5], rel=1e-5)
    expected = [0.707107, 1.414214, 0.707107] * 2
    assert std.tolist() == pytest.approx(expected, rel=1e-5)


def test_one_sample_per_prompt_is_its_own_baseline_with_no_spread():
    baseline, std = advantages.baseline_and_std(
        torch.tensor([2.5, 4.0]), keys_of(1, 1), leave_one_out=True
    )
    assert baseline.tolist() == [2.5, 4.0] and std.tolist() == [0.0, 0.0]


def test_identical_rewards_have_no_spread():
    values = torch.tensor([3.0, 3.0, 3.0, 7.0, 7.0, 7.0])
    baseline, std = advantages.baseline_and_std(values, keys_of(3, 3), leave_one_out=True)
    assert baseline.tolist() == [3.0, 3.0, 3.0, 7.0, 7.0, 7.0]
    assert std.tolist() == [0.0] * 6


def test_groups_of_different_sizes_and_one_other_sample_gives_no_spread():
    values = torch.tensor([1.0, 2.0, 4.0, 5.0, 6.0])
    baseline, std = advantages.baseline_and_std(values, keys_of(2, 3), leave_one_out=True)
    assert baseline.tolist() == pytest.approx([2.0, 1.0, 5.5, 5.0, 4.5], rel=1e-5)
    assert std.tolist() == pytest.approx([0.0, 0.0, 0.707107, 1.414214, 0.707107], rel=1e-5)


def test_no_samples_give_empty_baselines():
    baseline, std = advantages.baseline_and_std(torch.tensor([]), [], leave_one_out=True)
    assert baseline.shape == std.shape == (0,)


def test_a_prompt_without_spread_is_not_normalised_the_other_is():
    plain = AdvantageSettings(normalize=True, leave_one_out=False)
    out = advantages.group_advantages(torch.tensor([2.0, 2.0, 1.0, 3.0]), keys_of(2, 2), plain)
    half = 1 / math.sqrt(2)
    assert out.tolist() == pytest.approx([0.0, 0.0, -half, half], rel=1e-4)


def test_nemo_rls_estimator_cases_without_leave_one_out():
    plain = AdvantageSettings(normalize=True, leave_one_out=False)
    half = 1 / math.sqrt(2)
    pair = advantages.group_advantages(torch.tensor([1.0, 3.0]), keys_of(2), plain)
    assert pair.tolist() == pytest.approx([-half, half], rel=1e-4)
    ramp = advantages.group_advantages(torch.arange(10, dtype=torch.float32), keys_of(10), plain)
    assert abs(ramp.mean().item()) < 1e-5
    spread = advantages.group_advantages(torch.tensor([0.0, 2.0, 4.0]), keys_of(3), plain)
    assert spread[0] < 0 and abs(spread[1].item()) < 1e-5 and spread[0] == -spread[2]
    same = advantages.group_advantages(torch.full((4,), 5.0), keys_of(4), plain)
    assert same.tolist() == [0.0] * 4
    small = advantages.group_advantages(torch.tensor([1.0, 1.01]), keys_of(2), plain)
    assert small.abs().tolist() == pytest.approx([half, half], rel=1e-3)
    assert small[0] * small[1] < 0  # a small spread is still normalised


# ------------------------------------------------ every group size, both flags, by definition


def by_definition(values: list[float], loo: bool, norm: bool) -> list[float]:
    """Worked in float64 from the definition: each sample against the others (leave-one-out)
    or against its whole group, divided by that spread (+1e-6) where it is not 0."""
    out = []
    for index, value in enumerate(values):
        pool = values[:index] + values[index + 1 :] if loo else values
        if len(values) <= 1:
            base, spread = value, 0.0
        else:
            base = statistics.fmean(pool)
            spread = statistics.stdev(pool) if len(pool) >= 2 else 0.0
        advantage = value - base
        if norm and spread > 0:
            advantage /= spread + advantages.EPSILON
        out.append(advantage)
    return out


def patterns(size: int) -> dict[str, list[float]]:
    return {
        "one right": [1.0] + [0.0] * (size - 1),
        "half right": [float(i % 2) for i in range(size)],
        "all but one right": [0.0] + [1.0] * (size - 1),
        "ramp": [i / size for i in range(size)],
        "all right": [1.0] * size,
        "all wrong": [0.0] * size,
    }


@pytest.mark.parametrize("size", range(2, 17))
@pytest.mark.parametrize(("loo", "norm"), BOTH)
def test_every_group_size_and_setting_matches_the_definition(size, loo, norm):
    settings = AdvantageSettings(normalize=norm, leave_one_out=loo)
    cases = patterns(size)
    # all patterns in one batch: each prompt's samples only see their own prompt's
    flat = [v for values in cases.values() for v in values]
    keys = [name for name, values in cases.items() for _ in values]
    got = advantages.group_advantages(torch.tensor(flat), keys, settings).tolist()
    want = [a for values in cases.values() for a in by_definition(values, loo, norm)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("size", range(2, 17))
def test_one_right_answer_among_the_group_in_closed_form(size):
    """NeMo-RL's default (leave-one-out, normalised): the right answer's others all scored 0,
    so its advantage is left at 1.0 (the whole group's spread would make it sqrt(size)); each
    wrong one is -1/sqrt(size - 1). Without leave-one-out: (size - 1)/sqrt(size) and
    -1/sqrt(size)."""
    values = torch.tensor([1.0] + [0.0] * (size - 1))
    loo = advantages.group_advantages(values, keys_of(size), AdvantageSettings())
    assert loo[0].item() == 1.0
    assert loo[1:].tolist() == pytest.approx([-1 / math.sqrt(size - 1)] * (size - 1), rel=1e-5)
    whole = advantages.group_advantages(
        values, keys_of(size), AdvantageSettings(leave_one_out=False)
    )
    assert whole[0].item() == pytest.approx((size - 1) / math.sqrt(size), rel=1e-5)
    assert whole[1:].tolist() == pytest.approx([-1 / math.sqrt(size)] * (size - 1), rel=1e-5)


def test_the_issue_example_group_of_16_one_right_gives_it_1_not_4():
    values = torch.tensor([1.0] + [0.0] * 15)
    assert advantages.group_advantages(values, keys_of(16), AdvantageSettings())[0] == 1.0


@pytest.mark.parametrize("size", range(2, 17))
def test_a_near_constant_group_is_normalised_not_zeroed(size):
    """A spread of ~1e-8 (<= 1e-6) is not 0, so NeMo-RL divides by it (+1e-6)."""
    values = [0.0] * (size - 1) + [1e-7]
    got = advantages.group_advantages(
        torch.tensor(values), keys_of(size), AdvantageSettings(leave_one_out=False)
    )
    want = by_definition(values, loo=False, norm=True)
    assert got[-1].item() > 0.01  # no longer zeroed
    assert got.tolist() == pytest.approx(want, rel=1e-4)


def test_samples_of_the_same_prompt_tokens_share_one_baseline():
    """NeMo-RL groups by the prompt's tokens: two groups of one prompt are one group."""
    values = torch.tensor([1.0, 0.0, 0.0, 0.0])
    split = advantages.group_advantages(values, ["p", "p", "q", "q"], AdvantageSettings())
    merged = advantages.group_advantages(values, ["p"] * 4, AdvantageSettings())
    assert split.tolist() != merged.tolist()
    assert merged.tolist() == pytest.approx(by_definition(values.tolist(), True, True), rel=1e-5)


# ------------------------------------------------------------------- where the flags come from


@pytest.mark.parametrize(
    ("grpo", "want"),
    [
        ({}, AdvantageSettings(True, True)),
        ({"adv_estimator": None}, AdvantageSettings(True, True)),
        ({"adv_estimator": {"name": "grpo"}}, AdvantageSettings(True, True)),
        (
            {"adv_estimator": {"normalize_rewards": False, "use_leave_one_out_baseline": False}},
            AdvantageSettings(False, False),
        ),
        # grpo's own keys reach the estimator only through the section (NeMo-RL's recipes
        # interpolate them into it); alone they change nothing there
        (
            {"normalize_rewards": False, "use_leave_one_out_baseline": False},
            AdvantageSettings(True, True),
        ),
    ],
)
def test_settings_are_read_from_adv_estimator_with_nemo_rls_defaults(grpo, want):
    assert AdvantageSettings.from_recipe(grpo) == want


# ----------------------------------------------------------------- dynamic sampling, per sample


def test_dynamic_sampling_keeps_samples_by_their_own_spread():
    groups = [
        torch.tensor([1.0, 0.0, 0.0, 0.0]),
        torch.tensor([1.0, 1.0, 1.0, 1.0]),
        torch.tensor([1.0, 0.0, 1.0, 0.0]),
        torch.tensor([1.0, 0.0]),
    ]
    loo = rewards.dynamic_sampling_keep(groups, ["a", "b", "c", "d"], leave_one_out=True)
    # the lone right answer's others never differ: it is dropped, the wrong ones kept; a
    # pair's samples each have one other, so no spread
    assert loo == [[False, True, True, True], [False] * 4, [True] * 4, [False, False]]
    whole = rewards.dynamic_sampling_keep(groups, ["a", "b", "c", "d"], leave_one_out=False)
    assert whole == [[True] * 4, [False] * 4, [True] * 4, [True, True]]
