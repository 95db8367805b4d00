"""ensure_offload_flag_module supplies TE's cpu_offload flag only when it is missing."""

from __future__ import annotations

import pytest

te_extension = pytest.importorskip("megatron.core.extensions.transformer_engine")

from nemo_rl_offload.models.te_compat import ensure_offload_flag_module  # noqa: E402


def test_supplies_the_flag_once_when_te_is_missing(monkeypatch):
    monkeypatch.setattr(te_extension, "cpu_offload", None)
    assert ensure_offload_flag_module() is True
    flag = te_extension.cpu_offload
    assert flag.CPUOffloadEnabled is False
    assert ensure_offload_flag_module() is False
    assert te_extension.cpu_offload is flag


def test_leaves_an_installed_te_module_alone(monkeypatch):
    installed = object()
    monkeypatch.setattr(te_extension, "cpu_offload", installed)
    assert ensure_offload_flag_module() is False
    assert te_extension.cpu_offload is installed


def test_megatron_offload_manager_accepts_the_flag(monkeypatch):
    """The manager's enter/exit toggles the flag instead of raising 'TE CPU offload is not
    available' (only reached with an active offload chunk, so called through a stub chunk)."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    monkeypatch.setattr(te_extension, "cpu_offload", None)
    ensure_offload_flag_module()

    class _Chunk:
        do_offload = True

    class _Hooks:
        def __enter__(self):
            return None

        def __exit__(self, *args):
            return None

    manager = object.__new__(fgo.PipelineOffloadManager)
    manager._cur_forward_chunk = _Chunk()
    manager._saved_tensors_hooks = _Hooks()
    manager.cur_forward_chunk = lambda: manager._cur_forward_chunk
    manager.__enter__()
    assert te_extension.cpu_offload.CPUOffloadEnabled is True
    manager.__exit__(None, None, None)
    assert te_extension.cpu_offload.CPUOffloadEnabled is False
