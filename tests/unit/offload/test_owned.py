"""The runtime's subclasses of Megatron's offload classes, on CPU: their methods run on handler,
manager and pool objects of those classes (a handler's or manager's constructor needs CUDA
streams: they are made here without it, with the fields the methods read), holding pools that
are unpinned here, there being no GPU; the copies are then CPU-to-CPU copies of the same
layouts. tests/unit/offload/test_runtime_gpu.py checks the GPU side (one memcpy, no kernel).
And the fingerprints: the installed megatron-core's offload code is the code they were checked
against, and a changed one is refused."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.offload import owned


class _Event:
    def __init__(self, at_ms: float) -> None:
        self.at_ms = at_ms

    def elapsed_time(self, end: _Event) -> float:
        return end.at_ms - self.at_ms


def _bare(cls, **fields):
    """An object of ``cls`` made without its constructor (Megatron's needs CUDA streams)."""
    obj = object.__new__(cls)
    vars(obj).update(fields)
    return obj


def _pool() -> owned.OwnedHostPool:
    return owned.OwnedHostPool(device="cpu", pin_memory=False)


def test_copy_timer_sums_intervals_per_direction_and_resets():
    timer = owned.CopyTimer()
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
    assert owned.is_dense_permutation(make()) is dense


# A dense model's plan, as the runtime makes one.
DENSE = owned.PlanChoices(reload_waits_for_offload=True, strided_copies=True, lean_hooks=True)


@pytest.fixture
def handler():
    """What offload/reload use of a handler: its plan's choices and its pinned pool."""
    return _bare(owned.OwnedChunkHandler, choices=DENSE, cpu_tensor_pool=_pool())


def _offload(handler, tensor, use_cpu_pool=True):
    return handler.offload(tensor, pin_memory=False, use_cpu_pool=use_cpu_pool)


@pytest.mark.parametrize("use_cpu_pool", [True, False])
def test_a_permuted_tensor_goes_out_and_back_with_its_strides(handler, use_cpu_pool):
    saved = torch.arange(2 * 3 * 4 * 5, dtype=torch.bfloat16).reshape(2, 3, 4, 5)
    view = saved.permute(1, 2, 0, 3)
    state = _offload(handler, view, use_cpu_pool)
    host = state[1]
    assert host.stride() == view.stride() and not host.is_contiguous()
    back = handler.reload(state)
    assert back.stride() == view.stride() and torch.equal(back, view)
    if use_cpu_pool:  # the pooled buffer is free again, for the next step
        assert handler.cpu_tensor_pool.in_use() == 0 and len(handler.cpu_tensor_pool._free) == 1


def test_a_plan_without_strided_copies_keeps_megatrons_copy(handler):
    handler.choices = dataclasses.replace(DENSE, strided_copies=False)  # a MoE model's plan
    view = torch.randn(2, 3, 4).permute(2, 0, 1)
    state = _offload(handler, view)
    assert state[1].is_contiguous() and torch.equal(handler.reload(state), view)


def test_other_tensors_keep_megatrons_contiguous_copy(handler):
    for tensor in (torch.randn(4, 6), torch.randn(6, 4)[:, :2]):
        state = _offload(handler, tensor)
        assert state[1].is_contiguous()
        back = handler.reload(state)
        assert back.is_contiguous() and torch.equal(back, tensor)


class _Stream:
    """The compute stream as tensor_pop uses it: it notes what it waited for."""

    def __init__(self, log: list) -> None:
        self.log = log

    def wait_event(self, event) -> None:
        self.log.append(("wait", event))


class _TimingEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream) -> None:
        self.log.append(("record", self.name))


class _Timer:
    """A CopyTimer whose events note when they are recorded."""

    def __init__(self, log: list) -> None:
        self.log, self.events, self.recorded = log, iter(("start", "end")), []

    def event(self):
        return _TimingEvent(self.log, next(self.events))

    def record(self, direction, start, end, nbytes) -> None:
        self.recorded.append((direction, start.name, end.name, nbytes))


@pytest.mark.parametrize("waits", [True, False])
@pytest.mark.parametrize("timed", [True, False])
def test_a_reload_on_the_compute_stream_waits_for_its_offload_copy(monkeypatch, waits, timed):
    """Megatron-LM issue 7398: tensor_pop reloads an offloaded tensor on the compute stream;
    with reload_waits_for_offload that stream first waits for the group's offload event (and
    the reload is timed, with a timer); off, Megatron's tensor_pop alone."""
    log: list = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: _Stream(log))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    timer = _Timer(log) if timed else None
    choices = owned.PlanChoices(reload_waits_for_offload=waits, copy_timer=timer)
    chunk = _bare(owned.OwnedChunkHandler, choices=choices, cpu_tensor_pool=_pool())
    group = fgo.OffloadTensorGroup("core_attn")
    chunk.offload_groups, chunk._reloading_group = [group], []
    saved, kept = torch.randn(4, 8), torch.randn(3)
    group.push_tensor((1, 0), _offload(chunk, saved))  # offloaded: (device, host, pooled)
    group.push_tensor((1, 1), kept)  # kept on the device
    back = chunk.tensor_pop((1, 0))
    assert torch.equal(back, saved) and (1, 0) not in group._tensors
    expected = [("wait", group._offload_event)] if waits else []
    if timed:
        expected += [("record", "start"), ("record", "end")]
        assert timer.recorded == [("h2d", "start", "end", saved.numel() * 4)]
    assert log == expected
    log.clear()
    assert chunk.tensor_pop((1, 1)) is kept and log == []  # no copy: no wait, no timing
    # A tensor a bulk reload brought back while that reload is pending (a group enclosing
    # others, in the step recording the plan): the compute stream waits for the reload first.
    reloaded = torch.randn(5)
    group.push_tensor((1, 2), reloaded)
    chunk._reloading_group.append(group)
    assert chunk.tensor_pop((1, 2)) is reloaded and log == [("wait", group._reload_event)]
    log.clear()
    plain = torch.randn(2)
    assert chunk.tensor_pop(plain) is plain and log == []  # a tensor Megatron did not tag


def _megatron_code() -> dict[str, object]:
    """Every name of Megatron's offload module, and every method of its classes."""
    found: dict[str, object] = dict(vars(fgo))
    for name, value in vars(fgo).items():
        if inspect.isclass(value) and value.__module__ == fgo.__name__:
            for attr, member in vars(value).items():
                if inspect.isfunction(member) or isinstance(
                    member, (classmethod, staticmethod, property)
                ):
                    found[f"{name}.{attr}"] = member
    return found


def test_megatrons_classes_and_module_keep_their_own_code(monkeypatch, cpu_streams):
    """Building a runtime's plan and its handlers replaces nothing in Megatron."""
    before = _megatron_code()
    manager = owned.OwnedOffloadManager(
        dataclasses.replace(DENSE, fraction_placement="spread"), pool=_pool()
    )
    monkeypatch.setattr(fgo.PipelineOffloadManager, "OFFLOAD_MGR", manager)
    manager.init_model_chunk_offload_handler(0, None, None, 5, 0, 0.5)
    assert _megatron_code() == before
    for name, member in before.items():
        function = getattr(member, "__func__", member)
        if inspect.isfunction(function) and "." in name:
            assert function.__module__ == fgo.__name__, name


@pytest.mark.parametrize(
    ("count", "fraction"), [(75, 0.5), (10, 0.3), (8, 1.0), (8, 0.0), (7, 0.9)]
)
def test_spread_choice_offloads_as_many_groups_as_megatrons_rule(count, fraction):
    choice = owned.spread_choice(count, fraction)
    assert sum(choice) == count - int(count * (1 - fraction))


def test_spread_choice_alternates_at_one_half():
    assert owned.spread_choice(6, 0.5) == [True, False] * 3


class _Chunk:
    """What post_warmup_callback reads of a ChunkOffloadHandler: its groups (Megatron's own
    OffloadTensorGroup, with the bytes a warm-up step would have counted)."""

    def __init__(self, names: list[str], layers: int) -> None:
        self.is_warmup = True
        self.offload_groups = []
        for _ in range(layers):
            for name in names:
                group = fgo.OffloadTensorGroup(name)
                group.total_offload_bytes = 100
                self.offload_groups.append(group)

    def get_max_deduplicated_groups(self) -> int:
        return len({group._name for group in self.offload_groups})


def _warmed_up_manager(
    choices: owned.PlanChoices,
    fraction: float,
    names: tuple[str, ...] = ("core_attn", "attn_proj"),
):
    chunk = _Chunk(list(names), layers=5)
    manager = _bare(
        owned.OwnedOffloadManager,
        choices=choices,
        _is_warmup=True,
        _cached_chunks_forward=[chunk],
        _cached_chunks_backward=[chunk],
        _offload_margin=0,
        _pp_rank=0,
        _delta_offload_bytes_across_pp_ranks=0,
        _activation_offload_fraction=fraction,
    )
    return manager, chunk


@pytest.fixture
def printed(monkeypatch):
    """The summary tables Megatron would print (they need torch.distributed)."""
    tables: list[dict] = []
    monkeypatch.setattr(fgo, "print_offload_summary_table", lambda table: tables.append(table))
    return tables


def test_spread_placement_offloads_evenly_spaced_groups(printed):
    manager, chunk = _warmed_up_manager(owned.PlanChoices(fraction_placement="spread"), 0.5)
    manager.post_warmup_callback()
    # Megatron keeps the last group of each module on the GPU; of each module's other 4
    # (layers 0-3), every other layer offloads: layers 0 and 2.
    offloaded = [group.offload for group in chunk.offload_groups]
    assert offloaded == [True, True, False, False, True, True, False, False, False, False]
    assert printed == [{"core_attn": 200, "attn_proj": 200}]  # printed once, as trained
    assert manager._offload_summary_total_bytes == 400
    assert manager._activation_offload_fraction == 0.5
    assert not manager._is_warmup and not chunk.is_warmup


@pytest.mark.parametrize("placement", ["earliest", "spread"])
def test_the_summary_table_stays_off_stdout(monkeypatch, capsys, placement):
    """Megatron prints the plan's bytes as a table after the warm-up step; the runtime reports
    them per step instead, so neither placement leaves the table on the user's output."""
    monkeypatch.setattr(fgo, "print_offload_summary_table", lambda table: print("TABLE", table))
    manager, _ = _warmed_up_manager(owned.PlanChoices(fraction_placement=placement), 0.5)
    manager.post_warmup_callback()
    assert capsys.readouterr().out == ""
    assert manager._offload_summary_total_bytes == 400


@pytest.mark.parametrize("placement", ["earliest", None])
def test_earliest_placement_is_megatrons_own(printed, placement):
    choices = (
        owned.PlanChoices()
        if placement is None
        else owned.PlanChoices(fraction_placement=placement)
    )
    manager, chunk = _warmed_up_manager(choices, 0.5)
    manager.post_warmup_callback()
    assert [group.offload for group in chunk.offload_groups] == [True] * 4 + [False] * 6
    assert printed == [{"core_attn": 200, "attn_proj": 200}]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_spread_keeps_megatrons_other_steps(printed, fraction):
    """The spread placement's own copy of Megatron's callback keeps on the GPU what Megatron's
    other steps keep there (the last group of each module, the pipeline ranks' delta): at a
    fraction of 1 it is Megatron's callback; below, it offloads a subset of those groups."""

    def placed(placement: str, fraction: float):
        choices = owned.PlanChoices(fraction_placement=placement)
        manager, chunk = _warmed_up_manager(choices, fraction, ("core_attn", "attn_proj", "x"))
        manager._pp_rank, manager._delta_offload_bytes_across_pp_ranks = 1, 150
        manager.post_warmup_callback()
        assert manager._offload_margin == 0 and not manager._is_warmup
        offloaded = [group.offload for group in chunk.offload_groups]
        return offloaded, manager._offload_summary_bytes

    megatron, megatron_summary = placed("earliest", 1.0)
    spread, spread_summary = placed("spread", fraction)
    assert megatron[:2] == [False, False] and megatron[-3:] == [False] * 3
    if fraction == 1.0:
        assert (spread, spread_summary) == (megatron, megatron_summary)
    else:
        assert all(m for s, m in zip(spread, megatron, strict=True) if s)
        assert 0 < sum(spread) < sum(megatron)
    assert printed == [megatron_summary, spread_summary]


@pytest.mark.parametrize("pool_expert_groups", [True, False, None])
def test_expert_groups_are_pooled_after_warmup_only_where_shapes_are_static(
    printed, pool_expert_groups
):
    choices = owned.PlanChoices(fraction_placement="spread")
    if pool_expert_groups is not None:
        choices = dataclasses.replace(choices, pool_expert_groups=pool_expert_groups)
    manager, chunk = _warmed_up_manager(choices, 1.0, ("core_attn", "expert_fc1", "moe_act"))
    pooled = {g._name: g.use_cpu_pool for g in chunk.offload_groups}
    assert pooled == {"core_attn": True, "expert_fc1": False, "moe_act": False}  # Megatron's
    manager.post_warmup_callback()
    expected = pool_expert_groups is True
    for group in chunk.offload_groups:
        assert group.use_cpu_pool is (True if group._name == "core_attn" else expected)
    assert not manager._is_warmup  # Megatron's own callback ran too


@pytest.fixture
def cpu_streams(monkeypatch):
    """Megatron's manager makes CUDA streams in its constructor: stand-ins here."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: SimpleNamespace())


def _chunk_state(chunk) -> dict:
    """A handler's state but what the owned handler adds (its plan's choices and the record
    of its shared copies) and the streams."""
    own = ("choices", "shared_copies", "d2h_stream", "h2d_stream")
    return {k: v for k, v in vars(chunk).items() if k not in own}


def _manager_state(manager) -> dict:
    """A manager's state after creating handlers, with handlers named by creation order."""
    order = {id(chunk): index for index, chunk in enumerate(manager._cached_chunks_forward)}
    state = {}
    for key in ("_vpp", "_pp_rank", "_activation_offload_fraction", "_is_warmup"):
        state[key] = getattr(manager, key)
    state["_delta"] = manager._delta_offload_bytes_across_pp_ranks
    state["_queue"] = [order[id(c)] for c in manager._queue]
    state["_stages"] = [[order[id(c)] for c in stage] for stage in manager._stages]
    state["_backward"] = [order[id(c)] for c in manager._cached_chunks_backward]
    state["_cur"] = order[id(manager._cur_forward_chunk)]
    state["chunks"] = [
        (c.vpp_rank, c.min_offloaded_tensor_size, c._max_inflight_offloads)
        for c in manager._cached_chunks_forward
    ]
    return state


def test_the_manager_creates_owned_handlers_as_megatrons_creates_its_own(monkeypatch, cpu_streams):
    """Two virtual pipeline stages, so that Megatron's staging and flushing take part."""
    calls = [(0, 2, 0, 5, 7, 0.5, None), (0, 2, 1, 5, 7, 0.5, None), (0, 2, 0, 5, 7, 0.5, 3)]
    calls += [(0, 2, 1, 5, 7, 0.5, 3)]
    pool = _pool()
    managers = [fgo.PipelineOffloadManager(), owned.OwnedOffloadManager(DENSE, pool=pool)]
    for manager in managers:
        monkeypatch.setattr(fgo.PipelineOffloadManager, "OFFLOAD_MGR", manager)
        for *args, inflight in calls:
            manager.init_model_chunk_offload_handler(*args, max_inflight_offloads=inflight)
    megatron, ours = managers
    assert _manager_state(ours) == _manager_state(megatron)
    for chunk in ours._cached_chunks_forward:
        assert type(chunk) is owned.OwnedChunkHandler and chunk.choices is DENSE
        assert chunk.cpu_tensor_pool is pool and ours.cpu_tensor_pool is pool
        assert chunk.d2h_stream is ours.d2h_stream and chunk.h2d_stream is ours.h2d_stream
    pairs = zip(ours._cached_chunks_forward, megatron._cached_chunks_forward, strict=True)
    for mine, theirs in pairs:
        assert _chunk_state(mine).keys() == _chunk_state(theirs).keys()
    # Once the plan is recorded, neither creates handlers.
    for manager in managers:
        manager._is_warmup = False
        manager.init_model_chunk_offload_handler(0, 2, 0, 5)
    assert len(ours._cached_chunks_forward) == len(megatron._cached_chunks_forward) == 4


def test_a_manager_without_a_pool_makes_its_own(cpu_streams):
    manager = owned.OwnedOffloadManager(DENSE)
    assert isinstance(manager.cpu_tensor_pool, owned.OwnedHostPool)


@pytest.mark.parametrize(("lean_hooks", "capturing"), [(True, False), (True, True), (False, False)])
def test_lean_hooks_run_only_outside_graph_capture(monkeypatch, lean_hooks, capturing):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    chunk = _bare(
        owned.OwnedChunkHandler, choices=owned.PlanChoices(lean_hooks=lean_hooks), do_offload=False
    )
    assert chunk._lean_now() is (lean_hooks and not capturing)
    called: list[str] = []
    for name in ("on_group_commit_forward", "on_group_start_backward", "on_group_commit_backward"):
        monkeypatch.setattr(
            fgo.ChunkOffloadHandler, name, lambda self, *a, _name=name: called.append(_name)
        )
    for name in ("_lean_bulk_offload_group", "_lean_bulk_reload_group"):
        monkeypatch.setattr(
            owned.OwnedChunkHandler, name, lambda self, *a, _name=name: called.append(_name)
        )
    for name in ("bulk_offload_group", "bulk_reload_group"):
        monkeypatch.setattr(
            fgo.ChunkOffloadHandler, name, lambda self, *a, _name=name: called.append(_name)
        )
    chunk.on_group_commit_forward("core_attn", [])
    chunk.on_group_start_backward()
    chunk.on_group_commit_backward("core_attn")
    chunk.bulk_offload_group(SimpleNamespace())
    chunk.bulk_reload_group()
    if chunk._lean_now():  # the lean hooks return at once with offloading off
        assert called == ["_lean_bulk_offload_group", "_lean_bulk_reload_group"]
    else:  # Megatron's own (the bulk copies untimed: this plan has no timer)
        assert called == [
            "on_group_commit_forward",
            "on_group_start_backward",
            "on_group_commit_backward",
            "bulk_offload_group",
            "bulk_reload_group",
        ]


def test_size_classes_round_up_by_less_than_a_sixteenth_in_pages():
    for nbytes in [1, 4096, 4097, 2**20, 2**20 + 1, 3 * 2**20 + 5, 48 * 2**20, 2**33 - 7]:
        size = owned.size_class(nbytes)
        assert size >= nbytes and size % owned.PAGE == 0
        assert size < nbytes * (1 + 1 / owned.SIZE_CLASS_STEPS) + owned.PAGE
    assert owned.size_class(48 * 2**20) == 48 * 2**20  # sizes on a class stay as they are


def test_the_pool_lends_views_by_size_and_never_one_buffer_twice():
    pool = _pool()
    shapes = [((256, 8), torch.bfloat16), ((64, 3, 5), torch.float32), ((1000,), torch.uint8)]
    live = [pool.allocate(torch.Size(shape), dtype) for shape, dtype in shapes * 3]
    for tensor, (shape, dtype) in zip(live, shapes * 3, strict=True):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    for index, tensor in enumerate(live):
        tensor.fill_(index)
    for index, tensor in enumerate(live):  # no tensor's bytes were written by another
        assert torch.all(tensor == index)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in live)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    made = pool.pinned_bytes()
    big = live[0]  # 4 KiB of bf16: the largest class here
    pool.free(big)
    smaller = pool.allocate(torch.Size([100]), torch.float64)  # best fit: the freed buffer
    assert smaller.data_ptr() == big.data_ptr() and pool.pinned_bytes() == made
    larger = pool.allocate(torch.Size([8193]), torch.uint8)  # none holds it: a new buffer
    assert larger.data_ptr() not in {t.data_ptr() for t in live}
    assert pool.pinned_bytes() == made + 16384  # its class's, in a slab of a power of two


def test_the_pool_counts_as_megatrons_and_refuses_memory_it_did_not_lend():
    pool = _pool()
    first = [pool.allocate(torch.Size([4, 8]), torch.bfloat16) for _ in range(3)]
    pool.free(first[0])
    again = pool.allocate(torch.Size([4, 8]), torch.bfloat16)
    stats = pool._stats
    assert (stats["allocation_requests"], stats["free_requests"]) == (4, 1)
    assert (stats["pool_hits"], stats["pool_misses"], stats["current_in_use"]) == (1, 3, 3)
    with pytest.raises(ValueError, match="did not lend"):
        pool.free(torch.empty(4, 8, dtype=torch.bfloat16))
    pool.free(again)
    with pytest.raises(ValueError, match="did not lend"):
        pool.free(again)  # returned already
    pool.reset()  # the step's end: every buffer free again
    assert pool.in_use() == 0 and stats["current_in_use"] == 0 and len(pool._free) == 3


def _step(pool, plan, sizes: list[int]) -> None:
    """One step of ``plan`` drawing buffers of ``sizes`` bytes, returning them at the end."""
    pool.plan = plan
    drawn = [pool.allocate(torch.Size([n]), torch.uint8) for n in sizes]
    for tensor in reversed(drawn):
        pool.free(tensor)
    pool.reset()
    pool.settle()


def test_slabs_are_powers_of_two_packed_largest_buffer_first():
    sizes = [3 * 2**20, 5 * 2**20, 2**20, 12 * 2**20, 2**20]
    slabs = owned.pack_slabs(sizes)
    assert all(capacity & (capacity - 1) == 0 for capacity, _ in slabs)
    placed = sorted(size for _, buffers in slabs for _, size in buffers)
    assert placed == sorted(sizes)
    for capacity, buffers in slabs:  # no buffer overlaps another or leaves its slab
        ends = [(offset, offset + size) for offset, size in sorted(buffers)]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))
        assert ends[-1][1] <= capacity
    assert sum(capacity for capacity, _ in slabs) == 24 * 2**20  # 22 MiB: 16 + 8


def test_the_pool_rebuilds_to_the_largest_plan_when_smaller_ones_came_first():
    pool = _pool()
    mib = 2**20
    for plan, scale in (("short", 1), ("medium", 2), ("long", 4)):
        _step(pool, plan, [scale * mib, 3 * scale * mib, scale * mib])
    need = pool.largest_need()
    assert need == 20 * mib and pool.pinned_bytes() <= owned.POOL_SLACK * need
    held = pool.pinned_bytes()
    for plan, scale in (("short", 1), ("medium", 2), ("long", 4)):  # all fit: no new buffer
        _step(pool, plan, [scale * mib, 3 * scale * mib, scale * mib])
        assert pool.pinned_bytes() == held and not pool.grew


def test_graph_reserved_buffers_stay_until_their_plan_is_released(monkeypatch):
    pool = _pool()
    mib = 2**20
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _step(pool, "graphed", [mib, mib])  # drawn under capture: reserved for the plan
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    captured = set(pool.reserved_by_plan["graphed"])
    # Hold the captured buffers, as a captured graph holds their memory: a freed buffer's
    # address could otherwise come back for a new one and the address checks below would lie.
    held = [pool._buffers[address] for address in captured]
    _step(pool, "eager", [8 * mib])
    pool.release("eager")
    assert captured <= set(pool._buffers) and pool.pinned_bytes() == 2 * mib
    _step(pool, "eager", [8 * mib, 8 * mib])  # over the slack: rebuilt, the graph's kept
    assert captured <= set(pool._buffers)
    pool.release("graphed")  # no longer reserved: the pool keeps what "eager" needs
    assert not pool.reserved_by_plan and not captured & set(pool._buffers)
    assert not any(b is kept for b in held for kept in pool._buffers.values())
    assert pool.pinned_bytes() == 16 * mib


def test_release_keeps_what_the_other_plans_need():
    pool = _pool()
    mib = 2**20
    _step(pool, "a", [mib])
    _step(pool, "b", [4 * mib])
    _step(pool, "a", [mib])  # draws the 4 MiB buffer (best fit) ...
    assert pool.pinned_bytes() == 5 * mib  # ... the 1 MiB one stays (within the slack)
    pool.release("b")  # what a's recorded step needs: one buffer of its own class
    assert pool.pinned_bytes() == mib and pool.need_by_plan == {"a": mib}
    pool.release("a")
    assert pool.pinned_bytes() == 0


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
def test_the_lean_offload_check_answers_as_megatrons(tensor):
    chunk = _bare(owned.OwnedChunkHandler, choices=DENSE, min_offloaded_tensor_size=5)
    megatron = fgo.ChunkOffloadHandler.tensor_need_offloading_checker
    assert chunk.tensor_need_offloading_checker(tensor) is megatron(chunk, tensor)


def test_copy_timer_reuses_the_events_it_has_read():
    timer = owned.CopyTimer()
    start, end = _Event(0), _Event(5)
    timer.record("d2h", start, end, 10)
    timer.collect()
    assert {timer.event(), timer.event()} == {start, end}


# --- fingerprints ----------------------------------------------------------------------------


def test_the_installed_megatron_core_is_the_one_the_overrides_were_checked_against():
    """Fails when megatron-core's offload code changed: read the named functions' new source,
    update the overrides that stand in for or rely on them, then their FINGERPRINTS digests."""
    installed = owned.installed_fingerprints()
    changed = {
        entry.name: (entry.digest, installed[entry.name])
        for entry in owned.FINGERPRINTS
        if installed[entry.name] != entry.digest
    }
    assert not changed, f"(checked, installed) digests: {changed}"


def test_every_override_is_fingerprinted_with_its_reason_and_removal():
    names = [entry.name for entry in owned.FINGERPRINTS]
    assert len(names) == len(set(names))
    for entry in owned.FINGERPRINTS:
        assert entry.stands_in_for and entry.remove_when, entry.name
    pairs = (
        (owned.OwnedChunkHandler, fgo.ChunkOffloadHandler),
        (owned.OwnedOffloadManager, fgo.PipelineOffloadManager),
        (owned.OwnedHostPool, fgo.OffloadTensorPool),
    )
    for ours, megatrons in pairs:
        for name, member in vars(ours).items():
            if not inspect.isfunction(member) or not hasattr(megatrons, name):
                continue
            qualified = f"{megatrons.__name__}.{name}"
            assert qualified in names, f"{qualified} is overridden but not fingerprinted"
            if name == "__init__":  # Megatron's constructor runs first, then ours adds fields
                continue
            doc = inspect.getdoc(member) or ""
            assert "remove when" in doc.lower() and "stands in for" in doc.lower(), qualified


@pytest.fixture
def fresh_check():
    owned._checked.cache_clear()
    yield
    owned._checked.cache_clear()


def test_a_changed_megatron_function_refuses_offloading_with_one_line(monkeypatch, fresh_check):
    from nemo_rl_offload.offload.runtime import OffloadRuntime

    source = owned._source

    def changed(obj):
        text = source(obj)
        if obj is fgo.ChunkOffloadHandler.tensor_pop:
            text = text.replace("return tensor\n", "return tensor.clone()\n")
        return text

    monkeypatch.setattr(owned, "_source", changed)
    assert owned.changed_megatron_code() == ["ChunkOffloadHandler.tensor_pop"]
    with pytest.raises(UserInputError) as raised:
        owned.require_checked_megatron()
    (line,) = raised.value.problems
    assert line.startswith("megatron-core's ChunkOffloadHandler.tensor_pop changed since")
    assert f"pin megatron-core=={owned.CHECKED_MEGATRON_VERSION}" in line
    assert "nemo_rl_offload/offload/owned.py" in line
    config = SimpleNamespace(fine_grained_activation_offloading=True)
    with pytest.raises(UserInputError):
        OffloadRuntime(config)
    OffloadRuntime(SimpleNamespace(fine_grained_activation_offloading=False))  # off: no check


def test_a_missing_megatron_function_counts_as_changed(monkeypatch, fresh_check):
    source = owned._source

    def missing(obj):
        if obj is fgo._te_do_not_offload:
            raise OSError("could not get source code")
        return source(obj)

    monkeypatch.setattr(owned, "_source", missing)
    assert owned.changed_megatron_code() == ["_te_do_not_offload"]
    assert owned.installed_fingerprints()["_te_do_not_offload"] is None


def test_fingerprints_ignore_formatting_comments_docstrings_and_debug_messages(monkeypatch):
    monkeypatch.setattr(owned, "_source", lambda text: text)
    plain = "def f(self, x):\n    if x:\n        return self.g(x, 1)\n    return None\n"
    noisy = (
        '    def f(self,\n          x):  # a comment\n        """Doc."""\n'
        '        debug_rank(f"f {x}")\n        if x:\n'
        "            return self.g(\n                x, 1\n            )\n"
        "        return None\n"
    )
    assert owned.fingerprint(plain) == owned.fingerprint(noisy)
    assert owned.fingerprint(plain) != owned.fingerprint(plain.replace("1)", "2)"))
    only_debug = "def f():\n    debug_rank('x')\n"
    assert owned.fingerprint(only_debug) == owned.fingerprint("def f():\n    pass\n")


def test_a_modules_own_fraction_spreads_only_its_groups(printed):
    """``fraction_by_module``: attn_proj offloads half of its groups (evenly spaced), core_attn
    keeps the plan's fraction of 1 (all but Megatron's last group)."""
    choices = owned.PlanChoices(
        fraction_placement="spread", fraction_by_module=(("attn_proj", 0.5),)
    )
    manager, chunk = _warmed_up_manager(choices, 1.0)
    manager.post_warmup_callback()
    by_name: dict[str, list[bool]] = {}
    for group in chunk.offload_groups:
        by_name.setdefault(group._name, []).append(group.offload)
    assert by_name == {
        "core_attn": [True, True, True, True, False],
        "attn_proj": [True, False, True, False, False],
    }
    assert printed == [{"core_attn": 400, "attn_proj": 200}]


def test_a_modules_own_fraction_needs_the_spread_placement():
    with pytest.raises(ValueError, match="spread"):
        owned.PlanChoices(fraction_placement="earliest", fraction_by_module=(("attn_proj", 0.5),))


# --- the lean forward hooks answer as Megatron's ----------------------------------------------

LAYER = ("attn_norm", "core_attn", "attn_proj", "mlp_norm")


def _forward_chunk(lean: bool, warmup: bool, names: tuple[str, ...] = ()) -> Any:
    """A handler as the forward hooks find it at a micro-batch's start (``names``: the groups
    its warm-up step recorded)."""
    return _bare(
        owned.OwnedChunkHandler,
        choices=owned.PlanChoices(lean_hooks=lean),
        do_offload=True,
        is_warmup=warmup,
        offload_groups=[fgo.OffloadTensorGroup(name) for name in names],
        _offloaded_group_index=0,
        _groups_to_offload=[],
        _groups_to_reload=[],
        _tensor_count_current_group=0,
        _max_group_size=0,
    )


def _start_state(chunk: Any) -> tuple:
    return (
        chunk._offloaded_group_index,
        chunk._max_group_size,
        chunk._tensor_count_current_group,
        [group._name for group in chunk.offload_groups],
        [chunk.offload_groups.index(group) for group in chunk._groups_to_offload],
    )


@pytest.mark.parametrize(
    ("warmup", "recorded", "started"),
    [
        (True, (), LAYER * 2),  # the warm-up step records a group per start
        (False, LAYER * 2, LAYER * 2),  # a replayed step finds each at the next index
        # a replayed step whose next group of a name lies further on (a group of the plan
        # whose module did not run this time): Megatron's scan skips to it
        (False, LAYER * 2, ("attn_norm", "mlp_norm", "core_attn")),
    ],
)
def test_the_lean_group_start_keeps_megatrons_books(warmup, recorded, started):
    lean, megatron = (_forward_chunk(flag, warmup, recorded) for flag in (True, False))
    for name in started:
        lean.on_group_start_forward(name)
        fgo.ChunkOffloadHandler.on_group_start_forward(megatron, name)
        assert _start_state(lean) == _start_state(megatron)
        lean._tensor_count_current_group = megatron._tensor_count_current_group = 3


def _chunk_at(index: int, pending: int, reloading: int) -> Any:
    chunk = _forward_chunk(True, False, LAYER * 2)
    chunk._offloaded_group_index = index
    chunk._groups_to_offload = chunk.offload_groups[:pending]
    chunk._groups_to_reload = chunk.offload_groups[:reloading]
    return chunk


@pytest.mark.parametrize("name", ["attn_norm", "mlp_norm", "router"])
@pytest.mark.parametrize(
    ("index", "pending", "reloading"), [(0, 0, 0), (3, 1, 0), (5, 0, 2), (8, 0, 0), (8, 1, 0)]
)
def test_a_chunk_is_finished_when_megatrons_says_so(name, index, pending, reloading):
    chunk = _chunk_at(index, pending, reloading)
    assert owned._finished(chunk, name) is fgo.ChunkOffloadHandler.finish_all_groups(chunk, name)


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize(("warmup", "current"), [(True, 0), (False, None), (False, 0), (False, 1)])
def test_the_lean_forward_chunk_is_megatrons_choice(lean, warmup, current):
    """The forward's next chunk: the current one while it has groups of the name left, else
    the next cached one that has (none past the last)."""
    chunks = [_chunk_at(8, 0, 0), _chunk_at(2, 0, 0), _chunk_at(0, 0, 0)]

    def manager() -> Any:
        return _bare(
            owned.OwnedOffloadManager,
            choices=owned.PlanChoices(lean_hooks=lean),
            do_offload=True,
            _is_warmup=warmup,
            _cur_forward_chunk=None if current is None else chunks[current],
            _cached_chunks_forward=chunks,
            _cached_chunks_index_forward=1 if current is not None else 0,
        )

    ours, megatrons = manager(), manager()
    for name in ("attn_norm", "mlp_norm", "attn_norm"):
        got = ours.pop_forward_chunk(name)
        expected = fgo.PipelineOffloadManager.pop_forward_chunk(megatrons, name)
        assert got is expected and ours._cached_chunks_index_forward == (
            megatrons._cached_chunks_index_forward
        )


@pytest.fixture
def lean_cpu(monkeypatch):
    """The lean commit on CPU: no capture, the stream calls as no-ops, CPU tensors offloadable."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        owned, "_STREAMS", SimpleNamespace(use=lambda s: None, current=lambda: "compute")
    )
    streams: list = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: streams.append(s))
    monkeypatch.setattr(
        owned.OwnedChunkHandler, "tensor_need_offloading_checker", lambda self, t: t.numel() > 1
    )
    return streams


@pytest.mark.parametrize("offloads", [True, False])
def test_the_lean_commit_offloads_the_named_group_and_releases_what_it_is_given(
    monkeypatch, lean_cpu, offloads
):
    chunk = _forward_chunk(True, True, ("attn_norm", "core_attn", "core_attn"))
    chunk._groups_to_offload = list(chunk.offload_groups)
    copied: list = []
    monkeypatch.setattr(owned.OwnedChunkHandler, "_lean_bulk_offload_group", copied.append)
    monkeypatch.setattr(owned.OwnedChunkHandler, "should_bulk_offload", lambda self, g: offloads)
    released, kept = torch.ones(4), torch.ones(1)
    chunk._lean_bulk_offload("core_attn", [released, kept])
    first_core_attn = chunk.offload_groups[1]  # Megatron's choice among pending groups of a name
    assert first_core_attn not in chunk._groups_to_offload and len(chunk._groups_to_offload) == 2
    if offloads:
        assert copied == [first_core_attn] and chunk._groups_to_reload == [first_core_attn]
        assert released.untyped_storage().nbytes() == 0 and lean_cpu == ["compute"]
        assert kept.untyped_storage().nbytes() == kept.element_size()  # too small to offload
    else:  # the group stays on the GPU: nothing copied or released, the commit consumed
        assert not copied and not chunk._groups_to_reload and not lean_cpu
        assert released.untyped_storage().nbytes() == 4 * released.element_size()


def test_the_pool_lends_one_view_per_buffer_and_request_across_steps():
    pool = _pool()
    shape = torch.Size([64, 8])
    first = pool.allocate(shape, torch.bfloat16)
    pool.free(first)
    pool.reset()
    again = pool.allocate(shape, torch.bfloat16)
    assert again is first  # the next step's draw: the same view, not a new one
    other = pool.allocate(torch.Size([512]), torch.bfloat16)  # a new buffer: its own view
    assert other is not first and other.shape == (512,)
    pool.free(again)
    pool.free(other)
    pool.clear()
    assert not pool._views  # no view outlives its buffer
    fresh = pool.allocate(shape, torch.bfloat16)
    assert fresh is not first and fresh.shape == shape
