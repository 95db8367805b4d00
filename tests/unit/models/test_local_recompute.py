"""Selective recompute of the norms (``layernorm``) and of the dense MLP's activation alone
(``mlp_act``) on the local layer spec without Transformer Engine (models.local_recompute): a tiny
float32 model trains as it does without recompute, and what it holds between forward and
backward drops by exactly the recomputed tensors; drifted Megatron code is refused in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from support.policies import NO_TE, P, check

from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models import builder
from nemo_rl_offload.models.discard_checkpoint import DiscardingCheckpoint
from nemo_rl_offload.models.grouped_linear import LocalGroupedMLP
from nemo_rl_offload.models.local_recompute import RecomputeActMLP, RecomputeNormsLayer
from nemo_rl_offload.offload import owned
from nemo_rl_offload.offload.cuda_norms import with_cuda_rms_norms
from nemo_rl_offload.offload.saved_tensors import saved_bytes

MODEL = "tiny-dense"
LENGTH = 32


def _selective(modules: list[str]) -> dict[str, Any]:
    return {
        "activation_checkpointing": True,
        "recompute_granularity": "selective",
        "recompute_modules": modules,
    }


def _model(effective_for: Any, modules: list[str] | None, fusion: bool) -> Any:
    settings = {"bias_activation_fusion": fusion, **(_selective(modules) if modules else {})}
    torch.manual_seed(0)
    model, _ = builder.build_gpt_model(
        effective_for(MODEL, **settings), architecture_for(MODEL), on_gpu=False
    )
    return model


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, architecture_for(MODEL).vocab_size, (1, LENGTH), generator=generator)
    return ids, torch.arange(LENGTH).unsqueeze(0)


def _train(model: Any, steps: int = 2) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per step: a pass without gradients (GRPO's logprobs), then forward, backward and an SGD
    update; returns each step's loss and gradients."""
    out = []
    for step in range(steps):
        ids, positions = _batch(step)
        with torch.no_grad():
            model(ids, positions, None)
        loss = model(ids, positions, None, labels=ids).sum()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        with torch.no_grad():
            for param in model.parameters():
                param -= 1e-3 * param.grad
                param.grad = None
    return out


@pytest.mark.parametrize(
    ("modules", "fusion", "cuda_norms"),
    [
        (["mlp_act"], False, False),
        (["mlp_act"], True, False),
        (["layernorm"], False, True),
        (["layernorm", "mlp_act"], True, True),
        (["layernorm", "mlp"], False, True),
        (["layernorm"], False, False),
    ],
)
def test_recompute_trains_like_no_recompute(
    megatron_cpu, effective_for, modules, fusion, cuda_norms
):
    """Bitwise, with the norms keeping and differentiating what CUDA's fused RMSNorm kernel does
    (offload.cuda_norms, in both models). torch's RMSNorm on the CPU is a composite that reads
    its input twice: under layernorm recompute those two gradients are summed inside the
    recomputed graph before they meet the residual's, in another order than in one graph, so
    there the losses are bitwise and the gradients within float32 rounding."""
    plain = _model(effective_for, None, fusion)
    recomputed = _model(effective_for, modules, fusion)
    if cuda_norms:
        assert with_cuda_rms_norms(plain) == with_cuda_rms_norms(recomputed) > 0
    layer = recomputed.decoder.layers[0]
    assert isinstance(layer, RecomputeNormsLayer) == ("layernorm" in modules)
    assert isinstance(layer.mlp, RecomputeActMLP) == ("mlp_act" in modules)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in recomputed.named_parameters()]
    bitwise = cuda_norms or "layernorm" not in modules
    for (want_loss, want), (loss, got) in zip(_train(plain), _train(recomputed), strict=True):
        assert torch.equal(want_loss, loss)
        for a, b in zip(want, got, strict=True):
            if bitwise:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def _held(model: Any) -> dict[str, int]:
    """Bytes held between forward and backward by the first layer, per owner inside it."""
    ids, positions = _batch(0)
    recorder = saved_bytes(model, lambda: model(ids, positions, None, labels=ids).sum())
    held: dict[str, int] = {}
    for item in recorder.saved:
        if item.owner.startswith("decoder.layers.0"):
            owner = item.owner.removeprefix("decoder.layers.0").removeprefix(".") or "(layer)"
            held[owner] = held.get(owner, 0) + item.nbytes
    return held


@pytest.mark.parametrize("fusion", [False, True])
def test_saved_bytes_drop_by_the_recomputed_tensors(megatron_cpu, effective_for, fusion):
    arch = architecture_for(MODEL).transformer
    hidden, ffn = arch["hidden_size"], arch["ffn_hidden_size"]
    row = 4 * LENGTH  # float32 bytes per feature over the sequence
    plain = _held(_model(effective_for, None, fusion))

    act = _held(_model(effective_for, ["mlp_act"], fusion))
    # fc2's input (the activation's output); unfused, also the gated unit's two intermediates.
    assert "mlp.linear_fc2" not in act
    assert sum(plain.values()) - sum(act.values()) == (1 if fusion else 3) * ffn * row
    assert act["mlp"] == 2 * ffn * row  # fc1's output, the recompute's input, stays

    norms = _held(_model(effective_for, ["layernorm"], fusion))
    # Both norms' outputs (saved by qkv and fc1) and what the norms keep besides their input;
    # their inputs stay (the layer's own checkpoint now holds them).
    assert not {"self_attention.linear_qkv", "mlp.linear_fc1"} & set(norms)
    kept_by_norms = plain["input_layernorm"] + plain["pre_mlp_layernorm"] - 2 * hidden * row
    drop = sum(plain.values()) - sum(norms.values())
    assert drop == 2 * hidden * row + kept_by_norms
    assert norms["(layer)"] == plain.get("(layer)", 0) + 2 * hidden * row


def test_discarded_output_is_rebuilt_with_its_gradients():
    """The output's memory goes at the discard and comes back before its first use in backward;
    a rebuilt output that its own graph saved (sigmoid's) is kept, and gradients are exact."""
    weight = torch.nn.Parameter(torch.randn(6, 6))
    x = torch.randn(4, 6, requires_grad=True)

    def run(use: DiscardingCheckpoint | None) -> list[torch.Tensor]:
        x.grad, weight.grad = None, None
        act = use.checkpoint(torch.sigmoid, x) if use else torch.sigmoid(x)
        out = act @ weight  # saves act
        if use:
            use.discard_output_and_register_recompute(out)
            assert act.untyped_storage().nbytes() == 0
        out.square().sum().backward()
        return [x.grad.clone(), weight.grad.clone()]

    for want, got in zip(run(None), run(DiscardingCheckpoint()), strict=True):
        assert torch.equal(want, got)
    with torch.no_grad():  # without a graph nothing is kept or freed
        use = DiscardingCheckpoint()
        act = use.checkpoint(torch.sigmoid, x)
        use.discard_output_and_register_recompute(act @ weight)
        assert act.untyped_storage().nbytes() == act.numel() * act.element_size()


def test_megatron_code_is_the_checked_one_or_refused(megatron_cpu, effective_for, monkeypatch):
    """The installed code is the checked one (CI fails on a change); a changed one is refused in
    one line naming the method, by the spec and by validate's rule, for the module using it."""
    assert owned.recompute_drift({"layernorm", "mlp_act"}) is None
    monkeypatch.setitem(
        owned.RECOMPUTE_FINGERPRINTS,
        "layernorm",
        {**owned.RECOMPUTE_FINGERPRINTS["layernorm"], "TransformerLayer._forward_attention": "0"},
    )
    line = owned.recompute_drift({"layernorm", "mlp_act"})
    assert line and "TransformerLayer._forward_attention, which changed" in line
    assert "[layernorm]" in line and "mlp_act" not in line
    with pytest.raises(UserInputError, match="recompute_modules: recomputing \\[layernorm\\]"):
        _model(effective_for, ["layernorm"], False)
    _model(effective_for, ["mlp_act"], False)  # its code is unchanged

    drifted = dataclasses.replace(NO_TE, recompute_code_drift=(("layernorm", line),))
    errors = check(MODEL, drifted, **_selective(["layernorm"])).errors
    assert errors == [f"{P}.recompute_modules: {line}"]
    assert check(MODEL, drifted, **_selective(["mlp_act"])).errors == []


def test_only_the_local_dense_spec_gets_mlp_act():
    """mlp_act replaces the local spec's dense MLP; a Transformer Engine spec or experts are
    refused in one line (the rules say why first)."""
    import types

    for impl, experts in (("transformer_engine", None), ("local", 4)):
        config = types.SimpleNamespace(transformer_impl=impl, num_moe_experts=experts)
        with pytest.raises(UserInputError, match=r"recompute_modules: \['mlp_act'\] recompute"):
            builder.layer_spec(config, frozenset(), frozenset({"mlp_act"}))


@pytest.mark.parametrize(
    ("activation", "gated", "fusion", "bias", "extra"),
    [
        ("silu", True, True, False, {}),
        ("silu", True, True, True, {}),
        ("silu", True, False, True, {}),
        (
            "silu",
            True,
            False,
            False,
            {"activation_func_clamp_value": 0.5, "glu_linear_offset": 1.0},
        ),
        ("gelu", True, True, True, {}),
        ("gelu", False, True, True, {}),
        ("gelu", False, False, False, {}),
    ],
)
def test_the_activation_is_megatrons_for_every_dense_mlp(
    megatron_cpu, activation, gated, fusion, bias, extra
):
    """RecomputeActMLP repeats MLP.forward's activation step: the same output and gradients,
    bitwise, for each kernel choice of a dense MLP (fused SwiGLU/GeGLU/GeLU, the unfused gated
    unit with its clamp and offset, a plain activation), with and without fc1's bias."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_rl_offload.models.mlp_offload import offloading_mlp_builder

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=2,
        activation_func=getattr(torch.nn.functional, activation),
        gated_linear_unit=gated,
        bias_activation_fusion=fusion,
        add_bias_linear=bias,
        use_cpu_initialization=True,
        **extra,
    )
    spec = gpt_layer_specs.get_gpt_layer_local_spec().submodules.mlp
    args = {
        "config": config,
        "pg_collection": ProcessGroupCollection.use_mpu_process_groups(),
        "is_mtp_layer": False,
    }
    torch.manual_seed(0)
    plain = spec(**args)
    torch.manual_seed(0)
    recomputed = offloading_mlp_builder(spec, frozenset(), mlp_class=RecomputeActMLP)(**args)
    assert isinstance(recomputed, RecomputeActMLP)
    x = torch.randn(8, 2, 16, requires_grad=True)
    results = []
    # Megatron's fused activations are torch.compile'd; eager here, in both, to keep the test
    # to the kernel choice (compiling each variant on the CPU takes seconds).
    with torch.compiler.set_stance("force_eager"):
        for mlp in (plain, recomputed):
            x.grad = None
            out, out_bias = mlp(x)
            (out.square().sum() + (0 if out_bias is None else out_bias.sum())).backward()
            grads = [p.grad.clone() for p in mlp.parameters()]
            results.append([out.detach(), x.grad.clone(), *grads])
    for want, got in zip(*results, strict=True):
        assert torch.equal(want, got)


def _moe_model(effective_for: Any, modules: list[str] | None) -> Any:
    settings = {"model_overrides": {"moe_grouped_gemm": True}}
    torch.manual_seed(0)
    model, _ = builder.build_gpt_model(
        effective_for("tiny-moe", **settings, **(_selective(modules) if modules else {})),
        architecture_for("tiny-moe"),
        on_gpu=False,
    )
    return model


def test_moe_act_recompute_runs_without_te_and_trains_like_no_recompute(
    megatron_cpu, effective_for, moe_globals_restored
):
    """Megatron's grouped experts assign a CheckpointWithoutOutput for moe_act recompute,
    which fails without Transformer Engine (NameError FP8GlobalStateManager); the local grouped
    experts hold the package's output-discarding checkpoint there instead."""
    plain = _moe_model(effective_for, None)
    recomputed = _moe_model(effective_for, ["moe_act"])
    experts = recomputed.decoder.layers[0].mlp.experts
    assert isinstance(experts, LocalGroupedMLP) and experts.activation_recompute
    for (want_loss, want), (loss, got) in zip(_train(plain), _train(recomputed), strict=True):
        assert torch.equal(want_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert isinstance(experts.activation_checkpoint, DiscardingCheckpoint)
    # What fc2 saved (the activation's output) is freed between forward and backward.
    held, held_plain = _held(recomputed), _held(plain)
    assert held.get("mlp.experts.linear_fc2", 0) < held_plain["mlp.experts.linear_fc2"]
    assert sum(held.values()) < sum(held_plain.values())
