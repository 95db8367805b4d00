"""NUMA binding for GPU workers, on a fake sysfs tree and a fake NVML (no GPU needed)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nemo_rl_offload.distributed import numa
from nemo_rl_offload.distributed.numa import (
    NumaBinding,
    bind_to_gpu_numa_node,
    find_nvidia_gpu_bus_id,
    normalize_pci_bus_id,
    parse_cpulist,
    resolve_physical_gpu,
)

BUS = "0000:3b:00.0"
ALLOWED = sorted(os.sched_getaffinity(0))
# A strict subset when the machine allows it, so a successful bind visibly changes affinity.
NODE_CPUS = ALLOWED[:-1] if len(ALLOWED) > 1 else ALLOWED
LOGGER = "nemo_rl_offload.numa"
REAL_LOAD_LIBNUMA = numa._load_libnuma
REAL_SETAFFINITY = os.sched_setaffinity  # kept even while a test patches os


@pytest.fixture(autouse=True)
def restore_affinity():
    original = os.sched_getaffinity(0)
    try:
        yield original
    finally:
        REAL_SETAFFINITY(0, original)


class FakeLibnuma:
    def __init__(self, max_node: int = 3) -> None:
        self.max_node = max_node
        self.preferred: list[int] = []

    def numa_max_node(self) -> int:
        return self.max_node

    def numa_set_preferred(self, node: Any) -> None:
        self.preferred.append(node.value)


@pytest.fixture(autouse=True)
def libnuma(monkeypatch) -> FakeLibnuma:
    """Never change the test process's real memory policy."""
    fake = FakeLibnuma()
    monkeypatch.setattr(numa, "_load_libnuma", lambda: (fake, ""))
    return fake


class FakeNvml:
    """Just enough of pynvml: one GPU per bus id, optional affinity masks."""

    def __init__(self, bus_ids: dict[int | str, str], node_mask=None, cpu_mask=None) -> None:
        self.bus_ids = bus_ids
        self.node_mask = node_mask
        self.cpu_mask = cpu_mask
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int | str:
        self.calls.append(f"index {index}")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.calls.append(f"uuid {uuid}")
        return uuid

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig: str) -> str:
        return "GPU-parent-of-" + mig

    def nvmlDeviceGetPciInfo(self, handle: int | str) -> SimpleNamespace:
        return SimpleNamespace(busId=self.bus_ids[handle].encode())

    def nvmlDeviceGetMemoryAffinity(self, handle, node_set_size: int, scope: int) -> list[int]:
        if self.node_mask is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.node_mask + [0] * (node_set_size - len(self.node_mask))

    def nvmlDeviceGetCpuAffinity(self, handle, cpu_set_size: int) -> list[int]:
        if self.cpu_mask is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.cpu_mask + [0] * (cpu_set_size - len(self.cpu_mask))


class BrokenNvml:
    def nvmlInit(self) -> None:
        raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")


def cpu_mask(cpus: list[int]) -> list[int]:
    words = [0] * (max(cpus) // 64 + 1)
    for cpu in cpus:
        words[cpu // 64] |= 1 << (cpu % 64)
    return words


def add_device(
    root: Path,
    bus: str,
    *,
    node: str = "1\n",
    cpulist: str | None = None,
    vendor: str = "0x10de\n",
    pci_class: str = "0x030200\n",
) -> None:
    device = root / "bus" / "pci" / "devices" / bus
    device.mkdir(parents=True)
    (device / "numa_node").write_text(node)
    (device / "vendor").write_text(vendor)
    (device / "class").write_text(pci_class)
    if cpulist is not None:
        (device / "local_cpulist").write_text(cpulist)


def as_cpulist(cpus: list[int]) -> str:
    return ",".join(map(str, cpus)) + "\n"


# --- CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------


def test_remapped_integer_entries() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "3,1"}
    assert resolve_physical_gpu(0, env) == 3
    assert resolve_physical_gpu(1, env) == 1


def test_whitespace_around_entries_is_ignored() -> None:
    assert resolve_physical_gpu(1, {"CUDA_VISIBLE_DEVICES": " 3 , 1 "}) == 1


def test_uuid_entries_are_returned_as_strings() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "GPU-8f2c1a0e-aaaa,MIG-5d1e-bbbb"}
    assert resolve_physical_gpu(0, env) == "GPU-8f2c1a0e-aaaa"
    assert resolve_physical_gpu(1, env) == "MIG-5d1e-bbbb"


@pytest.mark.parametrize("env", [{}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": " "}])
def test_unset_or_empty_means_identity(env: dict[str, str]) -> None:
    assert resolve_physical_gpu(0, env) == 0
    assert resolve_physical_gpu(5, env) == 5


def test_default_env_is_os_environ(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    assert resolve_physical_gpu(0) == 6


@pytest.mark.parametrize("index", [2, -1])
def test_out_of_range_index_raises(index: int) -> None:
    with pytest.raises(ValueError, match="CUDA index"):
        resolve_physical_gpu(index, {"CUDA_VISIBLE_DEVICES": "3,1"})


# --- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,8-9", (0, 1, 2, 3, 8, 9)),
        ("3", (3,)),
        ("", ()),
        ("\n", ()),
        (" 0-1 , 5\n", (0, 1, 5)),
        ("4,0-2\n", (0, 1, 2, 4)),
        ("2-2", (2,)),
    ],
)
def test_parse_cpulist(text: str, expected: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["3-1", "a", "1-", "-2"])
def test_parse_cpulist_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(text)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"00000000:3B:00.0", BUS),
        ("0000:3b:00.0", BUS),
        ("3B:00.0", BUS),
        ("0001:86:1F.7", "0001:86:1f.7"),
    ],
)
def test_normalize_pci_bus_id(raw: str | bytes, expected: str) -> None:
    assert normalize_pci_bus_id(raw) == expected


# --- binding ------------------------------------------------------------------------------------


def test_nvml_bus_id_with_sysfs_node_and_cpus(tmp_path: Path, libnuma: FakeLibnuma) -> None:
    add_device(tmp_path, BUS, node="1\n", cpulist=as_cpulist(NODE_CPUS))
    nvml = FakeNvml({3: "00000000:3B:00.0"})
    result = bind_to_gpu_numa_node(
        0, env={"CUDA_VISIBLE_DEVICES": "3,1"}, sysfs_root=tmp_path, nvml=nvml
    )
    assert result == NumaBinding(3, BUS, 1, tuple(NODE_CPUS), True, None, "sysfs")
    assert os.sched_getaffinity(0) == set(NODE_CPUS)
    assert libnuma.preferred == [1]
    assert "index 3" in nvml.calls and nvml.calls[-1] == "shutdown"


def test_nvml_affinity_masks_win_over_sysfs(tmp_path: Path) -> None:
    add_device(tmp_path, BUS, node="-1\n", cpulist="")
    nvml = FakeNvml({1: BUS}, node_mask=[0b10], cpu_mask=cpu_mask(NODE_CPUS))
    result = bind_to_gpu_numa_node(1, env={}, sysfs_root=tmp_path, nvml=nvml)
    assert (result.numa_node, result.source, result.skipped_reason) == (1, "nvml", None)
    assert os.sched_getaffinity(0) == set(NODE_CPUS)


def test_ambiguous_nvml_node_mask_falls_back_to_sysfs_node(tmp_path: Path) -> None:
    add_device(tmp_path, BUS, node="2\n", cpulist=as_cpulist(NODE_CPUS))
    nvml = FakeNvml({0: BUS}, node_mask=[0b11])
    result = bind_to_gpu_numa_node(0, env={}, sysfs_root=tmp_path, nvml=nvml)
    assert (result.numa_node, result.source) == (2, "sysfs")


def test_cpus_outside_the_allowed_set_are_dropped(tmp_path: Path, caplog) -> None:
    foreign = max(ALLOWED) + 1000
    add_device(tmp_path, BUS, cpulist=as_cpulist([*NODE_CPUS, foreign]))
    caplog.set_level(logging.INFO, logger=LOGGER)
    result = bind_to_gpu_numa_node(0, env={}, sysfs_root=tmp_path, nvml=FakeNvml({0: BUS}))
    assert result.cpus == tuple(NODE_CPUS)
    assert os.sched_getaffinity(0) == set(NODE_CPUS)
    assert f"{len(NODE_CPUS)}/{len(NODE_CPUS) + 1} CPUs bound" in caplog.text


def test_node_cpulist_is_used_when_device_has_none(tmp_path: Path) -> None:
    add_device(tmp_path, BUS, node="1\n")
    node_dir = tmp_path / "devices" / "system" / "node" / "node1"
    node_dir.mkdir(parents=True)
    (node_dir / "cpulist").write_text(as_cpulist(NODE_CPUS))
    result = bind_to_gpu_numa_node(0, env={}, sysfs_root=tmp_path, nvml=FakeNvml({0: BUS}))
    assert result.cpus == tuple(NODE_CPUS)


def test_mig_uuid_binds_through_its_parent_gpu(tmp_path: Path) -> None:
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    nvml = FakeNvml({"GPU-parent-of-MIG-1234": BUS})
    result = bind_to_gpu_numa_node(
        0, env={"CUDA_VISIBLE_DEVICES": "MIG-1234"}, sysfs_root=tmp_path, nvml=nvml
    )
    assert result.physical_gpu == "MIG-1234"
    assert (result.pci_bus_id, result.skipped_reason) == (BUS, None)


def test_info_line_says_what_was_done(tmp_path: Path, caplog) -> None:
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    caplog.set_level(logging.INFO, logger=LOGGER)
    bind_to_gpu_numa_node(
        0, env={"CUDA_VISIBLE_DEVICES": "3"}, sysfs_root=tmp_path, nvml=FakeNvml({3: BUS})
    )
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith(
        f"numa: GPU 3 ({BUS}) -> node 1, {len(NODE_CPUS)} CPUs bound, memory preferred on node 1"
    )


def test_passed_logger_is_used(tmp_path: Path, caplog) -> None:
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    caplog.set_level(logging.INFO)
    bind_to_gpu_numa_node(
        0, env={}, sysfs_root=tmp_path, nvml=FakeNvml({0: BUS}), logger=logging.getLogger("mine")
    )
    assert [r.name for r in caplog.records] == ["mine"]


def test_missing_libnuma_still_binds_cpus(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(numa, "_load_libnuma", lambda: (None, "libnuma not found"))
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    caplog.set_level(logging.INFO, logger=LOGGER)
    result = bind_to_gpu_numa_node(0, env={}, sysfs_root=tmp_path, nvml=FakeNvml({0: BUS}))
    assert (result.memory_bound, result.skipped_reason) == (False, None)
    assert os.sched_getaffinity(0) == set(NODE_CPUS)
    assert "memory not bound (libnuma not found)" in caplog.text


def test_node_beyond_numa_max_node_leaves_memory_alone(tmp_path: Path, libnuma) -> None:
    libnuma.max_node = 0
    add_device(tmp_path, BUS, node="1\n", cpulist=as_cpulist(NODE_CPUS))
    result = bind_to_gpu_numa_node(0, env={}, sysfs_root=tmp_path, nvml=FakeNvml({0: BUS}))
    assert (result.memory_bound, result.skipped_reason, libnuma.preferred) == (False, None, [])


def test_real_libnuma_loader_explains_a_missing_library(monkeypatch) -> None:
    lib, why = REAL_LOAD_LIBNUMA()
    assert (lib is None) == bool(why)
    monkeypatch.setattr(numa.ctypes.util, "find_library", lambda name: None)
    assert REAL_LOAD_LIBNUMA() == (None, "libnuma not found")


# --- fallbacks and refusals ---------------------------------------------------------------------


def test_broken_nvml_falls_back_to_sysfs_scan(tmp_path: Path) -> None:
    # Created out of order; only NVIDIA display/3D controllers count, in bus order.
    add_device(tmp_path, "0000:86:00.0", node="1\n", cpulist=as_cpulist(NODE_CPUS))
    add_device(tmp_path, "0000:3b:00.1", node="0\n", pci_class="0x040300\n")  # HDMI audio
    add_device(tmp_path, "0000:03:00.0", node="0\n", vendor="0x1a03\n", pci_class="0x030000\n")
    add_device(tmp_path, BUS, node="0\n", cpulist=as_cpulist(ALLOWED), pci_class="0x030000\n")
    assert find_nvidia_gpu_bus_id(0, tmp_path) == BUS
    assert find_nvidia_gpu_bus_id(2, tmp_path) is None
    result = bind_to_gpu_numa_node(
        0, env={"CUDA_VISIBLE_DEVICES": "1"}, sysfs_root=tmp_path, nvml=BrokenNvml()
    )
    assert result == NumaBinding(1, "0000:86:00.0", 1, tuple(NODE_CPUS), True, None, "sysfs")
    assert os.sched_getaffinity(0) == set(NODE_CPUS)


def test_default_nvml_import_failure_falls_back(tmp_path: Path, monkeypatch) -> None:
    def no_pynvml() -> None:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(numa, "_pynvml", no_pynvml)
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    result = bind_to_gpu_numa_node(0, env={}, sysfs_root=tmp_path)
    assert (result.pci_bus_id, result.skipped_reason) == (BUS, None)


def test_unknown_numa_node_is_not_bound(tmp_path: Path, caplog, restore_affinity) -> None:
    add_device(tmp_path, BUS, node="-1\n", cpulist=as_cpulist(NODE_CPUS))
    result = bind_to_gpu_numa_node(
        0, env={"CUDA_VISIBLE_DEVICES": "3"}, sysfs_root=tmp_path, nvml=FakeNvml({3: BUS})
    )
    assert result.skipped_reason is not None and "is -1" in result.skipped_reason
    assert (result.numa_node, result.cpus, result.pci_bus_id) == (None, (), BUS)
    assert os.sched_getaffinity(0) == restore_affinity
    assert f"numa: not bound for GPU 3: NUMA node unknown ({tmp_path}" in caplog.text


@pytest.mark.parametrize("value", ["0", "false", "OFF", " Off "])
def test_env_var_switches_binding_off(tmp_path: Path, value: str, caplog, restore_affinity) -> None:
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    nvml = FakeNvml({0: BUS})
    caplog.set_level(logging.INFO, logger=LOGGER)
    result = bind_to_gpu_numa_node(
        0, env={"NEMO_RL_OFFLOAD_NUMA_BIND": value}, sysfs_root=tmp_path, nvml=nvml
    )
    assert result.skipped_reason == f"disabled by NEMO_RL_OFFLOAD_NUMA_BIND={value}"
    assert nvml.calls == []
    assert os.sched_getaffinity(0) == restore_affinity
    assert "numa: not bound for GPU cuda:0: disabled" in caplog.text


def test_env_var_on_still_binds(tmp_path: Path) -> None:
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    env = {"NEMO_RL_OFFLOAD_NUMA_BIND": "1"}
    result = bind_to_gpu_numa_node(0, env=env, sysfs_root=tmp_path, nvml=FakeNvml({0: BUS}))
    assert result.skipped_reason is None


def test_nothing_found_returns_skipped_binding(tmp_path: Path, caplog) -> None:
    result = bind_to_gpu_numa_node(
        0, env={"CUDA_VISIBLE_DEVICES": "3"}, sysfs_root=tmp_path, nvml=BrokenNvml()
    )
    assert result.physical_gpu == 3 and result.source is None and not result.memory_bound
    assert "NVML unavailable" in (result.skipped_reason or "")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("numa: not bound for GPU 3: NVML unavailable")


def test_uuid_without_nvml_is_skipped(tmp_path: Path) -> None:
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    env = {"CUDA_VISIBLE_DEVICES": "GPU-abc"}
    result = bind_to_gpu_numa_node(0, env=env, sysfs_root=tmp_path, nvml=BrokenNvml())
    assert "by UUID" in (result.skipped_reason or "")


def test_out_of_range_local_index_is_skipped_not_raised(tmp_path: Path, caplog) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    result = bind_to_gpu_numa_node(4, env=env, sysfs_root=tmp_path, nvml=BrokenNvml())
    assert result.physical_gpu is None
    assert "numa: not bound for GPU cuda:4: ValueError" in caplog.text


def test_no_allowed_cpus_on_node_is_skipped(tmp_path: Path, restore_affinity) -> None:
    add_device(tmp_path, BUS, cpulist=f"{max(ALLOWED) + 1000}\n")
    result = bind_to_gpu_numa_node(0, env={}, sysfs_root=tmp_path, nvml=FakeNvml({0: BUS}))
    assert "allowed set" in (result.skipped_reason or "")
    assert os.sched_getaffinity(0) == restore_affinity


def test_permission_error_is_caught(tmp_path: Path, monkeypatch, caplog) -> None:
    def refuse(pid: int, cpus: Any) -> None:
        raise PermissionError("Operation not permitted")

    monkeypatch.setattr(numa.os, "sched_setaffinity", refuse)
    add_device(tmp_path, BUS, cpulist=as_cpulist(NODE_CPUS))
    result = bind_to_gpu_numa_node(0, env={}, sysfs_root=tmp_path, nvml=FakeNvml({0: BUS}))
    assert result.skipped_reason == "PermissionError: Operation not permitted"
    assert (result.numa_node, result.pci_bus_id) == (1, BUS)
    assert "numa: not bound for GPU 0: PermissionError" in caplog.text


def test_sysfs_scan_uses_bus_order_not_directory_order(tmp_path: Path, monkeypatch) -> None:
    for bus in ("0000:1a:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:db:00.0"):
        add_device(tmp_path, bus)
    real_iterdir = Path.iterdir
    monkeypatch.setattr(
        Path, "iterdir", lambda self: iter(sorted(real_iterdir(self), reverse=True))
    )
    assert [find_nvidia_gpu_bus_id(i, tmp_path) for i in range(4)] == [
        "0000:1a:00.0",
        "0000:3b:00.0",
        "0000:86:00.0",
        "0000:db:00.0",
    ]
