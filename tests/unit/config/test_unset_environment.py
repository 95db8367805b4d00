"""``${oc.env:NAME}`` with NAME unset on this machine: NeMo-RL resolves it when the run starts
on its cluster, so validate warns and a run refuses to start."""

from __future__ import annotations

import pytest

from nemo_rl_offload.config.loader import load_recipe, resolve_interpolations, unset_environment
from nemo_rl_offload.preflight import check_recipe

UNSET = "NRL_OFFLOAD_TEST_UNSET_DIR"


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNSET, raising=False)
    monkeypatch.setenv("NRL_OFFLOAD_TEST_SET_DIR", "/data")


def test_an_unset_variable_keeps_its_text_in_the_value_and_what_interpolates_it():
    loaded = resolve_interpolations(
        {
            "data": {
                "unset": f"${{oc.env:{UNSET}}}/train.jsonl",
                "derived": "${data.unset}.gz",
                "set": "${oc.env:NRL_OFFLOAD_TEST_SET_DIR}/train.jsonl",
                "default": f"${{oc.env:{UNSET},/tmp}}/train.jsonl",
                "escaped": f"\\${{oc.env:{UNSET}}}",
            }
        }
    )
    assert loaded["data"]["unset"] == f"${{oc.env:{UNSET}}}/train.jsonl"
    assert loaded["data"]["derived"] == f"${{oc.env:{UNSET}}}/train.jsonl.gz"
    assert loaded["data"]["set"] == "/data/train.jsonl"
    assert loaded["data"]["default"] == "/tmp/train.jsonl"
    assert [path for path, _ in unset_environment(loaded)] == [
        "data.unset",
        "data.derived",
        "data.escaped",  # the recipe's own text reads the same: reported too
    ]
    assert unset_environment({"data": {"set": "/data/train.jsonl"}}) == []


def _recipe() -> dict:
    recipe = load_recipe(
        "examples/configs/tiny/grpo.yaml",
        [f"checkpointing.checkpoint_dir=${{oc.env:{UNSET}}}/checkpoints"],
    )
    return recipe


def test_validate_warns_and_a_run_refuses_in_one_line_naming_key_and_variable():
    recipe = _recipe()
    validate = check_recipe(recipe, megatron_crosscheck=False)
    assert validate.errors == []
    warned = [line for line in validate.warnings if UNSET in line]
    assert len(warned) == 1 and warned[0].startswith(
        f"warning: checkpointing.checkpoint_dir: reads the environment variable {UNSET}"
    )
    run = check_recipe(recipe, megatron_crosscheck=False, starting=True)
    refused = [line for line in run.errors if UNSET in line]
    assert len(refused) == 1 and refused[0].startswith(
        f"checkpointing.checkpoint_dir: reads the environment variable {UNSET}, which is not set"
    )
