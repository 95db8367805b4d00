"""GRPO's loss_fn options: the values and combinations NeMo-RL's loss refuses are refused at
validate time, one line naming the key and the fix; NeMo-RL's recipes that use them pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.schema import grpo_loss_problems
from nemo_rl_offload.preflight import check_recipe

TINY_GRPO = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny" / "grpo.yaml"
IS = {"use_importance_sampling_correction": True}


@pytest.mark.parametrize(
    ("loss", "start"),
    [
        ({"reference_policy_kl_type": "k4"}, "loss_fn.reference_policy_kl_type: 'k4'"),
        ({"kl_input_clamp_value": 0.0}, "loss_fn.kl_input_clamp_value: must be positive"),
        ({"kl_output_clamp_value": -1}, "loss_fn.kl_output_clamp_value: must be positive"),
        ({"ratio_clip_c": 1.0}, "loss_fn.ratio_clip_c: the dual-clip bound must exceed 1"),
        ({"positive_example_nll_weight": -0.1}, "loss_fn.positive_example_nll_weight: must be"),
        (
            {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2},
            "loss_fn.truncated_importance_sampling_type: truncates importance weights",
        ),
        (
            {**IS, "truncated_importance_sampling_type": "clip"},
            "loss_fn.truncated_importance_sampling_type: 'clip' is not a truncation",
        ),
        (
            {**IS, "truncated_importance_sampling_type": "tis"},
            "loss_fn.truncated_importance_sampling_ratio: must be a positive upper bound",
        ),
        (
            {
                **IS,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 5,
            },
            "loss_fn.truncated_importance_sampling_ratio_min: must be set",
        ),
        (
            {
                **IS,
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 2,
                "truncated_importance_sampling_ratio_min": 3,
            },
            "loss_fn.truncated_importance_sampling_ratio_min: 3 is above",
        ),
        (
            {
                **IS,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.002,
                "truncated_importance_sampling_ratio_min": 0.999,
                "sequence_level_importance_ratios": True,
                "token_level_loss": False,
            },
            "loss_fn.truncated_importance_sampling_type: 'seq-mask-tis' keeps token-level",
        ),
        (
            {"truncated_importance_sampling_ratio": 2},
            "loss_fn.truncated_importance_sampling_ratio: set without",
        ),
        (
            {"sequence_level_importance_ratios": True},
            "loss_fn.sequence_level_importance_ratios: GSPO's sequence ratios need",
        ),
        ({"use_cispo": True, "disable_ppo_ratio": True}, "loss_fn.use_cispo: cannot go with"),
        ({"use_cispo": True, "force_on_policy_ratio": True}, "loss_fn.use_cispo: cannot go with"),
        ({"use_cispo": True, "token_level_loss": False}, "loss_fn.use_cispo: cannot go with"),
        ({"use_cispo": True, "ratio_clip_c": 3}, "loss_fn.use_cispo: cannot go with dual"),
    ],
)
def test_a_combination_nemo_rl_refuses_is_one_line(loss, start):
    errors, warnings = grpo_loss_problems(loss)
    assert len(errors) == 1 and errors[0].startswith(start), errors
    assert warnings == []


@pytest.mark.parametrize(
    "loss",
    [
        {},
        {"reference_policy_kl_type": "k1", "kl_input_clamp_value": None},
        {
            **IS,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 2,
        },
        {"sequence_level_importance_ratios": True, "token_level_loss": False},
        {"use_cispo": True, "ratio_clip_c": None},
        {"disable_ppo_ratio": True, "positive_example_nll_weight": 0.1},
    ],
)
def test_nemo_rl_combinations_pass(loss):
    assert grpo_loss_problems(loss) == ([], [])


def test_kl_in_reward_warns_that_no_kl_acts():
    _, warnings = grpo_loss_problems(
        {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.01}
    )
    assert len(warnings) == 1 and warnings[0].startswith("warning: loss_fn.use_kl_in_reward:")
    assert grpo_loss_problems({"use_kl_in_reward": True, "reference_policy_kl_penalty": 0}) == (
        [],
        [],
    )


def test_validate_reports_them():
    recipe = load_recipe(TINY_GRPO, ["++loss_fn.sequence_level_importance_ratios=true"])
    report = check_recipe(recipe, megatron_crosscheck=False)
    assert [e for e in report.errors if e.startswith("loss_fn.")] == [
        "loss_fn.sequence_level_importance_ratios: GSPO's sequence ratios need per-sequence "
        "averaging; set loss_fn.token_level_loss to false"
    ]
    recipe = load_recipe(
        TINY_GRPO,
        ["++loss_fn.sequence_level_importance_ratios=true", "++loss_fn.token_level_loss=false"],
    )
    assert check_recipe(recipe, megatron_crosscheck=False).ok
