"""The offload runtime's bookkeeping, on stand-ins for Megatron's manager (it needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.fake_offload import FakeManager as _FakeManager
from support.fake_offload import fake_plans as _fake_plans

from nemo_rl_offload.config import batching_settings, megatron_settings
from nemo_rl_offload.offload import owned, runtime


def _group(name: str, nbytes: int, offload: bool = True) -> SimpleNamespace:
    return SimpleNamespace(_name=name, total_offload_bytes=nbytes, offload=offload)


def test_plan_metrics_count_every_microbatch_and_skip_groups_kept_on_gpu():
    chunks = [
        SimpleNamespace(offload_groups=[_group("core_attn", 2**30), _group("attn_proj", 2**29)]),
        SimpleNamespace(
            offload_groups=[_group("core_attn", 2**30), _group("attn_proj", 2**29, offload=False)]
        ),
    ]
    pool = owned.OwnedHostPool(device="cpu", pin_memory=False)
    pool.allocate(torch.Size([2**20]), dtype=torch.bfloat16)
    manager = SimpleNamespace(_cached_chunks_forward=chunks, cpu_tensor_pool=pool)
    metrics = runtime.plan_metrics(manager)
    assert metrics["offloaded_gib_core_attn"] == 2.0
    assert metrics["offloaded_gib_attn_proj"] == 0.5  # the last group stays on the GPU
    assert metrics["offloaded_gib_per_step"] == 2.5
    assert metrics["pinned_host_gib"] == metrics["offload_pool_gib"] == 2 * 2**20 / 2**30
    assert metrics["largest_plan_need_gib"] == 2 * 2**20 / 2**30
    assert metrics["pinned_over_need"] == 1.0


def _runtime(
    monkeypatch,
    on: bool = True,
    budget: int | None = None,
    buckets: tuple[int, ...] = (),
):
    _fake_plans(monkeypatch)
    config = SimpleNamespace(fine_grained_activation_offloading=on)
    return runtime.OffloadRuntime(config, host_budget_bytes=budget, sequence_buckets=buckets)


KIB = 2**10


def _train(rt, count: int, length: int) -> dict:
    """One step as Megatron's manager runs it: its offloads draw pinned buffers whose shape
    follows the length (one micro-batch at a time: the count does not add buffers), which the
    manager's reset at the end of the step makes free again."""
    rt.before_step(count, length)
    pool = _FakeManager.OFFLOAD_MGR.cpu_tensor_pool
    pool.allocate(torch.Size([length, KIB]), dtype=torch.uint8)
    pool.reset()
    return rt.after_step()


def test_one_plan_per_shape_recorded_once_and_reused(monkeypatch):
    rt = _runtime(monkeypatch)
    installed = {}
    for shape in [(4, 1024), (4, 1024), (3, 1024), (3, 2048), (4, 1024), (3, 1024)]:
        rt.before_step(*shape)
        installed.setdefault(shape, _FakeManager.OFFLOAD_MGR)
        assert _FakeManager.OFFLOAD_MGR is installed[shape]  # the shape's own plan, every time
    assert _FakeManager.made == 3 and rt.plans_recorded == 3
    assert rt.after_step()["offload_plans_kept"] == 3.0


def test_plans_of_one_length_share_their_pinned_buffers(monkeypatch):
    rt = _runtime(monkeypatch)
    for count in (1, 4, 2, 4):
        metrics = _train(rt, count, 512)
    assert rt.plans_recorded == 3
    assert rt.pinned_bytes() == 512 * KIB  # one set of buffers for the three plans
    assert metrics["pinned_host_gib"] == 512 * KIB / 2**30
    pools = {id(manager.cpu_tensor_pool) for manager in rt._plans.values()}
    assert len(pools) == 1


def test_smaller_shapes_run_in_the_buffers_of_larger_ones(monkeypatch):
    mib = 2**20
    rt = _runtime(monkeypatch)
    for length in (512, 1024, 512, 2048, 1024):
        metrics = _train(rt, 1, length)
    # After each longer step the pool rebuilt itself to its one buffer; shorter steps use it.
    assert rt.pinned_bytes() == 2 * mib and rt.plans_recorded == 3
    assert metrics["offload_pool_gib"] == 2 / 1024 and metrics["largest_plan_need_gib"] == 2 / 1024
    assert metrics["plan_need_gib"] == 1 / 1024 and metrics["pinned_over_need"] == 1.0


def test_budget_releases_least_recently_used_plans_and_what_only_they_need(monkeypatch):
    mib = 2**20
    rt = _runtime(monkeypatch, budget=int(1.5 * mib))
    for count, length in ((1, 2048), (1, 1024), (4, 1024)):  # 2 MiB, then within them
        metrics = _train(rt, count, length)
    # 2 MiB exceed 1.5 MiB: the least recently used plan, (1, 2048), went; the pool keeps
    # what the two kept plans' steps need, one 1 MiB buffer.
    assert metrics["offload_plans_released"] == 1.0 and metrics["offload_plans_kept"] == 2.0
    assert list(rt._plans) == [(1, 1024), (4, 1024)] and rt.pinned_bytes() == mib
    _train(rt, 1, 2048)  # released, so recorded again
    assert rt.plans_recorded == 4


LAYERS = 4
# Bytes per token of the tensors one layer offloads (query/key/value, attention output,
# projection, MLP input): distinct sizes, as a transformer layer's are.
PER_TOKEN = (3 * 96, 96, 96, 4 * 96)


def _transformer_step(rt, count: int, length: int, *, all_forward_first: bool) -> dict:
    """A step's draws as Megatron's manager makes them: every layer but the last offloads its
    tensors in the forward pass, and the backward reloads them in reverse order, returning the
    buffers; micro-batch by micro-batch (``all_forward_first`` False, 1F1B without pipeline
    stages) or every forward pass first (a schedule where all micro-batches are in flight).
    Checks that no buffer is lent to two live tensors at once."""
    rt.before_step(count, length)
    pool = _FakeManager.OFFLOAD_MGR.cpu_tensor_pool
    live: dict[int, int] = {}  # address: end

    def forward() -> list[torch.Tensor]:
        drawn = []
        for _ in range(LAYERS - 1):
            for per_token in PER_TOKEN:
                tensor = pool.allocate(torch.Size([length, per_token // 2]), torch.bfloat16)
                start, end = tensor.data_ptr(), tensor.data_ptr() + length * per_token
                assert all(end <= s or start >= e for s, e in live.items()), "lent twice"
                live[start] = end
                drawn.append(tensor)
        return drawn

    def backward(drawn: list[torch.Tensor]) -> None:
        for tensor in reversed(drawn):
            del live[tensor.data_ptr()]
            pool.free(tensor)

    if all_forward_first:
        for drawn in [forward() for _ in range(count)][::-1]:
            backward(drawn)
    else:
        for _ in range(count):
            backward(forward())
    pool.reset()
    return rt.after_step()


def _need(count: int, length: int, all_forward_first: bool) -> int:
    return (count if all_forward_first else 1) * (LAYERS - 1) * length * sum(PER_TOKEN)


COUNTS = (1, 2, 4)
LENGTHS = (192, 256, 384, 512, 768, 1024, 1536, 2048)


@pytest.mark.parametrize("all_forward_first", [False, True])
@pytest.mark.parametrize("order", ["shuffled", "shortest_first"])
def test_many_shapes_pin_at_most_a_quarter_above_the_largest_plans_need(
    monkeypatch, all_forward_first, order
):
    """Three micro-batch counts by eight lengths, a hundred steps: the pool's pinned bytes stay
    within POOL_SLACK of the largest plan's need after every step where the plans' buffers
    nest: one micro-batch in flight at a time, or, with every micro-batch in flight, once the
    largest shape (most micro-batches, longest) ran. Megatron's pool, keyed by exact shape,
    pins one set of buffers per length or shape
    (:func:`test_megatrons_exact_shape_pool_pins_the_sum_over_lengths`)."""
    rt = _runtime(monkeypatch)
    shapes = [(count, length) for count in COUNTS for length in LENGTHS]
    if order == "shortest_first":
        schedule = sorted(shapes, key=lambda shape: (shape[1], shape[0])) * 4
    else:
        schedule = (shapes * 5)[:100]
        np.random.default_rng(7).shuffle(schedule)
    seen: set[tuple[int, int]] = set()
    for count, length in schedule:
        metrics = _transformer_step(rt, count, length, all_forward_first=all_forward_first)
        seen.add((count, length))
        need = max(_need(c, n, all_forward_first) for c, n in seen)
        assert rt._pool.largest_need() == need
        ratio = rt.pinned_bytes() / need
        assert metrics["pinned_over_need"] == ratio
        if not all_forward_first or (max(COUNTS), max(LENGTHS)) in seen:
            assert ratio <= owned.POOL_SLACK, (count, length)
        else:  # a plan of more, shorter micro-batches does not fit in one of fewer, longer
            assert ratio <= 2, (count, length)
    assert rt.plans_recorded == len(shapes) and rt.plans_released == 0
    # Once every shape was seen, the pool holds still: no buffer made or dropped.
    held = dict(rt._pool._buffers)
    for count, length in schedule[:30]:
        _transformer_step(rt, count, length, all_forward_first=all_forward_first)
    assert rt._pool._buffers == held


def test_megatrons_exact_shape_pool_pins_the_sum_over_lengths():
    """What the shared pool fixes: Megatron's pool, given the same draws, keeps a set of
    buffers per distinct shape, far above one plan's need."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    pool = fgo.OffloadTensorPool(device="cpu", pin_memory=False)
    for length in LENGTHS:
        drawn = [
            pool.allocate(torch.Size([length, per_token // 2]), torch.bfloat16)
            for _ in range(LAYERS - 1)
            for per_token in PER_TOKEN
        ]
        for tensor in drawn:
            pool.free(tensor)
        pool.reset()
    pinned = sum(t.numel() * t.element_size() for e in pool._pools.values() for t in e["all"])
    assert pinned > 2 * _need(1, max(LENGTHS), all_forward_first=False)


def test_budget_never_releases_the_plan_in_use(monkeypatch):
    rt = _runtime(monkeypatch, budget=1)
    metrics = _train(rt, 2, 64)
    assert metrics["offload_plans_kept"] == 1.0 and rt.plans_released == 0


def test_forward_only_suspends_and_restores_offloading(monkeypatch):
    rt = _runtime(monkeypatch)
    rt.before_step(2, 64)
    manager = _FakeManager.get_instance()
    with rt.forward_only():
        assert rt.config.fine_grained_activation_offloading is False
        assert manager.enabled is False
    assert rt.config.fine_grained_activation_offloading is True and manager.enabled is True


def test_off_runtime_touches_nothing(monkeypatch):
    rt = _runtime(monkeypatch, on=False)
    rt.before_step(4, 128)
    with rt.forward_only():
        pass
    assert _FakeManager.made == 0 and _FakeManager.OFFLOAD_MGR is None
    assert rt.after_step() == {}


def test_default_budget_is_half_the_ram_at_most():
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < runtime.default_host_budget_bytes() <= ram // 2


def test_default_buckets_are_powers_of_two_and_midpoints_up_to_the_longest():
    assert batching_settings.sequence_length_buckets(4096) == [
        32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096
    ]  # fmt: skip
    # Rounded to the padding multiple, without duplicates; the longest length closes the list.
    assert batching_settings.sequence_length_buckets(3000, 64) == [
        64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3008
    ]  # fmt: skip
    assert batching_settings.sequence_length_buckets(40) == [32, 40]


@pytest.mark.parametrize(
    "length,expected", [(1, 512), (512, 512), (513, 1024), (4096, 4096), (5000, 5000)]
)
def test_bucket_for_picks_the_smallest_that_holds_the_length(length, expected):
    assert runtime.bucket_for(length, [512, 1024, 4096]) == expected


def test_padding_reaches_every_per_token_array_and_leaves_the_rest():
    batch = {
        "input_ids": np.ones((2, 5), np.int64),
        "loss_mask": np.ones((2, 5), np.float32),
        "teacher_topk": np.ones((2, 5, 3), np.float32),
        "advantages": np.ones(2, np.float32),
    }
    (padded,) = runtime.pad_microbatches([batch], 8)
    assert padded["input_ids"].shape == (2, 8) and padded["input_ids"][:, 5:].sum() == 0
    assert padded["loss_mask"][:, :5].all() and not padded["loss_mask"][:, 5:].any()
    assert padded["teacher_topk"].shape == (2, 8, 3)
    assert padded["advantages"].shape == (2,)
    assert padded["input_ids"].dtype == np.int64
    assert batch["input_ids"].shape == (2, 5)  # the caller's arrays are left alone


def _step(rows_lengths: list[int]) -> list[dict]:
    return [
        {"input_ids": np.ones((2, n), np.int64), "loss_mask": np.ones((2, n), np.float32)}
        for n in rows_lengths
    ]


def test_prepare_step_pads_a_step_to_one_bucket_and_keys_plans_by_it(monkeypatch):
    rt = _runtime(monkeypatch, buckets=(256, 512, 1024))
    shapes = []
    for lengths in ([100, 250], [300, 200, 17], [256, 256], [1000], [511, 3, 40]):
        step = rt.prepare_step(_step(lengths))
        assert len({batch["input_ids"].shape[1] for batch in step}) == 1
        shapes.append(rt.step_shape)
    assert shapes == [(2, 256), (3, 512), (2, 256), (1, 1024), (3, 512)]
    assert rt.plans_recorded == 3  # five steps, three shapes


def test_prepare_step_is_a_no_op_without_offloading(monkeypatch):
    rt = _runtime(monkeypatch, on=False, buckets=(256,))
    step = _step([100, 7])
    assert rt.prepare_step(step) is step


def test_step_buckets_come_from_the_recipe_or_its_length():
    section = {"max_total_sequence_length": 3000, "make_sequence_length_divisible_by": 64}
    assert batching_settings.step_buckets(section) == (
        batching_settings.sequence_length_buckets(3000, 64),
        True,
    )
    section["megatron_cfg"] = {"offload_sequence_length_buckets": [1024, 3072]}
    assert batching_settings.step_buckets(section) == ([1024, 3072], False)


def test_pad_steps_pads_without_offloading_and_records_no_plan(monkeypatch):
    """CUDA graphs need recurring shapes even without offloading: steps are padded, no plan."""
    monkeypatch.setattr(runtime.OffloadRuntime, "_manager", staticmethod(lambda: _FakeManager))
    config = SimpleNamespace(fine_grained_activation_offloading=False)
    rt = runtime.OffloadRuntime(config, sequence_buckets=(256, 512), graphed=True)
    step = rt.prepare_step(_step([100, 300]))
    assert {batch["input_ids"].shape[1] for batch in step} == {512}
    assert rt.step_shape == (2, 512) and rt.plans_recorded == 0
    assert rt.after_step() == {}


def test_sync_length_agrees_the_padded_length_with_other_ranks(monkeypatch):
    rt = _runtime(monkeypatch, buckets=(256, 512, 1024))
    asked = []

    def longest_over_ranks(length: int) -> int:
        asked.append(length)
        return 1024  # another rank's step is longer

    step = rt.prepare_step(_step([100, 200]), sync_length=longest_over_ranks)
    assert asked == [256]
    assert {batch["input_ids"].shape[1] for batch in step} == {1024}
    assert rt.step_shape == (2, 1024)


def test_released_plans_are_reported_to_on_release(monkeypatch):
    released = []
    rt = _runtime(monkeypatch, budget=600 * KIB)
    rt.on_release = released.append
    for length in (256, 512, 1024):
        _train(rt, 1, length)
    assert released == [(1, 256), (1, 512)]  # oldest first; the plan in use stays
    assert rt.plans_released == 2


def test_untimed_steps_leave_copy_metrics_out(monkeypatch):
    rt = _runtime(monkeypatch)
    rt.before_step(1, 256)
    _FakeManager.OFFLOAD_MGR.cpu_tensor_pool.allocate(torch.Size([256, KIB]), dtype=torch.uint8)
    assert "d2h_time_s" in rt.after_step()
    assert not any(key.startswith(("d2h", "h2d")) for key in rt.after_step(copies_timed=False))


def test_every_plan_carries_the_runtimes_copy_and_fraction_choices(monkeypatch):
    _fake_plans(monkeypatch)
    config = SimpleNamespace(fine_grained_activation_offloading=True)
    drop_and_pad = SimpleNamespace(**vars(config), moe_pad_expert_input_to_capacity=True)
    rt = runtime.OffloadRuntime(
        drop_and_pad,
        choices=megatron_settings.RuntimeChoices(
            fraction_placement="earliest",
            strided_copies=False,
            pool_expert_groups=True,
            lean_hooks=False,
        ),
    )
    for length in (256, 512):
        rt.before_step(1, length)
        choices = _FakeManager.OFFLOAD_MGR.choices
        assert choices is rt.choices
        assert choices.fraction_placement == "earliest" and choices.strided_copies is False
        assert choices.lean_hooks is False and choices.pool_expert_groups is True
        assert choices.reload_waits_for_offload is True  # Megatron-LM 7398, always
        assert isinstance(choices.copy_timer, owned.CopyTimer)
    unset = runtime.OffloadRuntime(config)  # the defaults
    unset.before_step(1, 1024)
    choices = _FakeManager.OFFLOAD_MGR.choices
    assert choices.fraction_placement == megatron_settings.DEFAULT_FRACTION_PLACEMENT
    assert choices.lean_hooks is True  # the default
    assert choices.pool_expert_groups is False  # routed shapes: Megatron's
