"""policy.hf_config_overrides / teacher.hf_config_overrides with NeMo-RL's meaning: each
top-level key replaces config.json's value before the model is read from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.model_presets import architecture_for, section_architecture
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.preflight import check_recipe

# A two-layer Qwen3-MoE-shaped config.json (only what the mapping reads, plus one key it
# does not).
CONFIG = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 176,
    "moe_intermediate_size": 96,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "vocab_size": 384,
    "max_position_embeddings": 512,
    "rope_theta": 1000000,
    "use_cache": True,
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def test_overrides_replace_config_json_values(model_dir):
    plain = architecture_for(str(model_dir))
    assert plain.max_position_embeddings == 512
    assert plain.transformer["moe_aux_loss_coeff"] == 0.001
    overrides = {"max_position_embeddings": 4096, "router_aux_loss_coef": 0}
    changed = section_architecture({"model_name": str(model_dir), "hf_config_overrides": overrides})
    assert changed.max_position_embeddings == 4096
    assert changed.transformer["moe_aux_loss_coeff"] == 0.0
    assert changed.unread_overrides == ()
    assert changed.hf_overrides == overrides


def test_a_key_the_mapping_does_not_read_is_reported(model_dir):
    architecture = architecture_for(str(model_dir), hf_overrides={"use_cache": False})
    assert architecture.unread_overrides == ("use_cache",)
    # Read only for MoE models: on a dense model it changes nothing.
    dense = {k: v for k, v in CONFIG.items() if not k.startswith(("num_experts", "moe_"))}
    (model_dir / "config.json").write_text(json.dumps(dense))
    architecture = architecture_for(str(model_dir), hf_overrides={"router_aux_loss_coef": 0})
    assert architecture.unread_overrides == ("router_aux_loss_coef",)


def test_unsupported_rope_scaling_from_an_override_names_the_override(model_dir):
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(UserInputError) as caught:
        architecture_for(str(model_dir), where="teacher.model_name", hf_overrides=yarn)
    (line,) = caught.value.problems
    assert line.startswith("teacher.hf_config_overrides.rope_scaling: RoPE scaling 'yarn'")


def test_a_preset_has_no_config_json_to_override():
    assert architecture_for("tiny-dense", hf_overrides={}).name == "tiny-dense"
    with pytest.raises(UserInputError, match=r"^policy\.hf_config_overrides: preset 'tiny-dense'"):
        architecture_for("tiny-dense", hf_overrides={"max_position_embeddings": 1024})


def _report(model_dir: Path, overrides: dict | None):
    recipe = load_recipe("examples/configs/tiny/grpo.yaml")
    recipe["policy"]["model_name"] = str(model_dir)
    if overrides is not None:
        recipe["policy"]["hf_config_overrides"] = overrides
    return check_recipe(recipe, megatron_crosscheck=False)


def test_validate_accepts_overrides_and_warns_once_per_unread_key(model_dir):
    quiet = _report(model_dir, {"router_aux_loss_coef": 0})
    assert not [line for line in quiet.errors + quiet.warnings if "hf_config_overrides" in line]
    report = _report(model_dir, {"router_aux_loss_coef": 0, "use_cache": False})
    assert [line for line in report.errors if "hf_config_overrides" in line] == []
    about = [line for line in report.warnings if "hf_config_overrides" in line]
    assert len(about) == 1
    assert about[0].startswith("warning: policy.hf_config_overrides.use_cache: not read")


def test_export_writes_the_overridden_config(model_dir):
    pytest.importorskip("torch")
    from nemo_rl_offload.export_hf import export_config

    overrides = {"max_position_embeddings": 4096, "use_cache": False}
    architecture = architecture_for(str(model_dir), hf_overrides=overrides)
    config = export_config(architecture, "qwen3_moe", torch_dtype="float32")
    assert config["max_position_embeddings"] == 4096 and config["use_cache"] is False
    plain = export_config(architecture_for(str(model_dir)), "qwen3_moe", torch_dtype="float32")
    assert plain["max_position_embeddings"] == 512 and plain["use_cache"] is True
