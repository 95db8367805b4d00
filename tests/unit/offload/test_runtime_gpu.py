"""The offload runtime on a GPU: an RL-shaped sequence of steps (changing micro-batch counts and
lengths, forward-only passes in between) on the ~1B dense preset with offloading on.

Run on a GPU machine (docs/gpu.md); skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(2, 1024), (3, 1024), (2, 2048)]  # (micro-batches, padded length)


def _microbatches(count: int, length: int, rng: np.random.Generator) -> list[dict]:
    out = []
    for _ in range(count):
        ids = rng.integers(0, 32000, (2, length))
        out.append({"input_ids": ids, "labels": ids, "loss_mask": np.ones((2, length), np.float32)})
    return out


@pytest.fixture(scope="module")
def worker():
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    section = {
        "model_name": "llama-1b",
        "precision": "bfloat16",
        "max_total_sequence_length": 2048,
        "megatron_cfg": {
            "enabled": True,
            "fine_grained_activation_offloading": True,
            "offload_modules": ["core_attn", "attn_proj"],
            "optimizer": {"optimizer": "adam", "lr": 1e-5, "use_distributed_optimizer": False},
        },
    }
    policy = PolicyWorker(
        settings=resolve_policy(section), rank=0, world_size=1, seed=1, on_gpu=True
    )
    address, port = policy.node_address()
    policy.setup(address, port)
    return policy


def test_rl_shaped_steps_keep_one_plan_per_shape_with_stable_memory(worker):
    rng = np.random.default_rng(0)
    peaks: dict[tuple[int, int], list[float]] = {shape: [] for shape in SHAPES}
    pinned_after_round: list[float] = []
    for _ in range(3):
        for count, length in SHAPES:
            batch = _microbatches(count, length, rng)
            worker.token_logprobs(batch[:1])  # a forward-only pass between training steps
            metrics = worker.train(batch, {"name": "nll"})
            assert metrics["offloaded_gib_per_step"] > 0
            # The copy timing counts what went out and came back (bulk and compute-stream).
            assert metrics["d2h_gib"] == metrics["h2d_gib"] > 0
            assert metrics["d2h_time_s"] > 0 and metrics["h2d_time_s"] > 0
            peaks[(count, length)].append(metrics["peak_fwd_bwd_gpu_memory_gib"])
        pinned_after_round.append(metrics["pinned_host_gib"])
    assert worker.runtime.plans_recorded == len(SHAPES)  # recorded once, then replayed
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    from nemo_rl_offload.offload.owned import OwnedChunkHandler, OwnedOffloadManager

    plan = fgo.PipelineOffloadManager.OFFLOAD_MGR
    assert isinstance(plan, OwnedOffloadManager)  # the runtime's own, installed as Megatron's
    assert plan.choices.strided_copies and plan.choices.lean_hooks  # a dense model's plans
    assert all(type(chunk) is OwnedChunkHandler for chunk in plan._cached_chunks_forward)
    assert metrics["offload_plans_released"] == 0
    for shape, values in peaks.items():  # after its first (warm-up) step, a shape's peak holds
        assert abs(values[2] - values[1]) <= 0.05 * values[1], (shape, values)
    assert pinned_after_round[1] == pinned_after_round[2], pinned_after_round


def test_a_permuted_tensor_is_copied_by_one_memcpy_each_way_without_a_kernel():
    """SDPA saves permuted views; offloading them must not launch copy kernels (which compete
    with the compute) nor change the layout autograd saved."""
    from nemo_rl_offload.offload import owned

    handler = object.__new__(owned.OwnedChunkHandler)  # what offload and reload use of one:
    handler.choices = owned.PlanChoices(strided_copies=True)  # a dense model's plan
    handler.cpu_tensor_pool = owned.OwnedHostPool(device="cpu", pin_memory=True)
    view = torch.randn(4096, 1, 32, 64, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        state = handler.offload(view)
        back = handler.reload(state)
        torch.cuda.synchronize()
    kinds = [event.name for event in prof.events() if event.device_type.name == "CUDA"]
    assert back.stride() == view.stride() and torch.equal(back, view)
    assert not any("kernel" in name.lower() for name in kinds), kinds
    assert sum("memcpy" in name.lower() for name in kinds) == 2, kinds


def test_two_groups_saving_one_storage_move_it_once_each_way():
    """SDPA's saved output and the output projection's input are one storage: with one copy
    per storage, the second group's offload copies nothing, the two reloads copy it back once,
    and both views come back with their values and strides (offload/shared_copies.py)."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    from nemo_rl_offload.offload import owned, shared_copies

    handler = object.__new__(owned.OwnedChunkHandler)
    handler.choices = owned.PlanChoices(
        strided_copies=True, lean_hooks=True, one_copy_per_storage=True
    )
    handler.cpu_tensor_pool = owned.OwnedHostPool(device="cpu", pin_memory=True)
    handler.shared_copies = shared_copies.SharedCopies()
    handler.min_offloaded_tensor_size = 1
    handler.is_warmup = True
    handler.d2h_stream = torch.cuda.Stream()
    handler._max_inflight_offloads = None
    buffer = torch.randn(1, 4096, 32, 64, device="cuda", dtype=torch.bfloat16)  # [b, s, h, d]
    out = buffer.transpose(1, 2)  # SDPA's saved output, [b, h, s, d]
    projection_input = out.permute(2, 0, 1, 3).reshape(4096, 1, 32 * 64)
    expected_out, expected_input = out.clone(), projection_input.clone()
    groups = []
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for name, tensor in (("core_attn", out), ("attn_proj", projection_input)):
            group = fgo.OffloadTensorGroup(name)
            group.push_tensor((name, 0), tensor)
            handler._lean_bulk_offload_group(group)
            groups.append(group)
        handler.d2h_stream.synchronize()
        del buffer, out, projection_input
        states = [group._tensors[(group._name, 0)] for group in groups]
        back_input = handler.reload(states[1])  # backward: the projection first
        back_out = handler.reload(states[0])
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" in e.name]
    assert len(copies) == 2, copies  # one device-to-host, one host-to-device
    assert torch.equal(back_out, expected_out) and back_out.stride() == expected_out.stride()
    assert torch.equal(back_input, expected_input)
    assert back_input.stride() == expected_input.stride()
    assert back_out.untyped_storage().data_ptr() == back_input.untyped_storage().data_ptr()
    assert handler.cpu_tensor_pool.in_use() == 0


def test_the_lean_saved_tensor_hook_tags_as_megatrons():
    """A CUDA tensor the lean hook takes gets Megatron's tag in Megatron's group; anything else
    (a parameter, a CPU tensor) goes through Megatron's own hook, which leaves it as it is."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    from nemo_rl_offload.offload import owned

    def chunk(lean: bool) -> owned.OwnedChunkHandler:
        handler = object.__new__(owned.OwnedChunkHandler)
        handler.choices = owned.PlanChoices(lean_hooks=lean)
        handler.offload_groups = [fgo.OffloadTensorGroup("core_attn")]
        handler._offloaded_group_index = 1
        handler._tensor_count_current_group = 0
        return handler

    tensors = [
        torch.ones(4, device="cuda"),
        torch.nn.Parameter(torch.ones(4, device="cuda")),
        torch.ones(4),
        torch.ones(2, 2, device="cuda").t(),
    ]
    lean, megatron = chunk(True), chunk(False)
    for tensor in tensors:
        got, expected = lean.tensor_push(tensor), megatron.tensor_push(tensor)
        assert type(got) is type(expected) and (
            got == expected if isinstance(got, tuple) else got is expected
        )
    assert list(lean.offload_groups[0]._tensors) == list(megatron.offload_groups[0]._tensors)
    assert lean._tensor_count_current_group == megatron._tensor_count_current_group == 2
