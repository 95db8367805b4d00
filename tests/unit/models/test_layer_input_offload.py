"""Full recompute with each segment's input offloaded (offload.layer_input) on CPU: a tiny
float32 model trains bitwise like full recompute alone, for the uniform and block methods; every
segment input, and nothing else, goes through the offload path (on CPU "host" and "device" are
the same memory, so the proof is the bytes counted through the hooks and the storages autograd
keeps); and a changed Megatron checkpoint code is refused in one line."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models import builder
from nemo_rl_offload.models.layer_input_block import LayerInputOffloadBlock, offload_layer_inputs
from nemo_rl_offload.models.transformer_config import make_transformer_config
from nemo_rl_offload.offload import layer_input

MODEL = "tiny-dense"
LENGTH = 32
STEPS = 3


def _model(effective_for: Any, offload: bool, **recompute: Any) -> tuple[Any, Any]:
    """The seeded tiny model under full recompute (``recompute``: method and layer count), with
    its segment inputs offloaded or not; returns the model and the offloader (None: off)."""
    settings: dict[str, Any] = {"activation_checkpointing": True, **recompute}
    if offload:
        settings.update(fine_grained_activation_offloading=True, offload_modules=["layer_input"])
    effective = effective_for(MODEL, **settings)
    kwargs, _ = builder.transformer_config_for(effective, on_gpu=False)
    assert not kwargs.get("fine_grained_activation_offloading"), "Megatron's manager is unused"
    assert kwargs.get("offload_modules", []) == []
    config = make_transformer_config(kwargs)
    torch.manual_seed(0)
    model = builder.gpt_model_for(config, architecture_for(MODEL))
    assert megatron_settings.offloads_layer_input(effective) is offload
    return model, offload_layer_inputs(model) if offload else None


def _train(model: Any) -> list[list[torch.Tensor]]:
    """STEPS steps of forward, backward and an SGD update; each step's gradients."""
    vocab = architecture_for(MODEL).vocab_size
    generator = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (1, LENGTH), generator=generator)
        position = torch.arange(LENGTH).unsqueeze(0)
        model(ids, position, None, labels=torch.roll(ids, -1, 1)).sum().backward()
        steps.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for param in model.parameters():
                param -= 1e-3 * param.grad
                param.grad = None
    return steps


@pytest.mark.parametrize(
    ("recompute", "segments"),
    [
        ({"recompute_method": "uniform", "recompute_num_layers": 1}, None),
        ({"recompute_method": "uniform", "recompute_num_layers": 2}, None),
        ({"recompute_method": "block", "recompute_num_layers": 1}, 1),
    ],
    ids=["uniform1", "uniform2", "block1"],
)
def test_offloaded_segment_inputs_train_bitwise_like_full_recompute(
    megatron_cpu, effective_for, recompute, segments
):
    plain, _ = _model(effective_for, False, **recompute)
    offloaded, offloader = _model(effective_for, True, **recompute)
    assert isinstance(offloaded.decoder, LayerInputOffloadBlock)
    assert type(plain.decoder) is not LayerInputOffloadBlock
    expected, got = _train(plain), _train(offloaded)
    for step, (want, have) in enumerate(zip(expected, got, strict=True), start=1):
        for a, b in zip(want, have, strict=True):
            assert torch.equal(a, b), step

    layers = len(offloaded.decoder.layers)
    per_layer = recompute["recompute_num_layers"]
    if segments is None:
        segments = -(-layers // per_layer)
    hidden = architecture_for(MODEL).transformer["hidden_size"]
    expected_bytes = STEPS * segments * LENGTH * hidden * 4  # one [s, b=1, h] float32 each
    counters = offloader.counters
    assert counters.offloaded_tensors == counters.reloaded_tensors == STEPS * segments
    assert counters.offloaded_bytes == counters.reloaded_bytes == expected_bytes


def _segment_inputs_alive_after_forward(model: Any) -> tuple[int, int, Any]:
    """Run a forward; how many of the tensors its checkpointed segments received are still
    alive when it returns (autograd keeps them for backward unless they were offloaded), of how
    many, and the loss (to run backward)."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    refs: list[weakref.ref[torch.Tensor]] = []

    def spy(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        if is_checkpointing() and not torch.is_grad_enabled():
            refs.append(weakref.ref(kwargs["hidden_states"]))

    handles = [
        layer.register_forward_pre_hook(spy, with_kwargs=True) for layer in model.decoder.layers
    ]
    ids = torch.randint(0, 64, (1, LENGTH))
    loss = model(ids, torch.arange(LENGTH).unsqueeze(0), None, labels=ids).sum()
    for handle in handles:
        handle.remove()
    return sum(ref() is not None for ref in refs), len(refs), loss


def test_segment_inputs_are_not_kept_between_forward_and_backward(megatron_cpu, effective_for):
    """Full recompute alone keeps every segment input from forward to backward; with
    layer_input none is kept (each lives only as its host copy), and backward brings each back
    once."""
    plain, _ = _model(effective_for, False)
    alive, total, _ = _segment_inputs_alive_after_forward(plain)
    assert total == len(plain.decoder.layers) and alive == total

    model, offloader = _model(effective_for, True)
    alive, total, loss = _segment_inputs_alive_after_forward(model)
    assert total == len(model.decoder.layers) and alive == 0
    assert offloader.counters.offloaded_tensors == total
    assert offloader.counters.reloaded_tensors == 0
    loss.backward()
    assert offloader.counters.reloaded_tensors == total


def test_changed_checkpoint_code_is_refused(monkeypatch, megatron_cpu, effective_for):
    assert layer_input.drift() is None
    key = ("megatron.core.recompute", "checkpointed_forward")
    monkeypatch.setitem(layer_input.FINGERPRINTS, key, "0" * 16)
    line = layer_input.drift()
    assert line and "checkpointed_forward, which changed" in line and "\n" not in line
    plain, _ = _model(effective_for, False)
    with pytest.raises(UserInputError, match="checkpointed_forward, which changed"):
        offload_layer_inputs(plain)


def test_a_segment_input_comes_back_with_the_layout_it_left_with():
    """The block's input [s, 1, h] comes from a transpose (its batch stride s * h): contiguous,
    yet not the strides a plain ``empty`` gives. It must come back with its own strides (the
    recompute and the input's gradient then see what the forward saw), and its own values."""
    hidden = torch.randn(1, 6, 4).transpose(0, 1).contiguous()  # [s, b, h], b == 1
    leaving = hidden.as_strided(hidden.size(), (4, 24, 1))
    assert leaving.is_contiguous() and leaving.stride() != torch.empty(6, 1, 4).stride()
    offloader = layer_input.LayerInputOffloader()
    handle = offloader._offload(leaving, layer_input._Chain())
    back = offloader._reload(handle)
    assert back.stride() == leaving.stride() and torch.equal(back, leaving)
    assert back.untyped_storage().data_ptr() != leaving.untyped_storage().data_ptr()
