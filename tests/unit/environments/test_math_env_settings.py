"""``env.math`` resolved once (config/env_settings.py), both ways: NeMo-RL's defaults, each
grader, the worker count actually read, and unknown values refused by validate and by the
settings themselves."""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_offload.config.env_settings import (
    MATH_VERIFY_IMPLS,
    MathEnvSettings,
    math_env_settings,
)
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.schema import MathEnvConfig
from nemo_rl_offload.config.validate import schema_problems
from nemo_rl_offload.environments.math import MathEnvironment
from nemo_rl_offload.errors import UserInputError

GRPO_EXEMPLAR = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_math_1B.yaml"


@pytest.fixture(scope="module")
def exemplar() -> dict[str, Any]:
    return load_recipe(GRPO_EXEMPLAR)


@pytest.fixture
def grpo(exemplar: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(exemplar)


@pytest.mark.parametrize(
    "recipe",
    [{}, {"env": None}, {"env": {}}, {"env": {"math": None}}, {"env": {"math": {}}}],
)
def test_nemo_rls_defaults_when_absent(recipe: dict[str, Any]) -> None:
    assert math_env_settings(recipe) == MathEnvSettings(1, "hf_math_verify")


@pytest.mark.parametrize("impl", ["hf_math_verify", "dapo_math_verify"])
def test_each_grader_and_the_worker_count_are_read(impl: str) -> None:
    recipe = {"env": {"math": {"num_workers": 3, "math_verify_impl": impl}}}
    assert math_env_settings(recipe) == MathEnvSettings(3, impl)
    assert MathEnvironment(math_env_settings(recipe)).settings.math_verify_impl == impl


def test_a_null_grader_means_the_default() -> None:
    recipe = {"env": {"math": {"num_workers": 2, "math_verify_impl": None}}}
    assert math_env_settings(recipe) == MathEnvSettings(2, "hf_math_verify")


def test_the_exemplar_resolves(exemplar: dict[str, Any]) -> None:
    assert math_env_settings(exemplar) == MathEnvSettings(1, "hf_math_verify")


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (
            {"math_verify_impl": "sympy"},
            "env.math.math_verify_impl: unknown grader 'sympy'; use one of hf_math_verify, "
            "dapo_math_verify",
        ),
        ({"num_workers": 0}, "env.math.num_workers: must be at least 1, got 0"),
        ({"num_workers": "2"}, "env.math.num_workers: must be an integer, got '2'"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], problem: str) -> None:
    with pytest.raises(UserInputError) as info:
        MathEnvSettings(**settings)
    assert info.value.problems == [problem]
    with pytest.raises(UserInputError):
        math_env_settings({"env": {"math": settings}})


def test_the_schema_accepts_the_graders_and_null(grpo: dict[str, Any]) -> None:
    for impl in (*MATH_VERIFY_IMPLS, None):
        grpo["env"]["math"]["math_verify_impl"] = impl
        assert schema_problems(grpo, "grpo") == [], impl


def test_validate_refuses_an_unknown_grader(grpo: dict[str, Any]) -> None:
    grpo["env"]["math"]["math_verify_impl"] = "sympy"
    found = schema_problems(grpo, "grpo")
    assert len(found) == 1, found
    assert found[0].startswith("env.math.math_verify_impl: "), found
    assert found[0].endswith("(got: 'sympy')"), found
    assert "'hf_math_verify'" in found[0] and "'dapo_math_verify'" in found[0], found


def test_the_schema_and_the_settings_name_the_same_graders() -> None:
    annotation = typing.get_type_hints(MathEnvConfig)["math_verify_impl"]
    (literal,) = [a for a in typing.get_args(annotation) if typing.get_origin(a) is typing.Literal]
    assert set(typing.get_args(literal)) == set(MATH_VERIFY_IMPLS)
