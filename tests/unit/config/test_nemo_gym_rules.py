"""``env.should_use_nemo_gym``: what a NeMo-Gym GRPO recipe needs, each rule both ways, and the
keys that act only with it (the message-level penalties, NeMo-Gym's data rows)."""

from __future__ import annotations

import copy
import re
import sys

import pytest

from nemo_rl_offload.config import ignored_keys, nemo_gym
from nemo_rl_offload.config.nemo_gym import GYM_PYTHON_ENV

RECIPE = {
    "grpo": {},
    "policy": {"model_name": "tiny-dense"},
    "data": {
        "train": {"data_path": "rows.jsonl"},
        "default": {"dataset_name": "NemoGymDataset", "processor": "nemo_gym_data_processor"},
    },
    "env": {
        "should_use_nemo_gym": True,
        "nemo_gym": {"config_paths": ["responses_api_models/vllm_model/configs/x.yaml"]},
    },
}


DOTTED = re.compile(r"^[a-z_]+(\.[a-z_]+)+: ")


@pytest.fixture
def gym_python(monkeypatch):
    monkeypatch.setenv(GYM_PYTHON_ENV, sys.executable)


def _recipe(**changes):
    recipe = copy.deepcopy(RECIPE)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = recipe
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return recipe


def test_a_nemo_gym_grpo_recipe_passes(gym_python):
    assert nemo_gym.problems(_recipe(), "grpo", starting=True) == ([], [])
    assert nemo_gym.problems(_recipe(), "distillation", starting=True) == ([], [])
    assert nemo_gym.problems(_recipe(env__should_use_nemo_gym=False), "sft", starting=True) == (
        [],
        [],
    )


@pytest.mark.parametrize(
    ("changes", "algorithm", "expected"),
    [
        ({}, "sft", "sft never samples"),
        ({"data__default__dataset_name": "jsonl"}, "grpo", "data.train.dataset_name"),
        ({"env__nemo_gym__config_paths": []}, "grpo", "env.nemo_gym.config_paths"),
    ],
)
def test_what_a_nemo_gym_run_cannot_do_is_one_line(gym_python, changes, algorithm, expected):
    errors, _ = nemo_gym.problems(_recipe(**changes), algorithm, starting=False)
    assert len(errors) == 1 and expected in errors[0]
    assert DOTTED.match(errors[0])  # it starts with the key it is about


def test_without_nemo_gym_validate_warns_and_a_run_refuses(monkeypatch, tmp_path):
    monkeypatch.delenv(GYM_PYTHON_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gym command
    monkeypatch.setitem(sys.modules, "nemo_gym", None)  # and not importable here
    errors, warnings = nemo_gym.problems(_recipe(), "grpo", starting=False)
    assert errors == [] and len(warnings) == 1
    assert GYM_PYTHON_ENV in warnings[0] and "a run refuses to start" in warnings[0]
    errors, _ = nemo_gym.problems(_recipe(), "grpo", starting=True)
    assert len(errors) == 1 and GYM_PYTHON_ENV in errors[0]
    monkeypatch.setenv(GYM_PYTHON_ENV, str(tmp_path / "nope"))
    errors, _ = nemo_gym.problems(_recipe(), "grpo", starting=True)
    assert errors == [f"{GYM_PYTHON_ENV}: {tmp_path / 'nope'} is not a file; give a Python path"]


@pytest.mark.parametrize("key", ["invalid_tool_call_advantage", "malformed_thinking_advantage"])
def test_the_message_level_penalties_act_with_nemo_gym_only(key):
    with_gym = _recipe(**{f"grpo__{key}": -5.0})
    errors, warnings = ignored_keys.check(with_gym)
    assert not any(key in line for line in errors + warnings)
    without = _recipe(**{f"grpo__{key}": -5.0, "env__should_use_nemo_gym": False})
    errors, _ = ignored_keys.check(without)
    (line,) = [e for e in errors if key in e]
    assert "set env.should_use_nemo_gym: true" in line


def test_nemo_gyms_rows_are_data_only_with_nemo_gym_on(tmp_path):
    from nemo_rl_offload.config.data_settings import check_data_section

    errors, warnings = ignored_keys.check(_recipe(), starting=True)
    assert not any(line.startswith(("data.", "warning: data.")) for line in errors + warnings)
    without = _recipe(env__should_use_nemo_gym=False)
    lines = check_data_section(without, base_dir=tmp_path, starting=True)
    assert any(line.startswith("data.") and "NeMo-Gym" in line for line in lines), lines


def test_router_replay_goes_through_nemo_gym(gym_python):
    """The policy's server returns each completion's routes in its message, NeMo-Gym's model
    server passes them on, and the trainer replays them (algorithms/grpo.py)."""
    errors, _ = nemo_gym.problems(
        _recipe(policy__router_replay={"enabled": True}), "grpo", starting=False
    )
    assert errors == []
