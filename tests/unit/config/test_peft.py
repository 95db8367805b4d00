"""policy.megatron_cfg.peft: NeMo-RL's LoRA keys become the adapters' settings, and what this
backend does not implement is refused in one line naming the key and the fix."""

from __future__ import annotations

import pytest

from nemo_rl_offload.config import peft
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.preflight import check_recipe


def _policy(**keys) -> dict:
    return {"megatron_cfg": {"peft": {"enabled": True, **keys}}}


def test_settings_follow_nemo_rl_meaning():
    settings = peft.lora_settings(_policy(dim=16, alpha=32, target_modules=[]))
    assert settings.targets == frozenset(peft.LINEARS)  # empty: every linear
    assert (settings.dim, settings.scale) == (16, 2.0)
    # NeMo-RL's exemplar values fill what the recipe leaves out; "None" is YAML-written null.
    defaults = peft.lora_settings(_policy(lora_dtype="None"))
    assert (defaults.dim, defaults.alpha, defaults.dropout_position) == (8, 32.0, "post")
    chosen = peft.lora_settings(
        _policy(target_modules=["linear_fc*"], exclude_modules=["*fc2", "*out_proj*"])
    )
    assert chosen.targets == {"linear_fc1"}
    assert peft.lora_settings({"megatron_cfg": {"peft": {"enabled": False, "dim": 4}}}) is None
    assert peft.problems(_policy(dim=4, alpha=8, dropout=0.1, dropout_position="pre")) == []


@pytest.mark.parametrize(
    ("keys", "line"),
    [
        (
            {"target_modules": ["linear_qvk"]},
            "policy.megatron_cfg.peft.target_modules: 'linear_qvk' is not a linear of these "
            "models; did you mean 'linear_qkv'?",
        ),
        (
            {"exclude_modules": ["decoder.layers.0.mlp.linear_fc1"]},
            "policy.megatron_cfg.peft.exclude_modules: 'decoder.layers.0.mlp.linear_fc1' names "
            "modules of particular layers",
        ),
        (
            {"exclude_modules": ["linear_*"]},
            "policy.megatron_cfg.peft.exclude_modules: excludes every target",
        ),
        ({"dim": 0}, "policy.megatron_cfg.peft.dim: 0 is not a rank"),
        ({"alpha": -1}, "policy.megatron_cfg.peft.alpha: -1 must be positive"),
        ({"dropout": 1.0}, "policy.megatron_cfg.peft.dropout: 1.0 must be in [0, 1)"),
        (
            {"lora_A_init_method": "kaiming"},
            "policy.megatron_cfg.peft.lora_A_init_method: 'kaiming' is not implemented by this "
            "backend; use 'xavier'",
        ),
        (
            {"lora_B_init_method": "xavier"},
            "policy.megatron_cfg.peft.lora_B_init_method: 'xavier' is not implemented",
        ),
        ({"a2a_experimental": True}, "policy.megatron_cfg.peft.a2a_experimental: "),
        ({"lora_dtype": "float32"}, "policy.megatron_cfg.peft.lora_dtype: "),
    ],
)
def test_what_is_not_implemented_is_one_line(keys, line):
    (found,) = peft.problems(_policy(**keys))
    assert found.startswith(line), found
    # The same value with peft off is not looked at.
    off = {"megatron_cfg": {"peft": {"enabled": False, **keys}}}
    assert peft.problems(off) == []


def _sft(*overrides: str) -> dict:
    recipe = load_recipe("examples/configs/tiny/sft.yaml", list(overrides))
    return recipe


def test_validate_accepts_lora_and_refuses_it_with_experts_graphs_or_a_teacher():
    lora = ("policy.megatron_cfg.peft.enabled=true", "policy.megatron_cfg.peft.dim=8")
    assert check_recipe(_sft(*lora), megatron_crosscheck=False).errors == []
    moe = check_recipe(_sft(*lora, "policy.model_name=tiny-moe"), megatron_crosscheck=False)
    assert any(
        e.startswith("policy.megatron_cfg.peft.enabled: adapters on a model with experts")
        for e in moe.errors
    ), moe.errors
    assert (
        peft.model_problems(
            _policy(), "policy", has_experts=False, transformer_impl="local", cuda_graph_impl="none"
        )
        == []
    )
    (graphs,) = peft.model_problems(
        _policy(),
        "policy",
        has_experts=False,
        transformer_impl="local",
        cuda_graph_impl="full_iteration",
    )
    assert "cuda_graph_impl to none" in graphs
