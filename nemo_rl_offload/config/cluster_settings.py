"""The recipe's ``cluster`` section resolved once: how many workers a policy group has, on what,
and which Ray cluster to join."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ClusterSettings", "cluster_settings"]


@dataclass(frozen=True)
class ClusterSettings:
    gpus_per_node: int = 0
    num_nodes: int = 1
    num_cpu_workers: int = 1  # workers when gpus_per_node is 0
    address: str | None = None  # None: RAY_ADDRESS, else an embedded local cluster

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def workers(self) -> int:
        """Workers of each policy group: one per GPU, else ``num_cpu_workers``."""
        return self.gpus_per_node * self.num_nodes if self.on_gpu else self.num_cpu_workers


def cluster_settings(cluster: Mapping[str, Any] | None) -> ClusterSettings:
    """The ``cluster`` section's settings (absent: one CPU worker, an embedded cluster)."""
    cluster = cluster or {}
    address = cluster.get("address")
    return ClusterSettings(
        gpus_per_node=int(cluster.get("gpus_per_node", 0) or 0),
        num_nodes=int(cluster.get("num_nodes", 1) or 1),
        num_cpu_workers=int(cluster.get("num_cpu_workers", 1) or 1),
        address=str(address) if address else None,
    )
