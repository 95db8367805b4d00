"""The offload runtime's plans on CPU: Megatron's manager needs CUDA streams, so tests install
a stand-in manager class that shares the runtime's real (unpinned) host pool."""

from __future__ import annotations

from nemo_rl_offload.offload import owned, runtime


class FakeManager:
    """The runtime's OwnedOffloadManager as the runtime sees it (Megatron's constructor needs
    CUDA streams), installed in a class-level singleton as in Megatron's manager class."""

    OFFLOAD_MGR = None
    made = 0

    def __init__(self, choices=None, pool=None) -> None:
        type(self).made += 1
        self.enabled = True
        self.choices = choices
        self._cached_chunks_forward = []
        self.cpu_tensor_pool = pool

    @classmethod
    def get_instance(cls):
        if cls.OFFLOAD_MGR is None:
            cls.OFFLOAD_MGR = cls()
        return cls.OFFLOAD_MGR

    def disable_offload(self):
        self.enabled = False

    def enable_offload(self):
        self.enabled = True


def fake_plans(monkeypatch) -> None:
    """Plans made as the runtime makes them, of :class:`FakeManager`, sharing the runtime's
    own pool (unpinned: there is no GPU)."""
    monkeypatch.setattr(runtime.OffloadRuntime, "_manager", staticmethod(lambda: FakeManager))
    monkeypatch.setattr(
        runtime.OffloadRuntime, "_new_manager", lambda rt: FakeManager(rt.choices, rt._pool)
    )
    monkeypatch.setattr(
        runtime.OffloadRuntime,
        "_new_pool",
        lambda rt: owned.OwnedHostPool(device="cpu", pin_memory=False),
    )
    FakeManager.OFFLOAD_MGR, FakeManager.made = None, 0
