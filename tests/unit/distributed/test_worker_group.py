"""The worker group on a real embedded Ray cluster: calls, worker errors, worker death."""

from __future__ import annotations

import os
import socket
import time

import pytest

from nemo_rl_offload.config.cluster_settings import ClusterSettings
from nemo_rl_offload.distributed import cluster, worker_group
from nemo_rl_offload.distributed.worker_group import GroupStopped, WorkerError, WorkerGroup
from nemo_rl_offload.errors import UserInputError

ray = pytest.importorskip("ray")


class EchoWorker:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def whoami(self, suffix: str = "") -> str:
        return f"{self.rank}/{self.world}{suffix}"

    def record(self, tag: str) -> int:
        self.seen = [*getattr(self, "seen", []), tag]
        return len(self.seen)

    def history(self) -> list[str]:
        return getattr(self, "seen", [])

    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad batch on rank {self.rank}")
        time.sleep(0.2)
        return self.rank

    def fail_on_while_others_wait(self, rank: int) -> int:
        """Rank ``rank`` raises; the others wait for it as in a collective (long)."""
        if self.rank == rank:
            raise ValueError(f"bad batch on rank {self.rank}")
        time.sleep(60)
        return self.rank

    def refuse_on(self, rank: int) -> int:
        if self.rank == rank:
            raise UserInputError(f"data.path: rank {self.rank} cannot read it; fix the path")
        time.sleep(0.2)
        return self.rank

    def die_on(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(3)
        time.sleep(30)
        return self.rank


@pytest.fixture(scope="module")
def ray_cluster():
    info = cluster.start_or_join(ClusterSettings(), num_cpus=2, num_gpus=0)
    yield info
    cluster.shutdown(info)


def _group(n=2, **kwargs):
    return WorkerGroup(
        EchoWorker,
        n,
        name="test",
        cpus_per_worker=0.5,
        init_kwargs=lambda rank, world: {"rank": rank, "world": world},
        **kwargs,
    )


def test_calls_reach_every_worker_in_rank_order(ray_cluster):
    group = _group(env_vars={"NVTE_CPU_OFFLOAD_V1": "1"})
    try:
        assert group.run("whoami", "!") == ["0/2!", "1/2!"]
        assert group.run("whoami", per_worker=[(("a",), {}), ((), {"suffix": "b"})]) == [
            "0/2a",
            "1/2b",
        ]
        assert group.run("env", "NVTE_CPU_OFFLOAD_V1") == ["1", "1"]
    finally:
        group.shutdown()


def test_calls_from_two_threads_reach_every_worker_in_the_same_order(ray_cluster):
    """The policy's HTTP server samples from its own thread while the loop trains: workers
    that took two threads' calls in different orders would wait on each other's collectives."""
    import threading

    group = _group()
    try:

        def call(name: str) -> None:
            for index in range(150):
                group.run("record", f"{name}{index}")

        threads = [threading.Thread(target=call, args=(name,)) for name in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first, second = group.run("history")
        assert len(first) == 300 and first == second
    finally:
        group.shutdown()


def test_worker_error_names_rank_and_cause_and_the_group_stays_usable(ray_cluster):
    """A worker that raised is alive, and its peers finished the call: the next call is
    served (the policy's HTTP server keeps serving after one request failed in a worker)."""
    group = _group()
    try:
        with pytest.raises(WorkerError) as caught:
            group.run("fail_on", 1)
        assert caught.value.rank == 1
        assert "ValueError: bad batch on rank 1" in str(caught.value)
        assert group.stopped is None
        assert group.run("whoami") == ["0/2", "1/2"]
    finally:
        group.shutdown()


def test_a_workers_user_input_error_reaches_the_driver_as_it_is(ray_cluster):
    group = _group()
    try:
        with pytest.raises(UserInputError) as caught:
            group.run("refuse_on", 0)
        assert caught.value.problems == ["data.path: rank 0 cannot read it; fix the path"]
        assert group.run_on(1, "whoami") == "1/2"
    finally:
        group.shutdown()


def test_peers_stuck_after_a_worker_error_stop_the_group(ray_cluster, monkeypatch):
    """Peers that do not finish the call (waiting in a collective for the rank that raised)
    are stopped after the grace; the group then refuses calls, naming why."""
    monkeypatch.setattr(worker_group, "FAILED_CALL_GRACE_S", 1.0)
    group = _group()
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        group.run("fail_on_while_others_wait", 0)
    assert caught.value.rank == 0
    assert time.monotonic() - start < 20
    assert "did not finish" in group.stopped
    with pytest.raises(GroupStopped, match="bad batch on rank 0"):
        group.run("whoami")
    with pytest.raises(GroupStopped):
        group.run_on(0, "whoami")


def test_dead_worker_fails_the_call_quickly(ray_cluster):
    group = _group()
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        group.run("die_on", 0)
    assert caught.value.rank == 0 and "died" in str(caught.value)
    assert time.monotonic() - start < 25  # not waiting for the sleeping rank
    assert group.workers == [] and "died" in group.stopped
    with pytest.raises(GroupStopped, match="died"):
        group.run("whoami")


def test_a_worker_that_dies_while_idle_stops_the_group_when_checked(ray_cluster):
    group = _group()
    assert group.check_alive() is None
    ray.kill(group.workers[1], no_restart=True)
    deadline = time.monotonic() + 30
    while group.check_alive(every_s=0) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group.stopped is not None and "worker 1 died" in group.stopped
    assert group.workers == []
    with pytest.raises(GroupStopped):
        group.run("whoami")


def test_too_many_workers_is_a_clear_error(ray_cluster, monkeypatch):
    from nemo_rl_offload.distributed import worker_group

    monkeypatch.setattr(worker_group, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(UserInputError) as caught:
        WorkerGroup(EchoWorker, 3, name="policy", gpus_per_worker=1)
    assert caught.value.problems[0].startswith("cluster: policy needs 3 worker(s)")


def test_unreachable_address_fails_in_seconds(monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(UserInputError) as caught:
        cluster.check_reachable(*_address_and_where())
    assert time.monotonic() - start < 10
    line = caught.value.problems[0]
    assert line.startswith(f"RAY_ADDRESS: cannot reach a Ray cluster at 127.0.0.1:{port}")


def _address_and_where():
    address, where = cluster.requested_address(ClusterSettings())
    return address, where


def test_recipe_address_wins_over_environment(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster.requested_address(ClusterSettings(address="ray://head:10001")) == (
        "ray://head:10001",
        "cluster.address",
    )
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster.requested_address(ClusterSettings()) == (None, "")


@pytest.mark.parametrize(
    "address,expected",
    [("ray://h:10001", ("h", 10001)), ("h:6380", ("h", 6380)), ("h", ("h", 6379)), ("auto", None)],
)
def test_address_parsing(address, expected):
    assert cluster._host_port(address) == expected
