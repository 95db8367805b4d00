"""The sampler's dense decode path for MoE layers (models/moe_decode.py): every token through
every expert, weighted by its routing probability, gives Megatron's routed output; it runs only
inside experts_for_every_token, in eval, on layouts it supports."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.models.moe_decode import (
    DenseDecodeMoELayer,
    dense_usable,
    experts_for_every_token,
)


def _moe_layer(build_tiny, grouped: bool = False):
    overrides = {"model_overrides": {"moe_grouped_gemm": True}} if grouped else {}
    model, _ = build_tiny("tiny-moe", **overrides)
    layer = next(
        layer.mlp for layer in model.decoder.layers if isinstance(layer.mlp, DenseDecodeMoELayer)
    )
    return model, layer


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_dense_decode_equals_the_routed_experts(
    build_tiny, moe_globals_restored, monkeypatch, tokens, grouped
):
    model, layer = _moe_layer(build_tiny, grouped)
    assert dense_usable(layer)
    model.eval()
    hidden = torch.randn(
        tokens, 3, layer.config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        routed, routed_bias = layer(hidden)
        calls: list[int] = []
        handle = type(layer.token_dispatcher).dispatch_preprocess
        monkeypatch.setattr(
            type(layer.token_dispatcher),
            "dispatch_preprocess",
            lambda self, *a, **k: calls.append(1) or handle(self, *a, **k),
        )
        with experts_for_every_token():
            dense, dense_bias = layer(hidden)
    assert calls == []  # no permutation by expert: nothing to read on the host
    assert routed_bias is None and dense_bias is None
    torch.testing.assert_close(dense, routed, rtol=1e-5, atol=1e-6)


def test_outside_the_block_or_in_training_megatrons_path_runs(
    build_tiny, moe_globals_restored, monkeypatch
):
    model, layer = _moe_layer(build_tiny)
    hidden = torch.randn(2, 2, layer.config.hidden_size)
    dispatched: list[int] = []
    preprocess = type(layer).preprocess

    def counting(self, *args, **kwargs):
        dispatched.append(1)
        return preprocess(self, *args, **kwargs)

    monkeypatch.setattr(type(layer), "preprocess", counting)
    model.eval()
    with torch.no_grad():
        layer(hidden)  # outside the block
        assert dispatched == [1]
        with experts_for_every_token():
            layer(hidden)  # the dense path: nothing dispatched
        assert dispatched == [1]
        model.train()
        with experts_for_every_token():
            layer(hidden)  # training
    assert dispatched == [1, 1]


def test_layouts_it_cannot_run_take_megatrons_path(build_tiny, moe_globals_restored):
    _, layer = _moe_layer(build_tiny)
    assert dense_usable(layer)
    layer.config.moe_expert_capacity_factor = 1.0  # token dropping: the routed set differs
    try:
        assert not dense_usable(layer)
    finally:
        layer.config.moe_expert_capacity_factor = None
