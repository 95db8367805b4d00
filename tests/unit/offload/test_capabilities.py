"""What the installed stack supports: module names asked from megatron-core, TE version facts."""

from __future__ import annotations

import pytest

from nemo_rl_offload.config.environment import Capabilities
from nemo_rl_offload.config.module_names import MLP_OFFLOAD_MODULES, OFFLOAD_MODULES_BY_VERSION
from nemo_rl_offload.offload import capabilities

pytest.importorskip("megatron.core")


def test_module_names_asked_from_installed_megatron_match_the_table():
    caps = capabilities.detect()
    assert caps.offload_module_names_source == "megatron-core"
    minor = ".".join(caps.megatron_version.split(".")[:2])
    assert caps.offload_module_names == OFFLOAD_MODULES_BY_VERSION[minor]


def test_this_packages_module_names_are_not_megatrons():
    """The dense MLP's offload points (models.mlp_offload) keep names Megatron does not use, so
    neither can be mistaken for the other."""
    assert MLP_OFFLOAD_MODULES.isdisjoint(capabilities.detect().offload_module_names)
    for names in OFFLOAD_MODULES_BY_VERSION.values():
        assert MLP_OFFLOAD_MODULES.isdisjoint(names)


def test_table_fallback_when_megatron_cannot_answer(monkeypatch):
    monkeypatch.setattr(capabilities, "_names_from_megatron", lambda: None)
    capabilities.detect.cache_clear()
    try:
        caps = capabilities.detect()
        assert caps.offload_module_names_source == "version table"
        assert "fused_group_mlp" in caps.offload_module_names
    finally:
        capabilities.detect.cache_clear()


@pytest.mark.parametrize(
    "version,expected",
    [
        ("0.15.3", OFFLOAD_MODULES_BY_VERSION["0.15"]),
        ("0.19.2", OFFLOAD_MODULES_BY_VERSION["0.19"]),
        ("0.99.0", OFFLOAD_MODULES_BY_VERSION["0.19"]),
        (None, OFFLOAD_MODULES_BY_VERSION["0.19"]),
    ],
)
def test_version_table_lookup(version, expected):
    assert capabilities._names_from_table(version) == expected


@pytest.mark.parametrize(
    "te_version,needs_env",
    [
        (None, False),
        ("2.9.0", False),
        ("2.10.0", True),
        ("2.11.0.dev0+abc", True),
        ("unknown", True),
    ],
)
def test_te_offload_env_requirement(te_version, needs_env):
    caps = Capabilities("0.19.2", te_version, frozenset(), "version table")
    assert caps.te_needs_offload_v1_env is needs_env
    assert caps.has_transformer_engine is (te_version is not None)


def test_transformer_config_defaults_include_offload_knobs():
    defaults = capabilities.transformer_config_defaults()
    assert defaults["min_offloaded_tensor_size"] == 1024 * 1024
    assert defaults["activation_offload_fraction"] == 1.0
    assert defaults["fine_grained_offloading_max_inflight_offloads"] is None


def test_the_installed_megatron_cores_offload_code_is_the_checked_one():
    capabilities.detect.cache_clear()
    assert capabilities.detect().offload_code_drift is None
    assert capabilities.detect().mlp_code_drift is None


def test_an_offload_module_that_cannot_be_imported_is_reported(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "nemo_rl_offload.offload.owned", None)  # import fails
    line, mlp_line = capabilities._offload_code_drift("0.20.0")
    assert mlp_line == line
    assert line.startswith("megatron-core 0.20.0's fine-grained offloading module is not")
    assert "CHECKED_MEGATRON_VERSION" in line
    assert capabilities._offload_code_drift(None) == (None, None)  # missing: reported elsewhere
