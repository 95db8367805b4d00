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
    instance = None
    resets = 0

    def __init__(self) -> None:
        self.enabled = True
        self._cached_chunks_forward = []

    @classmethod
    def get_instance(cls):
        if cls.instance is None:
            cls.instance = cls()
        return cls.instance

    @classmethod
    def reset_instance(cls):
        cls.resets += 1
        cls.instance = cls()

    def disable_offload(self):
        self.enabled = False

    def enable_offload(self):
        self.enabled = True


def _runtime(monkeypatch, on: bool = True) -> runtime.OffloadRuntime:
    monkeypatch.setattr(runtime, "_patch_reload_waits_for_offload", lambda: True)
    monkeypatch.setattr(runtime.OffloadRuntime, "_manager", staticmethod(lambda: _FakeManager))
    _FakeManager.instance, _FakeManager.resets = None, 0
    return runtime.OffloadRuntime(SimpleNamespace(fine_grained_activation_offloading=on))


def test_new_plan_only_when_the_microbatch_count_changes(monkeypatch):
    rt = _runtime(monkeypatch)
    for count in (4, 4, 3, 3, 6, 4, 4):
        rt.before_step(count)
    assert _FakeManager.resets == 4 and rt.plans_recorded == 4


def test_forward_only_suspends_and_restores_offloading(monkeypatch):
    rt = _runtime(monkeypatch)
    manager = _FakeManager.get_instance()
    with rt.forward_only():
        assert rt.config.fine_grained_activation_offloading is False
        assert manager.enabled is False
    assert rt.config.fine_grained_activation_offloading is True and manager.enabled is True


def test_off_runtime_touches_nothing(monkeypatch):
    rt = _runtime(monkeypatch, on=False)
    rt.before_step(4)
    with rt.forward_only():
        pass
    assert _FakeManager.resets == 0 and _FakeManager.instance is None
    assert rt.after_step(4) == {}
