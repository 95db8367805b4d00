"""The changes to Megatron's offload handler, on CPU: Megatron's own handler methods run on a
handler object holding Megatron's own pinned-pool class (unpinned here, there being no GPU);
the copies are then CPU-to-CPU copies of the same layouts. tests/unit/offload/test_runtime_gpu.py
checks the GPU side (one memcpy, no kernel)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rl_offload.offload import handler_patches


class _Event:
    def __init__(self, at_ms: float) -> None:
        self.at_ms = at_ms

    def elapsed_time(self, end: _Event) -> float:
        return end.at_ms - self.at_ms


def test_copy_timer_sums_intervals_per_direction_and_resets():
    timer = handler_patches.CopyTimer()
    timer.record("d2h", _Event(0), _Event(10), 10**9)
    timer.record("d2h", _Event(50), _Event(60), 10**9)
    timer.record("h2d", _Event(0), _Event(40), 2 * 10**9)
    metrics = timer.collect()
    assert metrics["d2h_time_s"] == pytest.approx(0.02)
    assert metrics["d2h_gb_per_s"] == pytest.approx(100.0)
    assert metrics["h2d_gb_per_s"] == pytest.approx(50.0)
    assert metrics["h2d_gib"] == pytest.approx(2 * 10**9 / 2**30)
    assert timer.collect()["d2h_time_s"] == 0.0 and timer.collect()["d2h_gb_per_s"] == 0.0


@pytest.mark.parametrize(
    ("make", "dense"),
    [
        (lambda: torch.zeros(2, 3, 4), True),
        (lambda: torch.zeros(2, 3, 4).permute(1, 2, 0), True),  # SDPA's [b, h, s, d] view
        (lambda: torch.zeros(4, 1, 8, 16).permute(1, 2, 0, 3), True),
        (lambda: torch.zeros(2, 1, 4).expand(2, 5, 4), False),  # overlapping
        (lambda: torch.zeros(6, 4)[:, :2], False),  # a slice: gaps in its span
        (lambda: torch.zeros(4, 12).split(4, dim=1)[1].t(), False),  # a split, transposed
        (lambda: torch.zeros(5, 1, 3)[:, :, :], True),
    ],
)
def test_dense_permutation_is_a_block_of_memory_in_some_dimension_order(make, dense):
    assert handler_patches.is_dense_permutation(make()) is dense


@pytest.fixture
def strided(monkeypatch):
    """A manager installed as the runtime installs one for a dense model (strided copies on)."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    handler_patches._patch_strided_copies()
    manager = SimpleNamespace(strided_copies=True)
    monkeypatch.setattr(fgo.PipelineOffloadManager, "OFFLOAD_MGR", manager)
    return manager


@pytest.fixture
def handler(strided):
    """What Megatron's offload/reload use of a ChunkOffloadHandler (its constructor needs CUDA
    streams): its pinned pool, unpinned here."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorPool

    return SimpleNamespace(cpu_tensor_pool=OffloadTensorPool(device="cpu", pin_memory=False))


def _offload(handler, tensor, use_cpu_pool=True):
    chunk = handler_patches._handler()
    return chunk.offload(handler, tensor, pin_memory=False, use_cpu_pool=use_cpu_pool)


def _reload(handler, state):
    return handler_patches._handler().reload(handler, state)


@pytest.mark.parametrize("use_cpu_pool", [True, False])
def test_a_permuted_tensor_goes_out_and_back_with_its_strides(handler, use_cpu_pool):
    saved = torch.arange(2 * 3 * 4 * 5, dtype=torch.bfloat16).reshape(2, 3, 4, 5)
    view = saved.permute(1, 2, 0, 3)
    state = _offload(handler, view, use_cpu_pool)
    host = state[1]
    assert host.stride() == view.stride() and not host.is_contiguous()
    back = _reload(handler, state)
    assert back.stride() == view.stride() and torch.equal(back, view)
    if use_cpu_pool:  # the pooled buffer (not the view) is free again, for the next step
        entry = handler.cpu_tensor_pool._pools[(view.shape, view.dtype)]
        assert len(entry["free"]) == 1 and entry["free"][0] is host._base


def test_a_plan_without_strided_copies_keeps_megatrons_copy(handler, strided):
    strided.strided_copies = False  # a MoE model's plan
    view = torch.randn(2, 3, 4).permute(2, 0, 1)
    state = _offload(handler, view)
    assert state[1].is_contiguous() and torch.equal(_reload(handler, state), view)


def test_other_tensors_keep_megatrons_contiguous_copy(handler):
    for tensor in (torch.randn(4, 6), torch.randn(6, 4)[:, :2]):
        state = _offload(handler, tensor)
        assert state[1].is_contiguous()
        back = _reload(handler, state)
        assert back.is_contiguous() and torch.equal(back, tensor)


def test_install_is_idempotent():
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        ChunkOffloadHandler,
    )

    handler_patches.install()
    methods = (ChunkOffloadHandler.offload, ChunkOffloadHandler.tensor_pop)
    handler_patches.install()
    assert (ChunkOffloadHandler.offload, ChunkOffloadHandler.tensor_pop) == methods


@pytest.mark.parametrize(
    ("count", "fraction"), [(75, 0.5), (10, 0.3), (8, 1.0), (8, 0.0), (7, 0.9)]
)
def test_spread_choice_offloads_as_many_groups_as_megatrons_rule(count, fraction):
    choice = handler_patches.spread_choice(count, fraction)
    assert sum(choice) == count - int(count * (1 - fraction))


def test_spread_choice_alternates_at_one_half():
    assert handler_patches.spread_choice(6, 0.5) == [True, False] * 3


class _Chunk:
    """What post_warmup_callback reads of a ChunkOffloadHandler: its groups (Megatron's own
    OffloadTensorGroup, with the bytes a warm-up step would have counted)."""

    def __init__(self, names: list[str], layers: int) -> None:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            OffloadTensorGroup,
        )

        self.is_warmup = True
        self.offload_groups = []
        for _ in range(layers):
            for name in names:
                group = OffloadTensorGroup(name)
                group.total_offload_bytes = 100
                self.offload_groups.append(group)

    def get_max_deduplicated_groups(self) -> int:
        return len({group._name for group in self.offload_groups})


def _warmed_up_manager(placement: str | None, fraction: float):
    chunk = _Chunk(["core_attn", "attn_proj"], layers=5)
    manager = SimpleNamespace(
        _is_warmup=True,
        _cached_chunks_forward=[chunk],
        _cached_chunks_backward=[chunk],
        _offload_margin=0,
        _pp_rank=0,
        _delta_offload_bytes_across_pp_ranks=0,
        _activation_offload_fraction=fraction,
    )
    if placement is not None:
        manager.fraction_placement = placement
    return manager, chunk


@pytest.fixture
def printed(monkeypatch):
    """The summary tables Megatron would print (they need torch.distributed)."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    handler_patches._patch_fraction_placement()
    tables: list[dict] = []
    monkeypatch.setattr(fgo, "print_offload_summary_table", lambda table: tables.append(table))
    return tables


def test_spread_placement_offloads_evenly_spaced_groups(printed):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    manager, chunk = _warmed_up_manager("spread", 0.5)
    PipelineOffloadManager.post_warmup_callback(manager)
    # Megatron keeps the last group of each module on the GPU; of each module's other 4
    # (layers 0-3), every other layer offloads: layers 0 and 2.
    offloaded = [group.offload for group in chunk.offload_groups]
    assert offloaded == [True, True, False, False, True, True, False, False, False, False]
    assert printed == [{"core_attn": 200, "attn_proj": 200}]  # printed once, as trained
    assert manager._offload_summary_total_bytes == 400
    assert manager._activation_offload_fraction == 0.5


@pytest.mark.parametrize("placement", ["earliest", None])
def test_earliest_placement_is_megatrons_own(printed, placement):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    manager, chunk = _warmed_up_manager(placement, 0.5)
    PipelineOffloadManager.post_warmup_callback(manager)
    assert [group.offload for group in chunk.offload_groups] == [True] * 4 + [False] * 6
    assert printed == [{"core_attn": 200, "attn_proj": 200}]
