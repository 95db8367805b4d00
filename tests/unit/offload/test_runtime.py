"""The offload runtime's bookkeeping, on stand-ins for Megatron's manager (it needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nemo_rl_offload.offload import runtime


def _group(name: str, nbytes: int, offload: bool = True) -> SimpleNamespace:
    return SimpleNamespace(_name=name, total_offload_bytes=nbytes, offload=offload)


def test_plan_metrics_count_every_microbatch_and_skip_groups_kept_on_gpu():
    chunks = [
        SimpleNamespace(offload_groups=[_group("core_attn", 2**30), _group("attn_proj", 2**29)]),
        SimpleNamespace(
            offload_groups=[_group("core_attn", 2**30), _group("attn_proj", 2**29, offload=False)]
        ),
    ]
    pool = SimpleNamespace(
        _pools={("s", "bf16"): {"all": [torch.empty(2**20, dtype=torch.bfloat16)]}}
    )
    manager = SimpleNamespace(_cached_chunks_forward=chunks, _cpu_tensor_pool=pool)
    metrics = runtime.plan_metrics(manager)
    assert metrics["offloaded_gib_core_attn"] == 2.0
    assert metrics["offloaded_gib_attn_proj"] == 0.5  # the last group stays on the GPU
    assert metrics["offloaded_gib_per_step"] == 2.5
    assert metrics["pinned_host_gib"] == 2 * 2**20 / 2**30


class _FakeManager:
    """Megatron's PipelineOffloadManager as the runtime sees it: a class-level singleton."""

    OFFLOAD_MGR = None
    resets = 0
    pinned_per_plan = 0

    def __init__(self) -> None:
        self.enabled = True
        self._cached_chunks_forward = []
        pool = (
            [torch.empty(self.pinned_per_plan, dtype=torch.uint8)] if self.pinned_per_plan else []
        )
        self._cpu_tensor_pool = SimpleNamespace(_pools={"shape": {"all": pool}})

    @classmethod
    def get_instance(cls):
        if cls.OFFLOAD_MGR is None:
            cls.OFFLOAD_MGR = cls()
        return cls.OFFLOAD_MGR

    @classmethod
    def reset_instance(cls):
        cls.resets += 1
        cls.OFFLOAD_MGR = cls()

    def disable_offload(self):
        self.enabled = False

    def enable_offload(self):
        self.enabled = True


def _runtime(monkeypatch, on: bool = True, budget: int | None = None, pinned: int = 0):
    monkeypatch.setattr(runtime, "_patch_reload_waits_for_offload", lambda: True)
    monkeypatch.setattr(runtime.OffloadRuntime, "_manager", staticmethod(lambda: _FakeManager))
    _FakeManager.OFFLOAD_MGR, _FakeManager.resets, _FakeManager.pinned_per_plan = None, 0, pinned
    config = SimpleNamespace(fine_grained_activation_offloading=on)
    return runtime.OffloadRuntime(config, host_budget_bytes=budget)


def test_one_plan_per_shape_recorded_once_and_reused(monkeypatch):
    rt = _runtime(monkeypatch)
    installed = {}
    for shape in [(4, 1024), (4, 1024), (3, 1024), (3, 2048), (4, 1024), (3, 1024)]:
        rt.before_step(*shape)
        installed.setdefault(shape, _FakeManager.OFFLOAD_MGR)
        assert _FakeManager.OFFLOAD_MGR is installed[shape]  # the shape's own plan, every time
    assert _FakeManager.resets == 3 and rt.plans_recorded == 3
    assert rt.after_step(3)["offload_plans_kept"] == 3.0


def test_budget_releases_least_recently_used_plans(monkeypatch):
    mib = 2**20
    rt = _runtime(monkeypatch, budget=int(2.5 * mib), pinned=mib)
    for shape in [(4, 512), (4, 1024), (4, 512), (4, 2048)]:
        rt.before_step(*shape)
        metrics = rt.after_step(shape[0])
    # Three plans of 1 MiB exceed 2.5 MiB: the least recently used one, (4, 1024), went.
    assert metrics["offload_plans_released"] == 1.0 and metrics["offload_plans_kept"] == 2.0
    assert rt.pinned_bytes() == 2 * mib <= rt.host_budget_bytes
    assert list(rt._plans) == [(4, 512), (4, 2048)]
    rt.before_step(4, 1024)  # released, so recorded again
    assert rt.plans_recorded == 4


def test_budget_never_releases_the_plan_in_use(monkeypatch):
    rt = _runtime(monkeypatch, budget=1, pinned=2**20)
    rt.before_step(2, 64)
    assert rt.after_step(2)["offload_plans_kept"] == 1.0 and rt.plans_released == 0


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
    assert _FakeManager.resets == 0 and _FakeManager.OFFLOAD_MGR is None
    assert rt.after_step(4) == {}


def test_default_budget_is_half_the_ram_at_most():
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < runtime.default_host_budget_bytes() <= ram // 2
