"""Applying megatron_cfg to a real TransformerConfig: layers, explicit false, defaults."""

from __future__ import annotations

import pytest
import torch
from support.policies import make_policy

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.models.transformer_config import build_transformer_config

pytest.importorskip("megatron.core")


def _build(model="tiny-dense", te_installed=False, **cfg):
    effective = megatron_settings.effective_settings(
        make_policy(model, **cfg), architecture_for(model), te_installed=te_installed
    )
    return effective, build_transformer_config(effective)


def test_fgo_settings_reach_transformer_config():
    _, config = _build(
        fine_grained_activation_offloading=True,
        offload_modules=["core_attn", "attn_proj"],
        min_offloaded_tensor_size=4096,
        activation_offload_fraction=0.5,
        fine_grained_offloading_max_inflight_offloads=2,
        delta_offload_bytes_across_pp_ranks=0,
    )
    assert config.fine_grained_activation_offloading is True
    assert config.offload_modules == ["core_attn", "attn_proj"]
    assert config.min_offloaded_tensor_size == 4096
    assert config.activation_offload_fraction == 0.5
    assert config.fine_grained_offloading_max_inflight_offloads == 2


def test_the_mlp_offload_modules_reach_the_spec_not_transformer_config():
    """Megatron's TransformerConfig refuses names it does not know: this package's MLP modules
    go to the layer spec (project_offload_modules), Megatron's to the config."""
    effective, config = _build(
        fine_grained_activation_offloading=True, offload_modules=["core_attn", "mlp_act"]
    )
    assert config.offload_modules == ["core_attn"]
    assert megatron_settings.project_offload_modules(effective) == frozenset({"mlp_act"})
    # Only this package's modules: offloading stays on (the model opens offload chunks).
    effective, config = _build(
        fine_grained_activation_offloading=True, offload_modules=["mlp_fc1", "mlp_fc2"]
    )
    assert config.fine_grained_activation_offloading is True and config.offload_modules == []
    assert megatron_settings.project_offload_modules(effective) == frozenset({"mlp_fc1", "mlp_fc2"})
    # Offloading off: none placed, whatever is listed.
    effective, config = _build(
        fine_grained_activation_offloading=False, offload_modules=["mlp_fc1"]
    )
    assert megatron_settings.project_offload_modules(effective) == frozenset()
    assert config.fine_grained_activation_offloading is False


def test_the_mlp_act_recompute_reaches_the_spec_not_transformer_config():
    """Megatron's TransformerConfig refuses recompute names it does not know: this package's
    mlp_act goes to the layer spec (project_recompute_modules), Megatron's names to the config,
    and none is placed without selective recompute."""
    selective = {"activation_checkpointing": True, "recompute_granularity": "selective"}
    effective, config = _build(**selective, recompute_modules=["layernorm", "mlp_act"])
    assert config.recompute_modules == ["layernorm"]
    assert megatron_settings.project_recompute_modules(effective) == frozenset({"mlp_act"})
    effective, config = _build(**selective, recompute_modules=["mlp_act"])
    assert config.recompute_modules == []  # not Megatron's default, core_attn
    effective, config = _build(activation_checkpointing=True, recompute_modules=["mlp_act"])
    assert config.recompute_granularity == "full"
    assert megatron_settings.project_recompute_modules(effective) == frozenset()


def test_unset_knobs_keep_megatron_defaults():
    from megatron.core.transformer.transformer_config import TransformerConfig

    effective, config = _build(
        fine_grained_activation_offloading=True, offload_modules=["core_attn"]
    )
    assert "min_offloaded_tensor_size" not in effective.settings
    defaults = {
        f: getattr(TransformerConfig, f)
        for f in (
            "min_offloaded_tensor_size",
            "activation_offload_fraction",
            "delay_offload_until_cuda_graph",
        )
    }
    for name, default in defaults.items():
        assert getattr(config, name) == default


def test_explicit_false_clears_enabled_state_from_overrides():
    effective, config = _build(
        fine_grained_activation_offloading=False,
        model_overrides={"offload_modules": ["core_attn"]},
    )
    assert config.fine_grained_activation_offloading is False
    assert config.offload_modules == []
    assert effective.source("offload_modules", "") == (
        "policy.megatron_cfg.fine_grained_activation_offloading"
    )


def test_model_overrides_reach_config_and_named_keys_win():
    effective, config = _build(
        model_overrides={"num_moe_experts": 4, "moe_router_topk": 2, "sequence_parallel": True},
        sequence_parallel=False,
    )
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2
    assert config.sequence_parallel is False
    assert effective.conflicts == [
        (
            "sequence_parallel",
            "policy.megatron_cfg.sequence_parallel",
            "policy.megatron_cfg.model_overrides.sequence_parallel",
        )
    ]


def test_architecture_and_precision_layers():
    effective, config = _build("llama-1b")
    assert (config.num_layers, config.hidden_size, config.num_query_groups) == (16, 2048, 8)
    assert config.bf16 is True and config.params_dtype == torch.bfloat16
    assert config.gated_linear_unit is True
    assert effective.source("hidden_size", "") == "policy.model_name"


def test_activation_checkpointing_gates_recompute_keys():
    effective, config = _build(recompute_granularity="full")
    assert config.recompute_granularity is None
    assert effective.ignored_recompute_keys == ["recompute_granularity"]
    _, config = _build(activation_checkpointing=True)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )


def test_selective_recompute_drops_full_only_keys():
    _, config = _build(
        activation_checkpointing=True,
        recompute_granularity="selective",
        recompute_method="uniform",
        recompute_num_layers=1,
        recompute_modules=["core_attn"],
    )
    assert config.recompute_granularity == "selective"
    assert config.recompute_num_layers is None and config.recompute_method is None
    assert config.recompute_modules == ["core_attn"]


@pytest.mark.parametrize(
    "requested,te,expected",
    [
        ("auto", False, "local"),
        ("auto", True, "transformer_engine"),
        (None, False, "local"),
        ("local", True, "local"),
        ("transformer_engine", False, "transformer_engine"),
    ],
)
def test_transformer_impl_resolution(requested, te, expected):
    assert megatron_settings.resolve_transformer_impl(requested, te) == expected


def test_runtime_choices_are_read_from_the_effective_settings():
    """One owner of the runtime's per-plan choices: strided copies off only on eager MoE steps,
    expert groups pooled only with drop-and-pad dispatch, the recipe's fraction placement."""
    dense, _ = _build()
    moe, _ = _build("tiny-moe")
    padded, _ = _build(
        "tiny-moe",
        model_overrides={
            "moe_expert_capacity_factor": 1.0,
            "moe_pad_expert_input_to_capacity": True,
        },
    )
    assert (
        megatron_settings.runtime_choices(dense, {}, graphed=False)
        == megatron_settings.RuntimeChoices()
    )
    eager_moe = megatron_settings.runtime_choices(moe, {}, graphed=False)
    assert eager_moe.strided_copies is False and eager_moe.pool_expert_groups is False
    assert megatron_settings.runtime_choices(moe, {}, graphed=True).strided_copies is True
    assert megatron_settings.runtime_choices(padded, {}, graphed=True).pool_expert_groups is True
    placed = {"activation_offload_fraction_placement": "earliest"}
    assert (
        megatron_settings.runtime_choices(dense, placed, graphed=False).fraction_placement
        == "earliest"
    )
    assert (
        megatron_settings.runtime_choices(dense, {}, graphed=False).fraction_placement == "spread"
    )
