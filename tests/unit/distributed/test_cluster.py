"""The embedded local cluster is this job's own, even beside another job's on the same machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[3]


_THIS_JOB = """
from nemo_rl_offload.config.cluster_settings import ClusterSettings
from nemo_rl_offload.distributed import cluster
info = cluster.start_or_join(ClusterSettings(), num_cpus=3)
print("result", info.started_here, info.num_cpus, flush=True)
cluster.shutdown(info)
"""


def test_embedded_cluster_does_not_join_a_running_cluster(tmp_path):
    # Without an address, Ray joins the newest cluster started on the machine (`ray start`):
    # the job would land there, where its own num_cpus cannot apply (Ray refuses them with a
    # traceback), instead of on the embedded cluster the recipe asked for.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    ray_cli = Path(sys.executable).with_name("ray")
    other = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--num-cpus=1", "--include-dashboard=false", "--block"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not _newest_cluster_is_running():
            assert other.poll() is None and time.monotonic() < deadline, "ray start failed"
            time.sleep(1)
        this = subprocess.run(
            [sys.executable, "-c", _THIS_JOB],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert this.returncode == 0, this.stderr[-3000:]
        (line,) = [x for x in this.stdout.splitlines() if x.startswith("result")]
        assert line.split()[1:] == ["True", "3.0"], line
    finally:
        other.terminate()  # --block: the cluster stops with this process
        try:
            other.wait(timeout=60)
        except subprocess.TimeoutExpired:
            other.kill()


def _newest_cluster_is_running() -> bool:
    """Whether a plain ray.init() would now find the `ray start` cluster to join."""
    from ray._private import services

    return services.find_bootstrap_address(None) is not None


def test_connections_made_inside_kept_open_last_until_it_ends():
    """The planner's measurements share one Ray start: a connection made inside the block
    outlives its job's shutdown; a job that finds Ray connected leaves the connection alone;
    the block's end disconnects (stopping the embedded cluster)."""
    import ray

    from nemo_rl_offload.config.cluster_settings import ClusterSettings
    from nemo_rl_offload.distributed import cluster

    if ray.is_initialized():
        ray.shutdown()
    with cluster.kept_open():
        assert cluster.keeping()
        first = cluster.start_or_join(ClusterSettings(), num_cpus=1, num_gpus=0)
        assert first.connected_here and first.started_here
        cluster.shutdown(first)
        assert ray.is_initialized()
        second = cluster.start_or_join(ClusterSettings(), num_cpus=1, num_gpus=0)
        assert not second.connected_here
        cluster.shutdown(second)
        assert ray.is_initialized()
    assert not cluster.keeping() and not ray.is_initialized()
