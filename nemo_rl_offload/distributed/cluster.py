"""Start an embedded local Ray cluster, or join an existing one, with clear failures.

By default the job starts its own Ray cluster inside the driver process's machine (nothing to
set up, works on a laptop). ``cluster.address`` in the recipe, or ``RAY_ADDRESS`` in the
environment, joins an existing cluster instead. Ray itself retries an unreachable address for
about two minutes before failing with a long log; we try a plain TCP connection first so a wrong
address fails in seconds with one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nemo_rl_offload import known_warnings
from nemo_rl_offload.config.cluster_settings import ClusterSettings
from nemo_rl_offload.errors import UserInputError

_LOG = logging.getLogger("nemo_rl_offload.cluster")
DEFAULT_RAY_PORT = 6379
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ClusterInfo:
    address: str | None  # None: embedded local cluster
    num_cpus: float
    num_gpus: float
    started_here: bool
    # Whether this call connected the driver to Ray (False: it was connected already, and the
    # connection is its opener's to end).
    connected_here: bool = True


def requested_address(settings: ClusterSettings) -> tuple[str | None, str]:
    """The Ray address to join and where it was given (None: start an embedded cluster)."""
    if settings.address:
        return settings.address, "cluster.address"
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env, "RAY_ADDRESS"
    return None, ""


def _host_port(address: str) -> tuple[str, int] | None:
    """host and port of a Ray address such as ``ray://h:10001`` or ``h:6379``; None for
    ``auto`` / ``local``, which Ray resolves itself."""
    if address in ("auto", "local"):
        return None
    bare = address.split("://", 1)[-1].rstrip("/")
    host, _, port = bare.rpartition(":")
    if not host:
        return bare, DEFAULT_RAY_PORT
    try:
        return host, int(port)
    except ValueError as exc:
        raise UserInputError(f"Ray address '{address}': port '{port}' is not a number") from exc


def check_reachable(address: str, where: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast, with one line, when nothing listens at a Ray address."""
    target = _host_port(address)
    if target is None:
        return
    host, port = target
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserInputError(
            f"{where}: cannot reach a Ray cluster at {host}:{port} ({reason}); start one there "
            "with `ray start --head`, fix the address, or unset it to run on an embedded local "
            "cluster"
        ) from exc


def start_or_join(
    settings: ClusterSettings,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    env_vars: dict[str, str] | None = None,
) -> ClusterInfo:
    """Connect this driver to Ray. ``num_cpus``/``num_gpus`` size an embedded cluster only."""
    import ray

    address, where = requested_address(settings)
    # Every worker process hides megatron-core's known-harmless warnings before it imports
    # anything (known_warnings).
    runtime_env: dict[str, Any] = {"worker_process_setup_hook": known_warnings.SETUP_HOOK}
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    if ray.is_initialized():
        resources = ray.cluster_resources()
        return ClusterInfo(
            address, resources.get("CPU", 0), resources.get("GPU", 0), False, connected_here=False
        )
    if address is not None:
        check_reachable(address, where)
        try:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        except (ConnectionError, RuntimeError) as exc:
            raise UserInputError(
                f"{where}: could not join the Ray cluster at {address}: {exc}"
            ) from exc
        started = False
    else:
        # "local": a cluster of this job's own. Without an address Ray joins the newest
        # cluster started on the machine (`ray start`; its /tmp/ray/ray_current_cluster, dead
        # or not), where this job's num_cpus cannot apply.
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=True,
        )
        started = True
    resources = ray.cluster_resources()
    info = ClusterInfo(address, resources.get("CPU", 0), resources.get("GPU", 0), started)
    _LOG.info(
        "ray: %s (%g CPUs, %g GPUs)",
        f"joined {address}" if address else "started an embedded local cluster",
        info.num_cpus,
        info.num_gpus,
    )
    return info


# Connections made inside kept_open(), ended when it ends (None: not inside one).
_KEPT: list[ClusterInfo] | None = None


@contextlib.contextmanager
def kept_open() -> Iterator[None]:
    """Ray connections made inside the block outlive the calls that made them, to its end:
    many short jobs in a row (the planner's measurements) share one Ray start instead of
    starting and stopping an embedded cluster each."""
    global _KEPT
    outer, _KEPT = _KEPT, []
    try:
        yield
    finally:
        opened, _KEPT = _KEPT, outer
        for info in opened:
            shutdown(info)


def keeping() -> bool:
    """Whether a :func:`kept_open` block is active."""
    return _KEPT is not None


def shutdown(info: ClusterInfo) -> None:
    """Disconnect the driver if ``info``'s call connected it (which stops an embedded cluster
    it started; a joined cluster keeps running); inside :func:`kept_open`, when the block
    ends."""
    import ray

    if not info.connected_here:
        return
    if _KEPT is not None:
        _KEPT.append(info)
        return
    if ray.is_initialized():
        ray.shutdown()
    if info.started_here:
        _LOG.info("ray: embedded cluster stopped")
