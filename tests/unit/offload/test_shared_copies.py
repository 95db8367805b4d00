"""One host copy per saved storage (offload/shared_copies.py), on CPU.

The handler's lean offload loop runs as on the GPU, with the copy stream and the CUDA-only
calls (stream switch, record_stream, offload event) made no-ops, Megatron's offload check
accepting CPU tensors, and an unpinned pool: the copies are then CPU-to-CPU copies of the same
layouts. The attention's case: SDPA saves its output [b, h, s, d] (a permuted view of a
[b, s, h, d] buffer), and the output projection saves the same bytes as [s, b, h * d]."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

from nemo_rl_offload.models.attention import SDPACoreAttention
from nemo_rl_offload.offload import owned, shared_copies
from nemo_rl_offload.offload.shared_copies import SharedView, is_storage_image

SEQ, HEADS, DIM = 16, 4, 8


@pytest.mark.parametrize(
    ("make", "image"),
    [
        (lambda: torch.zeros(2, 3, 4), True),
        (lambda: torch.zeros(1, 16, 4, 8).transpose(1, 2), True),  # SDPA's saved output
        (
            lambda: torch.zeros(1, 16, 4, 8).transpose(1, 2).permute(2, 0, 1, 3).reshape(16, 1, 32),
            True,
        ),
        (lambda: torch.zeros(6, 4)[:, :2], False),  # a slice: gaps
        (lambda: torch.zeros(6, 4)[2:], False),  # starts after the storage's first byte
        (lambda: torch.zeros(2, 1, 4).expand(2, 5, 4), False),  # overlapping
    ],
)
def test_a_storage_image_is_every_byte_of_its_storage_once(make, image):
    assert is_storage_image(make()) is image


@pytest.fixture
def cpu_copies(monkeypatch):
    """The CUDA-only calls of the lean offload loop as no-ops, and Megatron's offload check
    for CPU tensors (the loop's own check runs first)."""
    monkeypatch.setattr(
        owned, "_STREAMS", SimpleNamespace(use=lambda s: None, current=lambda: None)
    )
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(fgo.OffloadTensorGroup, "record_offload_event", lambda self, s: None)
    monkeypatch.setattr(
        fgo.ChunkOffloadHandler,
        "tensor_need_offloading_checker",
        lambda self, t: t.numel() >= self.min_offloaded_tensor_size,
    )


def _handler(one_copy: bool) -> owned.OwnedChunkHandler:
    choices = owned.PlanChoices(strided_copies=True, one_copy_per_storage=one_copy)
    pool = owned.OwnedHostPool(device="cpu", pin_memory=False)
    obj = object.__new__(owned.OwnedChunkHandler)
    vars(obj).update(
        choices=choices,
        cpu_tensor_pool=pool,
        shared_copies=shared_copies.SharedCopies(),
        min_offloaded_tensor_size=1,
        is_warmup=True,
        d2h_stream=None,
        _max_inflight_offloads=None,
    )
    return obj


def _attention_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A query, SDPA's saved output, and the projection's input viewing the same bytes."""
    query = torch.randn(1, HEADS, SEQ, DIM)
    context = torch.randn(1, SEQ, HEADS, DIM)  # the kernel's buffer, [b, s, h, d]
    out = context.transpose(1, 2)  # [b, h, s, d], as SDPA returns and saves it
    projection_input = out.permute(2, 0, 1, 3).reshape(SEQ, 1, HEADS * DIM)
    assert projection_input.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    return query, out, projection_input


def _offload(handler, name: str, tensors: list[torch.Tensor]) -> fgo.OffloadTensorGroup:
    group = fgo.OffloadTensorGroup(name)
    for index, tensor in enumerate(tensors):
        group.push_tensor((name, index), tensor)
    handler._lean_bulk_offload_group(group)
    return group


def test_two_groups_saving_one_storage_copy_it_once_and_get_their_views_back(cpu_copies):
    handler = _handler(one_copy=True)
    query, out, projection_input = _attention_tensors()
    core_attn = _offload(handler, "core_attn", [query, out])
    attn_proj = _offload(handler, "attn_proj", [projection_input])
    pool = handler.cpu_tensor_pool
    assert pool.in_use() == 2  # the query and the output: the projection's input shares one
    assert core_attn.total_offload_bytes == query.nbytes + out.nbytes  # what was copied
    assert attn_proj.total_offload_bytes == 0
    out_state, proj_state = (
        core_attn._tensors[("core_attn", 1)],
        attn_proj._tensors[("attn_proj", 0)],
    )
    assert isinstance(out_state, SharedView) and isinstance(proj_state, SharedView)
    assert not isinstance(core_attn._tensors[("core_attn", 0)], SharedView)
    assert owned._state_bytes(proj_state) == out.nbytes
    # Backward: the projection's group reloads first, the attention's after it.
    proj_back = handler.reload(proj_state)
    assert owned._state_bytes(out_state) == 0  # the bytes are back already
    out_back = handler.reload(out_state)
    query_back = handler.reload(core_attn._tensors[("core_attn", 0)])
    assert (
        torch.equal(proj_back, projection_input) and proj_back.stride() == projection_input.stride()
    )
    assert torch.equal(out_back, out) and out_back.stride() == out.stride()
    assert out_back.untyped_storage().data_ptr() == proj_back.untyped_storage().data_ptr()
    assert torch.equal(query_back, query)
    assert pool.in_use() == 0


def test_without_the_choice_each_group_copies_its_own(cpu_copies):
    handler = _handler(one_copy=False)
    query, out, projection_input = _attention_tensors()
    core_attn = _offload(handler, "core_attn", [query, out])
    attn_proj = _offload(handler, "attn_proj", [projection_input])
    assert handler.cpu_tensor_pool.in_use() == 3
    assert not any(
        isinstance(state, SharedView)
        for group in (core_attn, attn_proj)
        for state in group._tensors.values()
    )


def test_a_storage_kept_on_the_gpu_is_not_copied(cpu_copies):
    handler = _handler(one_copy=True)
    query, out, projection_input = _attention_tensors()
    handler.shared_copies.keep(projection_input)  # the projection keeps the attention's output
    core_attn = _offload(handler, "core_attn", [query, out])
    assert core_attn._tensors[("core_attn", 1)] is out  # left on the GPU, as saved
    assert handler.cpu_tensor_pool.in_use() == 1
    assert core_attn.total_offload_bytes == query.nbytes


def test_other_storages_and_other_dtypes_are_copied_on_their_own(cpu_copies):
    handler = _handler(one_copy=True)
    first = torch.randn(SEQ, HEADS * DIM)
    same_values = first.clone()  # equal bytes, another storage
    reinterpreted = first.view(torch.int32)  # the same storage read as another dtype
    _offload(handler, "core_attn", [first])
    group = _offload(handler, "attn_proj", [same_values, reinterpreted])
    assert handler.cpu_tensor_pool.in_use() == 3
    assert not any(isinstance(state, SharedView) for state in group._tensors.values())


def test_noted_storages_are_forgotten_when_they_are_freed(cpu_copies):
    handler = _handler(one_copy=True)
    query, out, projection_input = _attention_tensors()
    _offload(handler, "core_attn", [query, out])
    handler.shared_copies.keep(query)
    assert len(handler.shared_copies) == 3
    del query, out, projection_input
    gc.collect()
    assert len(handler.shared_copies) == 0


def test_keep_on_gpu_marks_the_micro_batch_being_run_forward(monkeypatch):
    handler = _handler(one_copy=True)
    tensor = torch.randn(4)
    manager = SimpleNamespace(_cur_forward_chunk=handler)
    monkeypatch.setattr(fgo.PipelineOffloadManager, "OFFLOAD_MGR", manager)
    shared_copies.keep_on_gpu(tensor)
    assert handler.shared_copies.kept(tensor.view(2, 2))
    monkeypatch.setattr(fgo.PipelineOffloadManager, "OFFLOAD_MGR", None)
    shared_copies.keep_on_gpu(torch.randn(4))  # no offloading: nothing to mark


@pytest.mark.parametrize(
    ("offloading", "modules", "keeps"),
    [
        (True, ["core_attn"], True),
        (True, ["attn_norm", "core_attn"], True),
        (True, ["core_attn", "attn_proj"], False),  # the projection's group takes the copy
        (True, ["attn_norm"], False),
        (False, ["core_attn"], False),
        (True, None, False),
    ],
)
def test_the_attention_keeps_its_output_when_only_the_projection_holds_it(
    offloading, modules, keeps
):
    config = SimpleNamespace(fine_grained_activation_offloading=offloading, offload_modules=modules)
    holder = SimpleNamespace(config=config)
    assert SDPACoreAttention._projection_keeps_output.fget(holder) is keeps
