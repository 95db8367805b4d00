"""The offload runtime's bookkeeping, on stand-ins for Megatron's manager (it needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.fake_offload import FakeManager as _FakeManager
from support.fake_offload import fake_plans as _fake_plans

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
    assert metrics["pinned_host_gib"] == 2 * 2**20 / 2**30


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


def test_budget_releases_least_recently_used_plans_and_their_buffers(monkeypatch):
    mib = 2**20
    rt = _runtime(monkeypatch, budget=3 * mib)
    for length in (512, 1024, 512, 2048):  # 0.5 + 1 + 2 MiB of buffers
        metrics = _train(rt, 1, length)
    # 3.5 MiB exceed 3 MiB: the least recently used plan, (1, 1024), went with its buffers.
    assert metrics["offload_plans_released"] == 1.0 and metrics["offload_plans_kept"] == 2.0
    assert rt.pinned_bytes() == int(2.5 * mib) <= rt.host_budget_bytes
    assert list(rt._plans) == [(1, 512), (1, 2048)]
    _train(rt, 1, 1024)  # released, so recorded again
    assert rt.plans_recorded == 4


def test_buffers_another_kept_plan_uses_stay(monkeypatch):
    mib = 2**20
    rt = _runtime(monkeypatch, budget=int(2.5 * mib))
    for count, length in ((1, 1024), (4, 1024), (1, 2048)):  # 1 (shared) + 2 MiB
        metrics = _train(rt, count, length)
    # Releasing (1, 1024) alone frees nothing ((4, 1024) uses its buffers), so both go.
    assert metrics["offload_plans_released"] == 2.0
    assert list(rt._plans) == [(1, 2048)] and rt.pinned_bytes() == 2 * mib


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
    assert runtime.sequence_length_buckets(4096) == [
        32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096
    ]  # fmt: skip
    # Rounded to the padding multiple, without duplicates; the longest length closes the list.
    assert runtime.sequence_length_buckets(3000, 64) == [
        64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3008
    ]  # fmt: skip
    assert runtime.sequence_length_buckets(40) == [32, 40]


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
    assert runtime.step_buckets(section) == (runtime.sequence_length_buckets(3000, 64), True)
    section["megatron_cfg"] = {"offload_sequence_length_buckets": [1024, 3072]}
    assert runtime.step_buckets(section) == ([1024, 3072], False)


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
        drop_and_pad, fraction_placement="earliest", strided_copies=False, lean_hooks=False
    )
    for length in (256, 512):
        rt.before_step(1, length)
        choices = _FakeManager.OFFLOAD_MGR.choices
        assert choices is rt.choices
        assert choices.fraction_placement == "earliest" and choices.strided_copies is False
        assert choices.lean_hooks is False and choices.pool_expert_groups is True
        assert choices.reload_waits_for_offload is True  # Megatron-LM 7398, always
        assert isinstance(choices.copy_timer, owned.CopyTimer)
    assert _FakeManager.OFFLOAD_MGR.cpu_tensor_pool.lean is False
    unset = runtime.OffloadRuntime(config, fraction_placement=None)  # the recipe left it out
    unset.before_step(1, 1024)
    choices = _FakeManager.OFFLOAD_MGR.choices
    assert choices.fraction_placement == runtime.DEFAULT_FRACTION_PLACEMENT
    assert choices.lean_hooks is True  # the default
    assert choices.pool_expert_groups is False  # routed shapes: Megatron's
