"""The treatments of NeMo-RL's keys, each both ways: silent at an inert value (null, disabled,
NeMo-RL's default), a warning or a refusal naming the fix otherwise; the Hugging Face cache;
``_override_`` sections in defaults chains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl_offload.config import ignored_keys
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.model_presets import ModelNotOnMachine, architecture_for


def _nest(dotted: str, value: object) -> dict:
    node: dict = {}
    root = node
    parts = dotted.split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return root


# (key, NeMo-RL's default, another value): not implemented yet, refused unless the default.
NOT_YET = [
    ("grpo.adv_estimator", {"name": "grpo"}, {"name": "reinforce_plus_plus"}),
]


@pytest.mark.parametrize(("key", "default", "other"), NOT_YET, ids=[k for k, _, _ in NOT_YET])
def test_an_option_not_implemented_yet_is_silent_at_its_default_and_refused_otherwise(
    key, default, other
):
    assert ignored_keys.check(_nest(key, default)) == ([], [])
    errors, warnings = ignored_keys.check(_nest(key, other))
    assert warnings == []
    assert len(errors) == 1 and errors[0].startswith(f"{key}: "), errors
    assert "not implemented yet by this backend" in errors[0]


def test_grpos_estimator_is_read_with_any_flags_and_grpos_own_normalize_key_is_not():
    """The advantages read grpo.adv_estimator (algorithms/advantages.py), as NeMo-RL's
    estimator does; grpo.normalize_rewards reaches them only through that section."""
    flags = {"name": "grpo", "normalize_rewards": False, "use_leave_one_out_baseline": False}
    assert ignored_keys.check({"grpo": {"adv_estimator": flags}}) == ([], [])
    interpolated = {"normalize_rewards": False, "adv_estimator": {"normalize_rewards": False}}
    assert ignored_keys.check({"grpo": interpolated}) == ([], [])
    assert ignored_keys.check({"grpo": {"normalize_rewards": True}}) == ([], [])
    errors, warnings = ignored_keys.check({"grpo": {"normalize_rewards": False}})
    assert errors == [] and len(warnings) == 1
    assert "grpo.adv_estimator.normalize_rewards (true when absent)" in warnings[0]


def test_skipping_reference_logprobs_is_inert_without_a_kl_penalty():
    skip = {"skip_reference_policy_logprobs_calculation": True}
    assert ignored_keys.check({"grpo": skip, "loss_fn": {"reference_policy_kl_penalty": 0}}) == (
        [],
        [],
    )
    errors, _ = ignored_keys.check({"grpo": skip, "loss_fn": {"reference_policy_kl_penalty": 0.01}})
    assert len(errors) == 1


# (recipe fragment that is inert, fragment that warns, the warned key)
WARNED = [
    (
        {
            "policy": {
                "generation": {"backend": "megatron", "vllm_cfg": {"tensor_parallel_size": 2}}
            }
        },
        {"policy": {"generation": {"backend": "vllm", "vllm_cfg": {"tensor_parallel_size": 2}}}},
        ["policy.generation.backend", "policy.generation.vllm_cfg"],
    ),
    (
        {"logger": {"wandb_enabled": False, "wandb": {"project": "p"}}},
        {"logger": {"wandb_enabled": True, "wandb": {"project": "p"}}},
        ["logger.wandb_enabled", "logger.wandb"],
    ),
    (
        {"logger": {"mlflow_enabled": False, "swanlab_enabled": False}},
        {"logger": {"mlflow_enabled": True}},
        ["logger.mlflow_enabled"],
    ),
    (
        {"policy": {"dtensor_cfg": {"enabled": False, "dp_replicate_size": 2}}},
        {"policy": {"dtensor_cfg": {"enabled": True, "dp_replicate_size": 2}}},
        ["policy.dtensor_cfg.dp_replicate_size"],
    ),
    (
        {"checkpointing": {"save_optimizer": True, "model_save_format": "safetensors"}},
        {"checkpointing": {"save_optimizer": False, "model_save_format": "torch_save"}},
        ["checkpointing.save_optimizer", "checkpointing.model_save_format"],
    ),
    (
        {"policy": {"megatron_cfg": {"checkpoint": {}}}},
        {"policy": {"megatron_cfg": {"checkpoint": {"async_save": True}}}},
        ["policy.megatron_cfg.checkpoint"],
    ),
    (
        {"policy": {"generation": {"colocated": {"enabled": True}}}},
        {"policy": {"generation": {"colocated": {"enabled": False}}}},
        ["policy.generation.colocated"],
    ),
    (
        {"policy": {"draft": {"enabled": False, "model_name": "drafter"}}},
        {"policy": {"draft": {"enabled": True, "model_name": "drafter", "loss_weight": 1.0}}},
        ["policy.draft"],
    ),
]


@pytest.mark.parametrize(("inert", "warned", "keys"), WARNED, ids=[w[2][-1] for w in WARNED])
def test_a_key_ignoring_which_changes_nothing_warns_once_and_is_silent_when_inert(
    inert, warned, keys
):
    assert ignored_keys.check(inert) == ([], [])
    errors, warnings = ignored_keys.check(warned)
    assert errors == []
    assert [line.split(":")[1].strip() for line in warnings] == keys
    assert all(": ignored by this backend: " in line for line in warnings)


@pytest.mark.parametrize(
    ("recipe", "key"),
    [
        ({"teacher": {"megatron_cfg": {"peft": {"enabled": True}}}}, "teacher.megatron_cfg.peft"),
        (
            {"grpo": {"invalid_tool_call_advantage": -5.0}},  # needs NeMo-Gym's rollouts
            "grpo.invalid_tool_call_advantage",
        ),
        (
            {"policy": {"generation": {"top_p": 1.0, "val_top_p": 0.9}}},
            "policy.generation.val_top_p",
        ),
    ],
)
def test_a_feature_this_backend_lacks_is_refused_naming_the_fix(recipe, key):
    errors, _ = ignored_keys.check(recipe)
    assert len(errors) == 1 and errors[0].startswith(f"{key}: ") and "; " in errors[0]


def test_freezing_vision_parts_of_a_language_model_is_inert_and_freezing_it_is_refused():
    def freeze(**parts: bool) -> dict:
        return {"policy": {"megatron_cfg": {"freeze_config": parts}}}

    vision = {"freeze_vision_model": True, "freeze_vision_projection": True}
    assert ignored_keys.check(freeze(**vision, freeze_language_model=False)) == ([], [])
    errors, _ = ignored_keys.check(freeze(**vision, freeze_language_model=True))
    assert len(errors) == 1 and errors[0].startswith("policy.megatron_cfg.freeze_config: ")
    assert "freezing the language model is not implemented yet" in errors[0]


def test_validation_sampling_equal_to_training_is_inert():
    recipe = {"policy": {"generation": {"temperature": 0.8, "val_temperature": 0.8}}}
    assert ignored_keys.check(recipe) == ([], [])


def test_nemo_rl_data_and_its_processor_switches_are_acted_on():
    """data.train names NeMo-RL's datasets (config/data_settings.py checks them) and the
    processors apply data.add_bos & co. there; the loader's other switches are refused."""
    recipe = {"data": {"train": {"dataset_name": "OpenMathInstruct-2"}, "add_bos": False}}
    assert ignored_keys.check(recipe) == ([], [])
    assert ignored_keys.check(recipe, starting=True) == ([], [])
    errors, _ = ignored_keys.check({"data": {**recipe["data"], "use_multiple_dataloader": True}})
    assert len(errors) == 1 and errors[0].startswith("data.use_multiple_dataloader: true")


def test_a_data_pipeline_key_without_nemo_rl_data_is_refused_unless_default():
    assert ignored_keys.check({"data": {"dataset_name": "jsonl", "add_bos": True}}) == ([], [])
    errors, _ = ignored_keys.check({"data": {"dataset_name": "jsonl", "add_bos": False}})
    assert len(errors) == 1 and errors[0].startswith("data.add_bos: false")


def test_every_registry_entry_says_why_and_refusals_say_what_to_set():
    for key, entry in ignored_keys.IGNORED.items():
        assert entry.reason, key
        assert entry.treatment in ("warned", "refused")
        if entry.refuse is not None:
            assert entry.refuse.startswith(("set ", "give ", "write ", "edit ")), key


# ------------------------------------------------------------------ the Hugging Face cache


def _hf_config() -> dict:
    return {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
    }


def test_a_model_in_the_hugging_face_cache_is_read_from_there(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(_hf_config()))
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    architecture = architecture_for("org/tiny")
    assert architecture.transformer["num_layers"] == 2
    assert architecture.hf_directory == str(snapshot)


def test_a_model_not_on_the_machine_says_how_to_make_it_available(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelNotOnMachine) as info:
        architecture_for("meta-llama/Llama-3.2-1B-Instruct")
    (line,) = info.value.problems
    assert "not on this machine" in line and "local directory" in line and "cache" in line


def test_a_preset_typo_is_still_a_did_you_mean(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(Exception) as info:
        architecture_for("llama-1B")
    assert not isinstance(info.value, ModelNotOnMachine)
    assert "did you mean 'llama-1b'" in str(info.value)


# ------------------------------------------------------------------ _override_ in defaults


def test_an_override_marked_section_replaces_the_inherited_one(tmp_path: Path):
    (tmp_path / "parent.yaml").write_text("data:\n  a: 1\n  b: 2\nenv:\n  x: 1\n")
    (tmp_path / "child.yaml").write_text(
        "defaults: parent.yaml\ndata:\n  _override_: true\n  c: 3\nenv:\n  y: 2\n"
    )
    recipe = load_recipe(tmp_path / "child.yaml")
    assert recipe["data"] == {"c": 3}
    assert recipe["env"] == {"x": 1, "y": 2}


def test_the_table_in_docs_recipes_md_is_the_registry():
    docs = (Path(__file__).resolve().parents[3] / "docs" / "recipes.md").read_text()
    start = docs.index(ignored_keys.TABLE_START)
    end = docs.index(ignored_keys.TABLE_END) + len(ignored_keys.TABLE_END)
    assert docs[start:end] == ignored_keys.markdown_table(), (
        "docs/recipes.md's table differs from config/ignored_keys.py; regenerate it with "
        "ignored_keys.markdown_table()"
    )


def test_validate_exits_0_for_a_nemo_rl_exemplar_without_its_model(tmp_path, monkeypatch):
    import io

    from nemo_rl_offload.cli import main

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = (
        Path(__file__).resolve().parents[1] / "reference_configs/nemo_rl/grpo_math_1B_megatron.yaml"
    )
    out, err = io.StringIO(), io.StringIO()
    code = main(["validate", "--config", str(recipe)], out=out, err=err)
    assert code == 0, err.getvalue()
    assert out.getvalue().rstrip().endswith("valid")
    assert "warning: policy.model_name: Hugging Face model 'Qwen/Qwen2.5-1.5B'" in err.getvalue()
