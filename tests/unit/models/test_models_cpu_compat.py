"""cpu_compat patches only names inside Megatron modules, idempotently, and undoes them exactly."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("megatron.core")

from nemo_rl_offload.models import cpu_compat  # noqa: E402

RANDOM = "megatron.core.tensor_parallel.random"


def _snapshot() -> dict[tuple[str, str], object]:
    names = [(m, "torch") for m in cpu_compat.CUDA_DEVICE_MODULES] + [
        ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
        (RANDOM, "_CUDA_RNG_STATE_TRACKER"),
        (RANDOM, "_get_cuda_rng_state"),
        (RANDOM, "_set_cuda_rng_state"),
    ]
    return {(m, a): getattr(importlib.import_module(m), a) for m, a in names}


@pytest.fixture
def patches_off():
    """Start and end each test with the patches off (other modules' fixtures enable them)."""
    cpu_compat.disable_cpu_execution()
    yield
    cpu_compat.disable_cpu_execution()


def test_enable_is_idempotent_and_disable_restores_every_name(patches_off):
    before = _snapshot()
    real_current_device = torch.cuda.current_device
    cpu_compat.enable_cpu_execution()
    patched = _snapshot()
    cpu_compat.enable_cpu_execution()
    assert _snapshot() == patched
    assert cpu_compat.cpu_execution_enabled()
    assert all(patched[key] is not before[key] for key in before)
    # The process-wide torch.cuda is untouched; only the Megatron modules see the stand-in.
    assert torch.cuda.current_device is real_current_device
    rotary = importlib.import_module(cpu_compat.CUDA_DEVICE_MODULES[1])
    assert rotary.torch.cuda.current_device() == torch.device("cpu")
    assert rotary.torch.ones(2).sum().item() == 2.0
    cpu_compat.disable_cpu_execution()
    assert _snapshot() == before
    assert not cpu_compat.cpu_execution_enabled()


def test_stream_stand_ins_are_one_cpu_stream(patches_off):
    cpu_compat.enable_cpu_execution()
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    cuda = dispatcher.torch.cuda
    dispatcher_cls = dispatcher.MoEAlltoAllTokenDispatcher
    assert dispatcher_cls.cuda_dtoh_stream is None
    stream = dispatcher_cls.cuda_dtoh_stream = cuda.Stream()  # as the dispatcher does
    assert cuda.current_stream() is stream
    stream.wait_stream(cuda.current_stream())
    with cuda.stream(stream):
        event = stream.record_event()
    event.synchronize()
    cpu_compat.disable_cpu_execution()
    # A GPU model built later in this process must create a real CUDA stream, not reuse ours.
    assert dispatcher_cls.cuda_dtoh_stream is not stream


def test_causal_mask_and_rng_tracker_on_cpu(patches_off):
    cpu_compat.enable_cpu_execution()
    fused_softmax = importlib.import_module("megatron.core.fusions.fused_softmax")
    mask = fused_softmax.get_default_causal_mask(3)
    assert mask.device.type == "cpu"
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    random = importlib.import_module(RANDOM)
    tracker = random.get_cuda_rng_tracker()
    assert isinstance(tracker, cpu_compat.CpuRngTracker)
    tracker.add("model-parallel-rng", 7)
    with pytest.raises(ValueError, match="seed 7 already exists"):
        tracker.add("other", 7)
    state = torch.get_rng_state()
    with tracker.fork():
        pass
    assert torch.equal(state, torch.get_rng_state())


def test_schedule_allocation_patch_is_scoped_to_the_call():
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    original = schedules.torch
    with cpu_compat.cpu_schedule_allocations():
        counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")
        assert counter.device.type == "cpu" and counter.dtype == torch.int
        assert schedules.torch.zeros(2, device="cpu").device.type == "cpu"
    assert schedules.torch is original
    with pytest.raises(RuntimeError), cpu_compat.cpu_schedule_allocations():
        raise RuntimeError("boom")
    assert schedules.torch is original


def test_checkpoint_io_stand_in_lasts_one_call():
    writer = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    real = writer.torch
    with cpu_compat.cpu_checkpoint_io():
        assert writer.torch is not real
        writer.torch.cuda.synchronize()  # nothing to wait for on CPU
        assert writer.torch.tensor([1], device="cuda").device.type == "cpu"
    assert writer.torch is real


def test_parameters_answer_cuda_type_names_only_while_the_optimizer_is_built():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2).bfloat16())]
    with cpu_compat.params_typed_as_cuda(params):
        assert [p.type() for p in params] == ["torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor"]
        assert params[0].type(torch.float64).dtype == torch.float64  # a cast is still a cast
    assert [p.type() for p in params] == ["torch.FloatTensor", "torch.BFloat16Tensor"]
    assert "type" not in vars(params[0])
