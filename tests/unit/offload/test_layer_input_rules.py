"""The layer_input rule (offload.rules._layer_input), each way: rejected with the path and the
fix, and the nearest recipe accepted; and its settings reach the decoder, not
TransformerConfig (config.megatron_settings)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from support.policies import NO_TE, P, check, make_policy

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.models.transformer_config import transformer_config_kwargs

LAYER_INPUT: dict[str, Any] = {
    "fine_grained_activation_offloading": True,
    "offload_modules": ["layer_input"],
    "activation_checkpointing": True,
}


@pytest.mark.parametrize(
    ("bad", "good", "path", "fragment"),
    [
        (
            {"activation_checkpointing": False},
            {},
            f"{P}.offload_modules",
            "needs full recompute",
        ),
        (
            {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
            {"recompute_granularity": "full"},
            f"{P}.offload_modules",
            "needs full recompute",
        ),
        (
            {"offload_modules": ["layer_input", "attn_norm"]},
            {"offload_modules": ["layer_input"]},
            f"{P}.offload_modules",
            "list 'layer_input' alone",
        ),
        (
            {
                "cuda_graph_impl": "full_iteration",
                "fine_grained_offloading_max_inflight_offloads": 4,
            },
            {"cuda_graph_impl": "none"},
            f"{P}.offload_modules",
            "set cuda_graph_impl: none",
        ),
        (
            {"pipeline_model_parallel_size": 2},
            {"pipeline_model_parallel_size": 1},
            f"{P}.offload_modules",
            "not checked with pipeline stages",
        ),
        (
            {"model_overrides": {"distribute_saved_activations": True}},
            {"model_overrides": {"distribute_saved_activations": False}},
            f"{P}.model_overrides.distribute_saved_activations",
            "use one of the two",
        ),
    ],
    ids=["no_recompute", "selective", "with_other_modules", "graphs", "pipeline", "distributed"],
)
def test_layer_input_rule_both_ways(bad, good, path, fragment):
    rejected = check("tiny-dense", NO_TE, workers=2, **{**LAYER_INPUT, **bad})
    lines = [line for line in rejected.errors if line.startswith(f"{path}: ")]
    assert any(fragment in line for line in lines), rejected.errors
    assert all("\n" not in line for line in rejected.errors)
    accepted = check("tiny-dense", NO_TE, workers=2, **{**LAYER_INPUT, **good})
    assert accepted.errors == []


def test_layer_input_is_a_known_module_only_with_offloading_on():
    assert check("tiny-dense", NO_TE, **LAYER_INPUT).errors == []
    off = check("tiny-dense", NO_TE, **{**LAYER_INPUT, "fine_grained_activation_offloading": False})
    assert off.errors == [] and any("ignored because" in w for w in off.warnings)


def test_changed_checkpoint_code_is_refused_by_validate():
    drift = "the layer_input offload relies on megatron-core's checkpointed_forward, which changed"
    caps = dataclasses.replace(NO_TE, layer_input_code_drift=drift)
    findings = check("tiny-dense", caps, **LAYER_INPUT)
    assert findings.errors == [f"{P}.offload_modules: {drift}"]
    other = {"fine_grained_activation_offloading": True, "offload_modules": ["attn_norm"]}
    assert check("tiny-dense", caps, **other).errors == []


def test_layer_input_reaches_the_decoder_not_transformer_config():
    def effective(**cfg: Any) -> megatron_settings.EffectiveSettings:
        return megatron_settings.effective_settings(
            make_policy("tiny-dense", **cfg), architecture_for("tiny-dense"), te_installed=False
        )

    alone = effective(**LAYER_INPUT)
    kwargs = transformer_config_kwargs(alone)
    assert megatron_settings.offloads_layer_input(alone)
    assert kwargs["offload_modules"] == [] and kwargs["fine_grained_activation_offloading"] is False
    off = effective(**{**LAYER_INPUT, "fine_grained_activation_offloading": False})
    assert not megatron_settings.offloads_layer_input(off)
    without = effective(fine_grained_activation_offloading=True, offload_modules=["attn_norm"])
    assert not megatron_settings.offloads_layer_input(without)
    assert transformer_config_kwargs(without)["fine_grained_activation_offloading"] is True
