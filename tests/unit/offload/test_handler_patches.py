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


def _dense_plan(monkeypatch):
    """The changes installed, and a manager as the runtime installs one for a dense model."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    handler_patches.install()
    manager = SimpleNamespace(strided_copies=True, lean_hooks=True)
    monkeypatch.setattr(fgo.PipelineOffloadManager, "OFFLOAD_MGR", manager)
    return manager


@pytest.fixture
def strided(monkeypatch):
    """A dense model's plan: strided copies on."""
    return _dense_plan(monkeypatch)


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
        OffloadTensorPool,
    )

    def installed():
        names = ("offload", "tensor_pop", "bulk_offload_group", "bulk_reload_group")
        return [getattr(ChunkOffloadHandler, name) for name in names] + [OffloadTensorPool.free]

    handler_patches.install()
    methods = installed()
    handler_patches.install()
    assert installed() == methods


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


def _warmed_up_manager(
    placement: str | None, fraction: float, names: tuple[str, ...] = ("core_attn", "attn_proj")
):
    chunk = _Chunk(list(names), layers=5)
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


@pytest.mark.parametrize("pool_expert_groups", [True, False, None])
def test_expert_groups_are_pooled_after_warmup_only_where_shapes_are_static(
    printed, pool_expert_groups
):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    handler_patches._patch_pooled_expert_groups()
    manager, chunk = _warmed_up_manager("spread", 1.0, ("core_attn", "expert_fc1", "moe_act"))
    if pool_expert_groups is not None:
        manager.pool_expert_groups = pool_expert_groups
    pooled = {g._name: g.use_cpu_pool for g in chunk.offload_groups}
    assert pooled == {"core_attn": True, "expert_fc1": False, "moe_act": False}  # Megatron's
    PipelineOffloadManager.post_warmup_callback(manager)
    expected = pool_expert_groups is True
    for group in chunk.offload_groups:
        assert group.use_cpu_pool is (True if group._name == "core_attn" else expected)
    assert not manager._is_warmup  # Megatron's own callback ran too


@pytest.fixture
def lean(monkeypatch):
    """A dense model's plan: lean hooks on."""
    return _dense_plan(monkeypatch)


LEAN_METHODS = handler_patches.LEAN_METHODS


def test_install_makes_the_hooks_lean_over_the_timed_and_megatron_methods():
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    handler_patches.install()
    chunk = fgo.ChunkOffloadHandler
    assert all(getattr(getattr(chunk, name), "_lean", False) for name in LEAN_METHODS)
    # Under graph capture the lean methods fall back on what they replaced: the copy timing's
    # wrappers, which wrap Megatron's own.
    assert chunk.bulk_offload_group._replaced._timed
    assert fgo.OffloadTensorPool.free._replaced.__module__ == fgo.__name__


def test_another_megatron_version_keeps_its_own_hooks(monkeypatch):
    import megatron.core
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    handler_patches.install()
    chunk = fgo.ChunkOffloadHandler
    for name in LEAN_METHODS:
        monkeypatch.setattr(chunk, name, getattr(chunk, name)._replaced)
    pool = fgo.OffloadTensorPool
    monkeypatch.setattr(pool, "free", pool.free._replaced)
    monkeypatch.setattr(pool, "allocate", pool.allocate._replaced)
    monkeypatch.setattr(megatron.core, "__version__", "0.20.0")
    assert handler_patches._patch_lean_hooks() is False
    assert not any(getattr(getattr(chunk, name), "_lean", False) for name in LEAN_METHODS)
    assert fgo.OffloadTensorPool.free.__module__ == fgo.__name__


def _pool_run(allocate, free):
    """The same allocations and frees through one pool: what a step does to it."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorPool

    pool = OffloadTensorPool(device="cpu", pin_memory=False)
    shape = torch.Size([4, 8])
    first = [allocate(pool, shape, torch.bfloat16) for _ in range(3)]
    other = allocate(pool, torch.Size([2]), torch.float32)
    for tensor in first[:2]:
        free(pool, tensor)
    again = allocate(pool, shape, torch.bfloat16)
    free(pool, other)
    pool.reset()
    after_reset = allocate(pool, shape, torch.bfloat16)
    reuse = [again is first[0], after_reset is first[0]]
    free_counts = {key: len(entry["free"]) for key, entry in pool._pools.items()}
    return pool._stats, reuse, free_counts, pool


def test_the_lean_pinned_pool_keeps_megatrons_counts_and_reuse(lean):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorPool

    methods = (OffloadTensorPool.allocate, OffloadTensorPool.free)
    megatron = tuple(method._replaced for method in methods)
    assert _pool_run(*methods)[:3] == _pool_run(*megatron)[:3]


@pytest.mark.parametrize("lean_hooks", [True, False])
def test_a_plan_without_lean_hooks_keeps_megatrons_pool(lean, lean_hooks):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorPool

    lean.lean_hooks = lean_hooks  # False: a MoE model's plan
    *_, pool = _pool_run(OffloadTensorPool.allocate, OffloadTensorPool.free)
    # The lean free keeps the identities of the pool's tensors beside its list.
    assert all(("owned" in entry) is lean_hooks for entry in pool._pools.values())


def test_the_lean_pool_refuses_a_tensor_it_did_not_make_as_megatron_does(lean):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorPool

    *_, pool = _pool_run(OffloadTensorPool.allocate, OffloadTensorPool.free)
    with pytest.raises(ValueError, match="doesn't belong to this pool"):
        pool.free(torch.empty(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="No pool exists"):
        pool.free(torch.empty(3, 3))


def test_owned_identities_follow_the_pools_list():
    made = [torch.empty(1), torch.empty(1)]
    entry = {"all": list(made)}
    assert handler_patches._owned(entry) == {id(t) for t in made}
    entry["all"].append(torch.empty(1))
    assert id(entry["all"][-1]) in handler_patches._owned(entry)


class _Duck:
    """What the offload check reads of a tensor, on a "cuda" device (there is none here)."""

    def __init__(self, numel: int, **marks: object) -> None:
        self.device = SimpleNamespace(type="cuda")
        self._numel = numel
        for name, value in marks.items():
            setattr(self, name, value)

    def numel(self) -> int:
        return self._numel


@pytest.mark.parametrize(
    "tensor",
    [
        _Duck(10),
        _Duck(2),
        _Duck(10, _do_not_offload=True),
        _Duck(10, _TE_do_not_offload=True),
        _Duck(10, get_data_tensors=lambda: [_Duck(1, _TE_do_not_offload=True)]),
        _Duck(10, get_data_tensors=lambda: [None, _Duck(1)]),
        torch.empty(10),  # on the CPU
        torch.nn.Parameter(torch.empty(10)),
    ],
)
def test_the_lean_offload_check_answers_as_megatrons(lean, tensor):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        ChunkOffloadHandler,
    )

    check = ChunkOffloadHandler.tensor_need_offloading_checker
    owner = SimpleNamespace(
        min_offloaded_tensor_size=5,
        _can_manage_tensor_for_offload=ChunkOffloadHandler._can_manage_tensor_for_offload,
    )
    assert check(owner, tensor) is check._replaced(owner, tensor)


def test_copy_timer_reuses_the_events_it_has_read():
    timer = handler_patches.CopyTimer()
    start, end = _Event(0), _Event(5)
    timer.record("d2h", start, end, 10)
    timer.collect()
    assert {timer.event(), timer.event()} == {start, end}
