"""Bind a GPU worker's CPUs and host memory to the NUMA node its GPU hangs off.

Activation offloading copies tensors into pinned host buffers. Those copies reach full PCIe
bandwidth only when the buffers and the thread driving them live on the GPU's own NUMA node;
crossing the socket interconnect costs bandwidth on every step. A Ray worker only sees a
remapped ``cuda:0``, so the physical GPU is resolved through ``CUDA_VISIBLE_DEVICES`` first.

Binding is an optimisation, never a requirement: every failure is logged as one line and
reported in :attr:`NumaBinding.skipped_reason`, and the job carries on unbound.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DISABLE_ENV = "NEMO_RL_OFFLOAD_NUMA_BIND"
_OFF_VALUES = frozenset({"0", "false", "off"})
_LOG = logging.getLogger("nemo_rl_offload.numa")
_NVIDIA_VENDOR = 0x10DE
_DISPLAY_CLASSES = frozenset({0x0300, 0x0302})  # PCI class >> 8: VGA and 3D controllers
_MASK_WORD_BITS = 64  # NVML affinity masks are arrays of unsigned 64-bit words
_NODE_MASK_WORDS = 4
_NVML_AFFINITY_SCOPE_NODE = 0


@dataclass(frozen=True)
class NumaBinding:
    """What :func:`bind_to_gpu_numa_node` did, kept so callers and tests need not parse logs.

    ``source`` names where the NUMA node came from; ``skipped_reason`` is None only when the
    CPU affinity was actually set.
    """

    physical_gpu: str | int | None
    pci_bus_id: str | None
    numa_node: int | None
    cpus: tuple[int, ...]
    memory_bound: bool
    skipped_reason: str | None
    source: Literal["nvml", "sysfs"] | None


class _Skip(Exception):
    """Internal: a reason not to bind that is expected, not a bug."""


@dataclass
class _Found:
    physical_gpu: str | int | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    source: Literal["nvml", "sysfs"] | None = None


def resolve_physical_gpu(local_index: int, env: Mapping[str, str] | None = None) -> str | int:
    """Map a process-local CUDA index to the entry CUDA_VISIBLE_DEVICES gives it.

    Returns an ``int`` for numeric entries and the string itself for ``GPU-``/``MIG-`` UUIDs.
    An unset or empty variable means no remapping.
    """
    env = os.environ if env is None else env
    if local_index < 0:
        raise ValueError(f"local CUDA index must be >= 0, got {local_index}")
    raw = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not raw:
        return local_index
    entries = [entry.strip() for entry in raw.split(",") if entry.strip()]
    if local_index >= len(entries):
        exposes = f"CUDA_VISIBLE_DEVICES={raw!r} exposes {len(entries)} device(s)"
        raise ValueError(f"local CUDA index {local_index} is out of range: {exposes}")
    entry = entries[local_index]
    return int(entry) if entry.isascii() and entry.isdigit() else entry


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse the kernel's cpulist format (``"0-15,32-47"``, ``"3"``, ``""``) into sorted ids."""
    cpus: set[int] = set()
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            start = int(low)
            end = int(high) if dash else start
        except ValueError:
            raise ValueError(f"bad cpulist entry {part!r} in {text!r}") from None
        if start < 0 or end < start:
            raise ValueError(f"bad cpulist range {part!r} in {text!r}")
        cpus.update(range(start, end + 1))
    return tuple(sorted(cpus))


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """Turn NVML's ``00000000:3B:00.0`` into sysfs's ``0000:3b:00.0`` directory name."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    parts = text.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {text!r}")
    device, _, function = parts[2].partition(".")
    domain, bus = int(parts[0], 16), int(parts[1], 16)
    return f"{domain:04x}:{bus:02x}:{int(device, 16):02x}.{int(function, 16):x}"


def find_nvidia_gpu_bus_id(physical_index: int, sysfs_root: str | Path = "/sys") -> str | None:
    """Find an NVIDIA GPU's bus id without NVML: the ``physical_index``-th one in PCI order.

    This matches CUDA numbering when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or all GPUs are the
    same model (CUDA breaks its speed-order ties by bus id).
    """
    try:
        devices = sorted(_pci_devices(sysfs_root).iterdir(), key=lambda p: p.name)
    except OSError:
        return None
    gpus: list[str] = []
    for device in devices:
        try:
            vendor = int(_read(device / "vendor"), 16)
            pci_class = int(_read(device / "class"), 16)
        except (OSError, ValueError):
            continue
        if vendor == _NVIDIA_VENDOR and pci_class >> 8 in _DISPLAY_CLASSES:
            gpus.append(device.name)
    return gpus[physical_index] if 0 <= physical_index < len(gpus) else None


def bind_to_gpu_numa_node(
    local_gpu_index: int,
    *,
    env: Mapping[str, str] | None = None,
    sysfs_root: str | Path = "/sys",
    nvml: Any | None = None,
    logger: logging.Logger | None = None,
) -> NumaBinding:
    """Pin this process's CPUs (and, with libnuma, preferred memory) to the GPU's NUMA node.

    Call it in the worker's main thread before it starts threads or allocates pinned buffers:
    affinity and memory policy are inherited, not applied to threads that already exist.
    ``nvml`` is any object with pynvml's function names (default: the ``pynvml`` module); the
    topology comes from NVML first and from ``<sysfs_root>/bus/pci/devices`` for what NVML
    cannot give. Never raises.
    """
    log = logger or _LOG
    env = os.environ if env is None else env
    if env.get(DISABLE_ENV, "").strip().lower() in _OFF_VALUES:
        reason = f"disabled by {DISABLE_ENV}={env[DISABLE_ENV]}"
        log.info("numa: not bound for GPU cuda:%d: %s", local_gpu_index, reason)
        return NumaBinding(None, None, None, (), False, reason, None)
    found = _Found()
    try:
        return _bind(local_gpu_index, env, Path(sysfs_root), nvml, log, found)
    except Exception as exc:  # binding is best effort; the job must go on
        reason = str(exc) if isinstance(exc, _Skip) else f"{type(exc).__name__}: {exc}"
        gpu = found.physical_gpu if found.physical_gpu is not None else f"cuda:{local_gpu_index}"
        log.warning("numa: not bound for GPU %s: %s", gpu, reason)
        return NumaBinding(
            found.physical_gpu, found.pci_bus_id, found.numa_node, (), False, reason, found.source
        )


def _bind(
    local_gpu_index: int,
    env: Mapping[str, str],
    sysfs_root: Path,
    nvml: Any | None,
    log: logging.Logger,
    found: _Found,
) -> NumaBinding:
    physical = found.physical_gpu = resolve_physical_gpu(local_gpu_index, env)
    try:
        bus_id, node, cpus = _nvml_topology(physical, nvml if nvml is not None else _pynvml())
        nvml_note = ""
    except Exception as exc:
        bus_id, node, cpus = None, None, ()
        nvml_note = f"NVML unavailable ({type(exc).__name__}: {exc}); "
    if bus_id is None:
        if not isinstance(physical, int):
            raise _Skip(f"{nvml_note}sysfs cannot locate {physical} by UUID")
        bus_id = find_nvidia_gpu_bus_id(physical, sysfs_root)
        if bus_id is None:
            devices = _pci_devices(sysfs_root)
            raise _Skip(f"{nvml_note}no NVIDIA GPU #{physical} under {devices}")
    found.pci_bus_id = bus_id
    device = _pci_devices(sysfs_root) / bus_id
    if node is not None:
        found.source = "nvml"
    else:
        node = _sysfs_numa_node(device)
        found.source = "sysfs"
    found.numa_node = node
    if not cpus:
        node_list = sysfs_root / "devices" / "system" / "node" / f"node{node}" / "cpulist"
        cpus = _read_cpulist(device / "local_cpulist") or _read_cpulist(node_list)
    if not cpus:
        raise _Skip(f"no CPU list for node {node} (looked in {device}/local_cpulist)")
    allowed = os.sched_getaffinity(0)
    target = tuple(cpu for cpu in cpus if cpu in allowed)
    if not target:
        raise _Skip(f"none of node {node}'s {len(cpus)} CPUs are in this process's allowed set")
    os.sched_setaffinity(0, target)
    try:
        memory_bound, memory_note = _prefer_memory_node(node)
    except Exception as exc:
        memory_bound, memory_note = False, f"memory not bound ({type(exc).__name__}: {exc})"
    count = f"{len(target)}" if len(target) == len(cpus) else f"{len(target)}/{len(cpus)}"
    log.info(f"numa: GPU {physical} ({bus_id}) -> node {node}, {count} CPUs bound, {memory_note}")
    return NumaBinding(physical, bus_id, node, target, memory_bound, None, found.source)


def _nvml_topology(physical: str | int, nvml: Any) -> tuple[str, int | None, tuple[int, ...]]:
    """Bus id from NVML, plus node and CPUs when the driver reports a single clear answer."""
    nvml.nvmlInit()
    try:
        if isinstance(physical, int):
            handle = nvml.nvmlDeviceGetHandleByIndex(physical)
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(physical)
            if physical.startswith("MIG-"):
                handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        bus_id = normalize_pci_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
        node: int | None = None
        cpus: tuple[int, ...] = ()
        with contextlib.suppress(Exception):  # older drivers and non-NUMA hosts lack these
            scope = _NVML_AFFINITY_SCOPE_NODE
            nodes = _mask_bits(nvml.nvmlDeviceGetMemoryAffinity(handle, _NODE_MASK_WORDS, scope))
            node = nodes[0] if len(nodes) == 1 else None
        with contextlib.suppress(Exception):
            highest = max(os.cpu_count() or 1, max(os.sched_getaffinity(0), default=0) + 1)
            words = -(-highest // _MASK_WORD_BITS)
            cpus = _mask_bits(nvml.nvmlDeviceGetCpuAffinity(handle, words))
        return bus_id, node, cpus
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _pynvml() -> Any:
    import pynvml  # imported lazily: a missing package only means "use sysfs"

    return pynvml


def _load_libnuma() -> tuple[Any | None, str]:
    """Return (library, "") or (None, why memory cannot be bound)."""
    name = ctypes.util.find_library("numa")
    if name is None:
        return None, "libnuma not found"
    lib = ctypes.CDLL(name)
    if lib.numa_available() < 0:
        return None, "libnuma reports NUMA unavailable"
    return lib, ""


def _prefer_memory_node(node: int) -> tuple[bool, str]:
    """Prefer (not require) allocations on ``node``, so a full node spills instead of failing."""
    lib, why = _load_libnuma()
    if lib is None:
        return False, f"memory not bound ({why})"
    max_node = lib.numa_max_node()
    if node > max_node:
        return False, f"memory not bound (node {node} > numa_max_node {max_node})"
    lib.numa_set_preferred(ctypes.c_int(node))
    return True, f"memory preferred on node {node}"


def _sysfs_numa_node(device: Path) -> int:
    try:
        node = int(_read(device / "numa_node"))
    except (OSError, ValueError) as exc:
        raise _Skip(f"no NUMA node for {device.name} ({type(exc).__name__}: {exc})") from None
    if node < 0:
        raise _Skip(f"NUMA node unknown ({device}/numa_node is {node})")
    return node


def _read_cpulist(path: Path) -> tuple[int, ...]:
    try:
        return parse_cpulist(_read(path))
    except (OSError, ValueError):
        return ()


def _mask_bits(words: Iterable[int]) -> tuple[int, ...]:
    return tuple(
        index * _MASK_WORD_BITS + bit
        for index, word in enumerate(words)
        for bit in range(_MASK_WORD_BITS)
        if int(word) >> bit & 1
    )


def _pci_devices(sysfs_root: str | Path) -> Path:
    return Path(sysfs_root) / "bus" / "pci" / "devices"


def _read(path: Path) -> str:
    return path.read_text().strip()
