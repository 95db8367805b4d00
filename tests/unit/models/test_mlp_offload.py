"""The dense MLP's offload points (models.mlp_offload) on CPU: a tiny float32 model with them on
trains bitwise like the same model without offloading, over steps whose shapes change and recur,
through Megatron's offload manager and the runtime's plans; the runtime's telemetry counts the
new modules' bytes.

Megatron's manager needs CUDA streams and offloads only CUDA tensors: the streams and events are
tests/support/fake_streams.py's (logged, no GPU), Megatron's check that a saved tensor is a CUDA
one accepts the CPU activations here (parameters are still left alone), and the runtime's pool is
unpinned. The copies are real: every offloaded tensor goes to a host buffer and back.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import pytest
import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
from support.fake_streams import FakeCuda
from support.policies import make_policy

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.models import builder
from nemo_rl_offload.models.mlp_offload import OffloadingMLP, offloading_mlp_builder
from nemo_rl_offload.models.transformer_config import (
    make_transformer_config,
    transformer_config_kwargs,
)
from nemo_rl_offload.offload import capabilities, owned, runtime
from nemo_rl_offload.preflight import check_policy

MODEL = "tiny-dense"
MLP = ["mlp_fc1", "mlp_act", "mlp_fc2"]
# (micro-batches, length) per step: shapes change and recur, so plans are recorded and replayed.
SCHEDULE = [(2, 32), (1, 48), (2, 32), (1, 48), (2, 48)]


@pytest.fixture
def cpu_offload(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Megatron's offload manager and the runtime's plans on CPU (restored after the test)."""
    import megatron.core.extensions.transformer_engine as te_extension

    # The runtime checks Megatron's offload code once per process; check it before one of its
    # fingerprinted functions is replaced below.
    owned.require_checked_megatron()
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    monkeypatch.setattr(
        fgo.ChunkOffloadHandler,
        "_can_manage_tensor_for_offload",
        staticmethod(lambda tensor: not isinstance(tensor, torch.nn.Parameter)),
    )
    flag = types.SimpleNamespace(CPUOffloadEnabled=False)
    monkeypatch.setattr(te_extension, "cpu_offload", flag, raising=False)
    monkeypatch.setattr(fgo.PipelineOffloadManager, "OFFLOAD_MGR", None)
    monkeypatch.setattr(
        runtime.OffloadRuntime,
        "_new_pool",
        lambda rt: owned.OwnedHostPool(device="cpu", pin_memory=False),
    )
    return cuda


def _model(
    effective_for: Any, modules: list[str] | None, recompute: list[str] | None = None
) -> tuple[Any, Any]:
    """The tiny model (seeded: the same weights every time) and its config, offloading
    ``modules`` (None: off), every tensor however small, and recomputing ``recompute``
    selectively."""
    settings: dict[str, Any] = {"fine_grained_activation_offloading": bool(modules)}
    if modules:
        settings.update(offload_modules=modules, min_offloaded_tensor_size=0)
    if recompute:
        settings.update(
            activation_checkpointing=True,
            recompute_granularity="selective",
            recompute_modules=recompute,
        )
    effective = effective_for(MODEL, **settings)
    kwargs, _ = builder.transformer_config_for(effective, on_gpu=False)
    # transformer_config_for turns offloading off on CPU workers; here it runs on fakes.
    kwargs["fine_grained_activation_offloading"] = bool(modules)
    kwargs["offload_modules"] = transformer_config_kwargs(effective)["offload_modules"]
    mlp_modules = megatron_settings.project_offload_modules(effective)
    config = make_transformer_config(kwargs, mlp_modules)
    torch.manual_seed(0)
    model = builder.gpt_model_for(
        config,
        architecture_for(MODEL),
        mlp_modules,
        megatron_settings.project_recompute_modules(effective),
    )
    return model, config


def _train(model: Any, offload: runtime.OffloadRuntime | None) -> list[dict[str, Any]]:
    """SCHEDULE's steps (a pass without gradients, then forward and backward per micro-batch,
    as Megatron's schedule runs them, then an SGD update); per step: the loss, the gradients
    and the offload metrics."""
    vocab = architecture_for(MODEL).vocab_size
    generator = torch.Generator().manual_seed(7)
    steps = []
    for count, length in SCHEDULE:
        # A pass without gradients first (GRPO's logprobs): outside the offload plan.
        ids = torch.arange(length).unsqueeze(0) % vocab
        with torch.no_grad(), offload.forward_only() if offload else contextlib.nullcontext():
            model(ids, torch.arange(length).unsqueeze(0), None)
        if offload is not None:
            offload.before_step(count, length)
        total = torch.zeros(())
        for _ in range(count):
            ids = torch.randint(0, vocab, (1, length), generator=generator)
            position = torch.arange(length).unsqueeze(0)
            loss = model(ids, position, None, labels=torch.roll(ids, -1, 1)).sum()
            loss.backward()
            total += loss.detach()
        metrics: dict[str, float] = {}
        if offload is not None:
            fgo.FineGrainedActivationOffloadingInterface.reset()  # as the schedules end a step
            metrics = offload.after_step()
        grads = [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            for param in model.parameters():
                param -= 1e-3 * param.grad
                param.grad = None
        steps.append({"loss": total, "grads": grads, "metrics": metrics})
    return steps


# With Megatron's attention-block modules. mlp_norm is left out: on CPU, Megatron's mlp_norm
# alone already moves gradients by float32 rounding (a different summation order in backward),
# with or without the MLP's modules, so it cannot be checked bitwise here.
ATTENTION_BLOCK = ["attn_norm", "qkv_linear", "core_attn", "attn_proj"]


@pytest.mark.parametrize(
    "modules",
    [MLP, ["mlp_act"], [*ATTENTION_BLOCK, *MLP]],
    ids=["mlp", "mlp_act", "with_attention_block"],
)
def test_offloaded_mlp_trains_bitwise_like_no_offload(
    megatron_cpu, effective_for, cpu_offload, modules
):
    plain, _ = _model(effective_for, None)
    offloaded, config = _model(effective_for, modules)
    assert all(isinstance(layer.mlp, OffloadingMLP) for layer in offloaded.decoder.layers), (
        "the spec places the offloading MLP"
    )
    assert not any(isinstance(layer.mlp, OffloadingMLP) for layer in plain.decoder.layers)
    names = [name for name, _ in plain.named_parameters()]
    assert names == [name for name, _ in offloaded.named_parameters()], "same parameter names"

    offload = runtime.OffloadRuntime(
        config, choices=megatron_settings.RuntimeChoices(lean_hooks=False)
    )
    expected = _train(plain, None)
    got = _train(offloaded, offload)

    for step, (want, have) in enumerate(zip(expected, got, strict=True), start=1):
        assert torch.equal(want["loss"], have["loss"]), step
        for name, a, b in zip(names, want["grads"], have["grads"], strict=True):
            assert torch.equal(a, b), (step, name)
        for name in modules:  # each module's groups were offloaded, and counted
            assert have["metrics"][f"offloaded_gib_{name}"] > 0, (step, name)
    assert offload.plans_recorded == 3  # (2, 32), (1, 48), (2, 48); the others replayed
    assert cpu_offload.ops, "the offload copies ran on the fake streams"


@pytest.mark.parametrize(
    ("modules", "recompute"),
    [
        (["mlp_fc1"], ["mlp_act"]),
        (["attn_norm", "core_attn", "attn_proj", "mlp_norm"], ["layernorm", "mlp_act"]),
    ],
    ids=["mlp_fc1_with_mlp_act_recompute", "norm_inputs_with_layernorm_recompute"],
)
def test_offload_with_cheap_recompute_trains_bitwise_like_neither(
    megatron_cpu, effective_for, cpu_offload, modules, recompute
):
    """The offload modules that combine with layernorm / mlp_act recompute (the rules refuse
    the others): a recompute reads its input (the norm's, fc1's output) after that input's
    reload. The norms differentiate as CUDA's fused kernel does in both models
    (offload.cuda_norms; torch's CPU RMSNorm moves gradients by float32 rounding under
    recompute and under mlp_norm offload by itself)."""
    from nemo_rl_offload.offload.cuda_norms import with_cuda_rms_norms

    plain, _ = _model(effective_for, None)
    both, config = _model(effective_for, modules, recompute)
    assert with_cuda_rms_norms(plain) == with_cuda_rms_norms(both) > 0
    offload = runtime.OffloadRuntime(
        config, choices=megatron_settings.RuntimeChoices(lean_hooks=False)
    )
    for step, (want, have) in enumerate(
        zip(_train(plain, None), _train(both, offload), strict=True), start=1
    ):
        assert torch.equal(want["loss"], have["loss"]), step
        for a, b in zip(want["grads"], have["grads"], strict=True):
            assert torch.equal(a, b), step
        for name in modules:
            assert have["metrics"][f"offloaded_gib_{name}"] > 0, (step, name)


def test_groups_follow_the_mlp_and_stay_closed(megatron_cpu, effective_for, cpu_offload):
    """Each micro-batch records the three groups per layer in forward order, and no group's
    saved-tensor hooks stay on after the MLP (a tensor saved later is not offloaded)."""
    model, config = _model(effective_for, MLP)
    offload = runtime.OffloadRuntime(
        config, choices=megatron_settings.RuntimeChoices(lean_hooks=False)
    )
    offload.before_step(1, 32)
    ids = torch.randint(0, 64, (1, 32))
    model(ids, torch.arange(32).unsqueeze(0), None, labels=ids).sum().backward()
    manager = fgo.PipelineOffloadManager.get_instance()
    (chunk,) = manager._cached_chunks_forward
    layers = len(model.decoder.layers)
    assert [group._name for group in chunk.offload_groups] == MLP * layers
    assert all(layer.mlp._open is None for layer in model.decoder.layers)
    fgo.FineGrainedActivationOffloadingInterface.reset()


def test_megatrons_mlp_code_is_the_checked_one_or_refused(monkeypatch):
    """The installed MLP is the checked one (CI fails on a change); a changed one is refused in
    one line naming the method, by validate's rule and by the spec."""
    from nemo_rl_offload.errors import UserInputError
    from nemo_rl_offload.models import mlp_offload

    assert owned.mlp_drift() is None
    monkeypatch.setitem(owned.MLP_FINGERPRINTS, "forward", "0" * 16)
    with pytest.raises(UserInputError, match=r"rely on megatron-core's MLP.forward, which changed"):
        mlp_offload.require_checked_mlp()
    capabilities.detect.cache_clear()
    try:
        caps = capabilities.detect()
        assert caps.mlp_code_drift and "MLP.forward" in caps.mlp_code_drift
        assert caps.offload_code_drift is None  # Megatron's offload code itself is unchanged
        policy = make_policy(fine_grained_activation_offloading=True, offload_modules=["mlp_fc1"])
        found = check_policy(
            policy, where="policy", architecture=architecture_for("tiny-dense"), caps=caps
        )
        assert any("MLP.forward, which changed" in e for e in found.errors), found.errors
    finally:
        capabilities.detect.cache_clear()


def test_only_the_local_dense_mlp_is_replaced():
    from megatron.core.models.gpt import gpt_layer_specs

    from nemo_rl_offload.errors import UserInputError

    for impl, experts in (("transformer_engine", None), ("local", 4)):
        config = types.SimpleNamespace(transformer_impl=impl, num_moe_experts=experts)
        with pytest.raises(UserInputError, match="offload the dense MLP of the local layer spec"):
            builder.layer_spec(config, frozenset(MLP))

    local = gpt_layer_specs.get_gpt_layer_local_spec()
    built = offloading_mlp_builder(local.submodules.mlp, frozenset(MLP))
    assert built.keywords["offload_modules"] == frozenset(MLP)
    moe = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4)
    with pytest.raises(ValueError, match="dense MLP of the local layer spec"):
        offloading_mlp_builder(moe.submodules.mlp, frozenset(MLP))


@pytest.mark.parametrize(
    ("modules", "recompute"),
    [
        (MLP, None),
        (["qkv_linear", "core_attn", "attn_proj"], None),
        (["mlp_norm", *MLP], None),
        (ATTENTION_BLOCK, None),
        (["attn_norm", "core_attn", "mlp_norm", "mlp_fc1"], ["mlp_act"]),
        (["attn_norm", "core_attn", "mlp_norm"], ["layernorm", "mlp_act"]),
    ],
    ids=[
        "mlp",
        "attention_groups",
        "mlp_norm_around_mlp",
        "attn_norm_around_attention",
        "with_mlp_act_recompute",
        "norm_inputs_with_layernorm_recompute",
    ],
)
def test_every_bulk_reload_is_waited_for_before_its_use(
    megatron_cpu, effective_for, cpu_offload, monkeypatch, modules, recompute
):
    """A tensor a bulk reload brought back is used only after the compute stream waited for
    that reload, in the step that records the plan and in replayed steps: also a group that
    encloses others (attn_norm around the attention groups, mlp_norm around the MLP's), which
    Megatron's warm-up step reloads after its backward commit looked for it
    (``OwnedChunkHandler.tensor_pop`` waits for such a pending reload); also with a norm's or
    the activation's recompute, which reads its offloaded input in backward."""
    unwaited: list[str] = []
    pop = owned.OwnedChunkHandler.tensor_pop
    waited: set[int] = set()  # groups whose latest reload the compute stream waited for
    record, wait = (
        fgo.OffloadTensorGroup.record_reload_event,
        fgo.OffloadTensorGroup.wait_reload_event,
    )

    def recording_record(group: Any, stream: Any) -> Any:
        waited.discard(id(group))
        return record(group, stream)

    def recording_wait(group: Any, stream: Any) -> Any:
        waited.add(id(group))
        return wait(group, stream)

    def checked_pop(handler: Any, tag: Any) -> Any:
        result = pop(handler, tag)
        if not isinstance(tag, torch.Tensor):
            group = handler.offload_groups[tag[0] - 1]
            if group in handler._reloading_group and id(group) not in waited:
                unwaited.append(group._name)  # reloaded, still pending, never waited for
        return result

    monkeypatch.setattr(fgo.OffloadTensorGroup, "record_reload_event", recording_record)
    monkeypatch.setattr(fgo.OffloadTensorGroup, "wait_reload_event", recording_wait)
    monkeypatch.setattr(owned.OwnedChunkHandler, "tensor_pop", checked_pop)
    model, config = _model(effective_for, modules, recompute)
    offload = runtime.OffloadRuntime(
        config, choices=megatron_settings.RuntimeChoices(lean_hooks=False)
    )
    for _ in range(2):  # the step recording the plan, then one replaying it
        offload.before_step(2, 32)
        for _ in range(2):
            ids = torch.randint(0, 64, (1, 32))
            model(ids, torch.arange(32).unsqueeze(0), None, labels=ids).sum().backward()
        fgo.FineGrainedActivationOffloadingInterface.reset()
        offload.after_step()
    assert unwaited == [], sorted(set(unwaited))
