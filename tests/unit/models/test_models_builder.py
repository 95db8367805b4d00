"""build_gpt_model: TransformerConfig fields come from the effective settings, the local spec gets
what it needs, and settings a CPU worker cannot honour are reported, never dropped silently."""

from __future__ import annotations

import pytest
from megatron.core.transformer.moe.experts import SequentialMLP

from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models.attention import SDPACoreAttention
from nemo_rl_offload.models.builder import LOCAL_SPEC_DEFAULTS, build_gpt_model

FGO_WARNING = (
    "policy.megatron_cfg.fine_grained_activation_offloading: offloading is GPU-only; "
    "not applied on CPU workers"
)


def test_config_fields_come_from_the_effective_settings(build_tiny):
    model, warnings = build_tiny(
        "tiny-dense", model_overrides={"num_layers": 3, "num_query_groups": 4}
    )
    config = model.config
    assert warnings == []
    assert (config.num_layers, config.num_query_groups) == (3, 4)
    assert len(model.decoder.layers) == 3
    tiny = architecture_for("tiny-dense").transformer
    assert config.hidden_size == tiny["hidden_size"]
    assert config.ffn_hidden_size == tiny["ffn_hidden_size"]
    assert config.normalization == "RMSNorm"
    assert config.gated_linear_unit is True
    assert model.vocab_size == architecture_for("tiny-dense").vocab_size
    assert model.position_embedding_type == "rope"


def test_local_spec_gets_sdpa_attention_and_cpu_settings(build_tiny):
    model, _ = build_tiny("tiny-dense")
    config = model.config
    assert config.transformer_impl == "local"
    for name, value in LOCAL_SPEC_DEFAULTS.items():
        assert getattr(config, name) == value
    assert config.use_cpu_initialization is True
    assert config.calculate_per_token_loss is True
    for layer in model.decoder.layers:
        assert isinstance(layer.self_attention.core_attention, SDPACoreAttention)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_moe_preset_builds_sequential_experts_without_te(build_tiny):
    model, _ = build_tiny("tiny-moe")
    assert model.config.num_moe_experts == 4
    assert model.config.moe_token_dispatcher_type == "alltoall"
    for layer in model.decoder.layers:
        assert isinstance(layer.mlp.experts, SequentialMLP)


def test_fgo_is_reported_not_applied_on_cpu(build_tiny):
    model, warnings = build_tiny(
        "tiny-dense",
        fine_grained_activation_offloading=True,
        offload_modules=["core_attn", "attn_proj"],
    )
    assert warnings == [FGO_WARNING]
    assert model.config.fine_grained_activation_offloading is False
    assert model.config.offload_modules == []


FP8_CFG = {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": False}


@pytest.mark.parametrize("fp8_cfg", [None, FP8_CFG], ids=["bf16", "fp8"])
def test_cpu_worker_rejects_transformer_engine(megatron_cpu, effective_for, fp8_cfg):
    effective = effective_for("tiny-dense", transformer_impl="transformer_engine", fp8_cfg=fp8_cfg)
    with pytest.raises(UserInputError, match="transformer_impl.*needs a GPU"):
        build_gpt_model(effective, architecture_for("tiny-dense"), on_gpu=False)


def test_transformer_engine_gets_megatrons_own_fp8_fields(effective_for):
    from nemo_rl_offload.models.builder import transformer_config_for

    te = effective_for("tiny-dense", transformer_impl="transformer_engine", fp8_cfg=FP8_CFG)
    kwargs, _ = transformer_config_for(te, on_gpu=True)
    assert (kwargs["fp8"], kwargs["fp8_recipe"]) == ("e4m3", "blockwise")
    local, _ = transformer_config_for(effective_for("tiny-dense", fp8_cfg=FP8_CFG), on_gpu=False)
    assert "fp8" not in local  # the local spec's FP8 is this package's linears


def test_per_token_loss_cannot_be_turned_off(megatron_cpu, effective_for):
    effective = effective_for("tiny-dense", model_overrides={"calculate_per_token_loss": False})
    with pytest.raises(UserInputError, match="model_overrides.calculate_per_token_loss: must be"):
        build_gpt_model(effective, architecture_for("tiny-dense"), on_gpu=False)


def test_local_spec_norms_are_torch_norms_marked_for_sequence_parallelism(build_tiny):
    """Every norm of the local spec (layers, q/k, the final one) is LocalNorm's torch norm,
    whose parameters carry the mark finalize_model_grads sums over tensor-parallel ranks."""
    import types

    import torch

    from nemo_rl_offload.models.norms import LocalNorm

    model, _ = build_tiny("tiny-dense", model_overrides={"qk_layernorm": True})
    norms = [model.decoder.final_layernorm]
    for layer in model.decoder.layers:
        attention = layer.self_attention
        norms += [layer.input_layernorm, layer.pre_mlp_layernorm]
        norms += [attention.q_layernorm, attention.k_layernorm]
    assert all(type(norm) is torch.nn.RMSNorm for norm in norms)
    assert all(p.sequence_parallel is False for norm in norms for p in norm.parameters())

    fields = {
        "layernorm_zero_centered_gamma": False,
        "persist_layer_norm": False,
        "memory_efficient_layer_norm": False,
    }
    for normalization, kind in (("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)):
        config = types.SimpleNamespace(
            sequence_parallel=True, normalization=normalization, **fields
        )
        norm = LocalNorm(config, hidden_size=8, eps=1e-6)
        assert type(norm) is kind and norm.eps == 1e-6
        assert [p.sequence_parallel for p in norm.parameters()] == [True] * len(
            list(norm.parameters())
        )
