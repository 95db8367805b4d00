"""``logger.monitor_gpus``: each GPU's utilisation and memory in every training step's metrics.

A small Ray actor on each GPU node samples NVML and the driver collects the samples at the end
of each step, so the numbers sit beside the step they describe, under NeMo-RL's names. The
metrics and how they are measured: docs/telemetry.md.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

SAMPLE_INTERVAL_S = 1.0
# One NVML reading of one GPU: (index, utilisation %, memory used in GiB).
Reading = tuple[int, float, float]


def metric_names(node: int, gpu: int) -> tuple[str, str]:
    """NeMo-RL's names for a GPU's utilisation and memory (its logger's ``ray/`` group)."""
    return f"node.{node}.gpu.{gpu}.util", f"node.{node}.gpu.{gpu}.mem_gb"


def summarize(samples: Sequence[Sequence[Reading]], node: int) -> dict[str, float]:
    """A step's metrics from one node's samples (each a reading of every GPU): the mean
    utilisation and the peak memory of each GPU."""
    utilisation: dict[int, list[float]] = {}
    memory: dict[int, float] = {}
    for sample in samples:
        for gpu, util, mem_gib in sample:
            utilisation.setdefault(gpu, []).append(util)
            memory[gpu] = max(memory.get(gpu, 0.0), mem_gib)
    metrics: dict[str, float] = {}
    for gpu in sorted(utilisation):
        util_name, mem_name = metric_names(node, gpu)
        metrics[util_name] = sum(utilisation[gpu]) / len(utilisation[gpu])
        metrics[mem_name] = memory[gpu]
    return metrics


def read_nvml(nvml: Any) -> list[Reading]:
    """One reading of every GPU of this node through an initialised ``pynvml`` module."""
    readings = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
        used = nvml.nvmlDeviceGetMemoryInfo(handle).used
        readings.append((index, float(util), used / 2**30))
    return readings


class NodeSampler:
    """Samples its node's GPUs in a thread; :meth:`take` hands over what it has gathered."""

    def __init__(self, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.error: str | None = None
        self._samples: list[list[Reading]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            read_nvml(pynvml)
        except ImportError:
            self.error = "NVML is not installed (pip install nvidia-ml-py)"
            return
        except Exception as exc:  # pynvml.NVMLError: no driver, no GPU
            self.error = f"NVML does not start: {exc}"
            return
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                reading = read_nvml(self._nvml)
            except Exception:  # a GPU fell off the bus: keep what was gathered
                continue
            with self._lock:
                self._samples.append(reading)

    def take(self) -> tuple[str | None, list[list[Reading]]]:
        """(why there are no samples, or None; the samples since the last take)."""
        if self.error is not None:
            return self.error, []
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:  # a step shorter than the interval: read now
            samples = [read_nvml(self._nvml)]
        return None, samples

    def stop(self) -> None:
        self._stop.set()


class GpuMonitor:
    """The driver's side: one :class:`NodeSampler` actor on each alive Ray node with GPUs."""

    def __init__(self, interval: float = SAMPLE_INTERVAL_S) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted(
            (n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU")),
            key=lambda n: n["NodeManagerAddress"],
        )
        remote = ray.remote(num_cpus=0)(NodeSampler)
        self._actors = [
            remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(interval)
            for n in nodes
        ]
        self._warned: set[int] = set()
        if not nodes:
            print("warning: logger.monitor_gpus: no Ray node has GPUs", file=sys.stderr)

    def take(self) -> dict[str, float]:
        """The metrics of the step that just ended (and restart the gathering)."""
        import ray

        metrics: dict[str, float] = {}
        for node, (error, samples) in enumerate(ray.get([a.take.remote() for a in self._actors])):
            if error is not None:
                if node not in self._warned:
                    print(
                        f"warning: logger.monitor_gpus: no GPU metrics from node {node}: {error}",
                        file=sys.stderr,
                    )
                    self._warned.add(node)
                continue
            metrics.update(summarize(samples, node))
        return metrics

    def close(self) -> None:
        import ray

        for actor in self._actors:
            try:
                ray.get(actor.stop.remote(), timeout=5)
                ray.kill(actor)
            except Exception:  # the cluster is going down anyway
                pass
