"""On-policy distillation's rules (config/on_policy_distillation.py), each both ways on the tiny
GRPO recipe; its routing of samples to teachers (NeMo-RL's resolve_reference_aliases); the
teachers' sections; and each token's advantage (algorithms/opd.py)."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.opd import response_mask, token_advantages
from nemo_rl_offload.config import on_policy_distillation as opd
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.preflight import check_recipe

pytest.importorskip("megatron.core")

ON = "++on_policy_distillation={enabled: true, default_teacher_alias: a, teacher_model_by_agent_name: {a: tiny-dense}}"  # noqa: E501
OPD = "++grpo.adv_estimator={name: opd}"


def report_for(*overrides: str):
    recipe = load_recipe("examples/configs/tiny/grpo.yaml", list(overrides))
    return check_recipe(recipe, megatron_crosscheck=False)


def _lines(report) -> str:
    return "\n".join(report.errors + report.warnings)


def test_a_distillation_recipe_validates():
    report = report_for(ON, OPD)
    assert report.errors == [], report.errors
    assert opd.enabled(report.recipe)


BAD = [
    # The estimator without the teachers: NeMo-RL fails at its first step.
    ([OPD], "grpo.adv_estimator.name: 'opd'"),
    (
        [
            OPD,
            "++on_policy_distillation={enabled: true, default_teacher_alias: b, "
            "teacher_model_by_agent_name: {a: tiny-dense}}",
        ],
        "on_policy_distillation.default_teacher_alias: 'b' is not an alias",
    ),
    (
        [OPD, "++on_policy_distillation={enabled: true, teacher_model_by_agent_name: {}}"],
        "on_policy_distillation.teacher_model_by_agent_name: empty",
    ),
    # This backend's own rollouts carry no agent: the default teacher must exist.
    (
        [
            OPD,
            "++on_policy_distillation={enabled: true, "
            "teacher_model_by_agent_name: {a: tiny-dense}}",
        ],
        "on_policy_distillation.default_teacher_alias: this backend's own rollouts",
    ),
    (
        [OPD, ON, "++loss_fn.force_on_policy_ratio=true"],
        "loss_fn.force_on_policy_ratio: with it and no grpo.seq_logprob_error_threshold",
    ),
    (
        [
            OPD,
            ON,
            "++on_policy_distillation.non_colocated_teachers={default_teacher_cfg: "
            "{tensor_model_parallel_size: 0}}",
        ],
        "default_teacher_cfg.tensor_model_parallel_size: 0 is not a whole number",
    ),
    (
        [
            OPD,
            ON,
            "++on_policy_distillation.non_colocated_teachers={default_teacher_cfg: "
            "{precision: fp64}}",
        ],
        "default_teacher_cfg.precision: 'fp64' is not a precision",
    ),
    (
        [
            OPD,
            ON,
            "++on_policy_distillation.non_colocated_teachers={teacher_overrides: "
            "{b: {micro_batch_size: 2}}}",
        ],
        "teacher_overrides.b: 'b' is not an alias",
    ),
    (
        [
            OPD,
            ON,
            "++on_policy_distillation.non_colocated_teachers={default_teacher_cfg: "
            "{sequence_paralel: true}}",
        ],
        "default_teacher_cfg.sequence_paralel: not a megatron_cfg setting (did you mean "
        "sequence_parallel?)",
    ),
    (
        [
            OPD,
            ON,
            "++on_policy_distillation.non_colocated_teachers={default_teacher_cfg: "
            "{megatron_cfg_overrides: {sequence_parallel: 'yes'}}}",
        ],
        "default_teacher_cfg.sequence_parallel: input should be a valid boolean",
    ),
    (
        [
            OPD,
            ON,
            "++on_policy_distillation.teacher_model_by_agent_name.a=llama-1b",
        ],
        "on_policy_distillation.teacher_model_by_agent_name.a: llama-1b's vocabulary",
    ),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[e.split(":")[0] for _, e in BAD])
def test_each_rule_refuses_in_one_line(overrides, expected):
    report = report_for(*overrides)
    assert any(expected in line for line in report.errors), report.errors


def test_the_same_settings_done_right_pass():
    report = report_for(
        OPD,
        ON,
        "++loss_fn.force_on_policy_ratio=true",
        "++grpo.seq_logprob_error_threshold=2.0",
        "++on_policy_distillation.non_colocated_teachers={enabled: true, default_teacher_cfg: "
        "{tensor_model_parallel_size: 2, precision: bf16, micro_batch_size: 4, "
        "sequence_parallel: true}, teacher_overrides: {a: {micro_batch_size: 2}}}",
    )
    assert report.errors == [], report.errors
    assert "non_colocated_teachers: teachers run on the policy's workers" in _lines(report)


def test_the_section_without_the_estimator_is_a_warning_and_starts_no_teacher():
    report = report_for(ON)
    assert report.errors == []
    assert "only by grpo.adv_estimator.name 'opd'" in _lines(report)
    assert not opd.enabled(report.recipe)


def test_shared_models_are_one_group_and_deduplication_off_is_reported():
    report = report_for(
        OPD,
        "++on_policy_distillation={enabled: true, default_teacher_alias: a, "
        "deduplicate_shared_teacher_checkpoints: false, "
        "teacher_model_by_agent_name: {a: tiny-dense, b: tiny-dense, c: tiny-moe}}",
    )
    assert report.errors == [], report.errors
    assert "aliases a, b name the same model" in _lines(report)
    sections = opd.teacher_sections(report.recipe)
    assert sorted(sections) == ["a", "c"]
    assert sections["c"]["model_name"] == "tiny-moe"
    routing = opd.routing(report.recipe)
    assert routing.groups(["b", "c", None, "unknown"]) == ["a", "c", "a", "a"]
    assert routing.metrics(["a", "b", "c"]) == {
        "on_policy_distillation/teacher_alias_unique": 3.0,
        "on_policy_distillation/teacher_model_unique": 2.0,
        "on_policy_distillation/teacher_alias_to_model_compression": 2 / 3,
    }


def test_a_teacher_section_is_the_policy_s_with_the_teacher_s_settings():
    report = report_for(
        OPD,
        ON,
        "policy.megatron_cfg.model_overrides={num_layers: 3}",
        "++on_policy_distillation.teacher_model_by_agent_name.b=tiny-moe",
        "++on_policy_distillation.non_colocated_teachers={default_teacher_cfg: "
        "{precision: bf16, micro_batch_size: 4, sequence_parallel: false}, "
        "teacher_overrides: {b: {tensor_model_parallel_size: 2}}}",
    )
    assert report.errors == [], report.errors
    sections = opd.teacher_sections(report.recipe)
    same, other = sections["a"], sections["b"]
    assert "init_checkpoint" not in same  # the model's own initial weights, not the policy's
    assert same["precision"] == "bfloat16" and same["logprob_batch_size"] == 4
    assert same["megatron_cfg"]["model_overrides"] == {"num_layers": 3}  # the policy's model
    assert "model_overrides" not in other["megatron_cfg"]  # another model: as its name says
    assert other["megatron_cfg"]["tensor_model_parallel_size"] == 2
    assert same["megatron_cfg"]["sequence_parallel"] is False


def test_routing_is_nemo_rl_s():
    routing = opd.TeacherRouting({"a": "m", "b": "n"}, {"a": "a", "b": "b"}, "a", strict=False)
    assert routing.aliases(["b", "x", None]) == ["b", "a", "a"]
    strict = opd.TeacherRouting({"a": "m"}, {"a": "a"}, "a", strict=True)
    with pytest.raises(UserInputError, match="no teacher for agent 'x'"):
        strict.aliases(["x"])
    none = opd.TeacherRouting({"a": "m"}, {"a": "a"}, None, strict=False)
    with pytest.raises(UserInputError, match="no default is set"):
        none.aliases(["x"])


def test_each_response_token_s_advantage_is_teacher_minus_student():
    # prompt of 3 tokens, then 5 generated, of which positions 5-6 are an environment's turn
    sequence = TokenSequence(list(range(8)), 3, env_spans=((5, 7),))
    teacher = np.arange(10, dtype=np.float32)  # padded longer than the sequence
    student = np.full(10, 2.0, dtype=np.float32)
    values = token_advantages(sequence, teacher, student)
    # label positions 0..6; the response's labels are positions 2..6 (tokens 3..7)
    assert values.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 4.0]
    assert response_mask(sequence).tolist() == [False, False, True, True, False, False, True]


def test_the_policy_and_each_teacher_model_share_a_gpu():
    from nemo_rl_offload.algorithms.opd import gpu_share

    report = report_for(
        OPD,
        "++on_policy_distillation={enabled: true, default_teacher_alias: a, "
        "teacher_model_by_agent_name: {a: tiny-dense, b: tiny-dense, c: tiny-moe}}",
    )
    # the policy, tiny-dense's and tiny-moe's
    assert gpu_share(report.recipe, on_gpu=True) == pytest.approx(1 / 3)
    assert gpu_share(report.recipe, on_gpu=False) == 1.0  # CPU workers
