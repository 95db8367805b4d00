"""The recipe schema and its messages: one ``dotted.path: message`` line per problem."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.schema import MASTER_CONFIGS
from nemo_rl_offload.config.validate import detect_algorithm, schema_problems
from nemo_rl_offload.errors import UserInputError

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
EXEMPLAR_OF = {
    "sft": "sft.yaml",
    "dpo": "dpo.yaml",
    "grpo": "grpo_math_1B.yaml",
    "distillation": "distillation_math.yaml",
}
MCFG = "policy.megatron_cfg"


@pytest.fixture(scope="module")
def exemplars() -> dict[str, dict[str, Any]]:
    return {algorithm: load_recipe(CONFIGS / name) for algorithm, name in EXEMPLAR_OF.items()}


@pytest.fixture
def grpo(exemplars: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A private copy of the resolved GRPO exemplar, to break."""
    return copy.deepcopy(exemplars["grpo"])


def at(recipe: dict[str, Any], dotted: str) -> dict[str, Any]:
    node: Any = recipe
    for key in filter(None, dotted.split(".")):
        node = node[key]
    return node


def problems(recipe: dict[str, Any]) -> list[str]:
    return schema_problems(recipe, "grpo")


# --------------------------------------------------------------------------- valid exemplars


def test_every_algorithm_has_an_exemplar() -> None:
    assert set(MASTER_CONFIGS) == set(EXEMPLAR_OF)


@pytest.mark.parametrize("algorithm", sorted(EXEMPLAR_OF))
def test_master_config_accepts_its_exemplar(
    algorithm: str, exemplars: dict[str, dict[str, Any]]
) -> None:
    recipe = copy.deepcopy(exemplars[algorithm])
    TypeAdapter(MASTER_CONFIGS[algorithm]).validate_python(recipe)  # raises when rejected
    assert schema_problems(recipe, algorithm) == []


def test_recipe_checked_against_another_algorithm_is_rejected(
    exemplars: dict[str, dict[str, Any]],
) -> None:
    found = schema_problems(copy.deepcopy(exemplars["sft"]), "grpo")
    assert "grpo: required key is missing" in found
    assert "loss_fn: required key is missing" in found
    assert any(line.startswith("sft: unknown key;") for line in found), found


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("section", "typo", "expected"),
    [
        (
            MCFG,
            "fine_grained_activation_offload",
            f"{MCFG}.fine_grained_activation_offload: unknown key; did you mean "
            "'fine_grained_activation_offloading'?",
        ),
        (f"{MCFG}.optimizer", "lrr", f"{MCFG}.optimizer.lrr: unknown key; did you mean 'lr'?"),
        ("", "polcy", "polcy: unknown key; did you mean 'policy'?"),
        (
            "policy.generation",  # a section that may also be null
            "tempreature",
            "policy.generation.tempreature: unknown key; did you mean 'temperature'?",
        ),
    ],
)
def test_unknown_key_names_its_path_and_the_closest_known_key(
    grpo: dict[str, Any], section: str, typo: str, expected: str
) -> None:
    at(grpo, section)[typo] = True
    assert problems(grpo) == [expected]


def test_unknown_key_with_no_close_match_lists_the_known_keys(grpo: dict[str, Any]) -> None:
    grpo["cluster"]["zzz"] = 1
    assert problems(grpo) == [
        "cluster.zzz: unknown key; known keys: address, gpus_per_node, master_port_range_high, "
        "master_port_range_low, num_cpu_workers, num_nodes, segment_size"
    ]


# --------------------------------------------------------------------------- missing keys


def test_missing_required_key(grpo: dict[str, Any]) -> None:
    del grpo["checkpointing"]["checkpoint_dir"]
    assert problems(grpo) == ["checkpointing.checkpoint_dir: required key is missing"]


def test_missing_required_section(grpo: dict[str, Any]) -> None:
    del grpo["cluster"]
    assert problems(grpo) == ["cluster: required key is missing"]


def test_missing_optional_key_is_accepted(grpo: dict[str, Any]) -> None:
    del grpo["policy"]["megatron_cfg"]["min_offloaded_tensor_size"]
    assert problems(grpo) == []


# --------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    ("section", "key", "value", "shown", "expected_kind"),
    [
        (MCFG, "min_offloaded_tensor_size", "5", "'5'", "integer"),
        (MCFG, "min_offloaded_tensor_size", True, "true", "integer"),
        # int | None: pydantic reports each branch; the user must see one line.
        (MCFG, "fine_grained_offloading_max_inflight_offloads", "5", "'5'", "integer"),
        (MCFG, "activation_offload_fraction", "half", "'half'", "number"),
        (MCFG, "fine_grained_activation_offloading", "yes", "'yes'", "boolean"),
        (f"{MCFG}.optimizer", "lr", True, "true", "number"),
        (f"{MCFG}.optimizer", "clip_grad", "x", "'x'", "number"),  # float | None
    ],
)
def test_wrong_type_gives_one_line_with_the_value(
    grpo: dict[str, Any], section: str, key: str, value: Any, shown: str, expected_kind: str
) -> None:
    at(grpo, section)[key] = value
    found = problems(grpo)
    assert len(found) == 1, found
    line = found[0]
    assert line.startswith(f"{section}.{key}: "), line
    assert line.endswith(f"(got: {shown})"), line
    assert expected_kind in line, line


def test_int_is_accepted_where_a_float_is_expected(grpo: dict[str, Any]) -> None:
    grpo["policy"]["megatron_cfg"]["optimizer"]["lr"] = 1
    grpo["policy"]["megatron_cfg"]["activation_offload_fraction"] = 1
    grpo["loss_fn"]["ratio_clip_min"] = 0
    assert problems(grpo) == []


def test_offload_modules_as_one_string_asks_for_a_list(grpo: dict[str, Any]) -> None:
    grpo["policy"]["megatron_cfg"]["offload_modules"] = "core_attn"
    assert problems(grpo) == [
        f"{MCFG}.offload_modules: must be a list, not a single string (got: 'core_attn'); "
        "write [core_attn]"
    ]


def test_offload_modules_with_a_non_string_names_the_element(grpo: dict[str, Any]) -> None:
    grpo["policy"]["megatron_cfg"]["offload_modules"] = ["core_attn", 3]
    found = problems(grpo)
    assert len(found) == 1, found
    assert found[0].startswith(f"{MCFG}.offload_modules.1: ")
    assert found[0].endswith("(got: 3)")


def test_bad_cuda_graph_module_names_its_list_index(grpo: dict[str, Any]) -> None:
    grpo["policy"]["megatron_cfg"]["cuda_graph_modules"] = ["attn", "mlpp"]
    found = problems(grpo)
    assert len(found) == 1, found
    line = found[0]
    assert line.startswith(f"{MCFG}.cuda_graph_modules.1: "), line
    assert line.endswith("(got: 'mlpp')"), line
    assert "'moe_router'" in line, line  # the allowed names are listed


def test_several_problems_are_all_reported(grpo: dict[str, Any]) -> None:
    megatron_cfg = grpo["policy"]["megatron_cfg"]
    megatron_cfg["fine_grained_activation_offload"] = True
    megatron_cfg["offload_modules"] = "core_attn"
    megatron_cfg["min_offloaded_tensor_size"] = "5"
    megatron_cfg["cuda_graph_modules"] = ["mlpp"]
    del grpo["checkpointing"]["checkpoint_dir"]
    grpo["polcy"] = {}

    found = problems(grpo)

    assert sorted(line.split(": ", 1)[0] for line in found) == sorted(
        [
            f"{MCFG}.fine_grained_activation_offload",
            f"{MCFG}.offload_modules",
            f"{MCFG}.min_offloaded_tensor_size",
            f"{MCFG}.cuda_graph_modules.0",
            "checkpointing.checkpoint_dir",
            "polcy",
        ]
    )


# --------------------------------------------------------------------------- detect_algorithm


@pytest.mark.parametrize("algorithm", sorted(EXEMPLAR_OF))
def test_detect_algorithm_of_each_exemplar(
    algorithm: str, exemplars: dict[str, dict[str, Any]]
) -> None:
    assert detect_algorithm(exemplars[algorithm]) == algorithm


def test_detect_algorithm_without_a_section(grpo: dict[str, Any]) -> None:
    del grpo["grpo"]
    with pytest.raises(UserInputError) as info:
        detect_algorithm(grpo)
    assert len(info.value.problems) == 1
    line = info.value.problems[0]
    assert line.startswith("recipe: no algorithm section; add one of "), line
    for name in ("sft", "dpo", "grpo", "distillation"):
        assert name in line


def test_detect_algorithm_with_two_sections(
    grpo: dict[str, Any], exemplars: dict[str, dict[str, Any]]
) -> None:
    grpo["sft"] = copy.deepcopy(exemplars["sft"]["sft"])
    with pytest.raises(UserInputError) as info:
        detect_algorithm(grpo)
    assert info.value.problems == [
        "recipe: several algorithm sections (sft, grpo); keep exactly one"
    ]
