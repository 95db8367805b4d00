"""A group of Ray actors that act as one: placed together, called together, failing together.

Workers are placed through one placement group (one bundle per worker) so tensor- and
pipeline-parallel ranks land on the GPUs of one host. Every call goes to all workers and waits
for all of them; if any worker raises or dies, the whole call fails with that worker's rank and
error. A worker that raised is still alive: when every other worker also finishes the call
within :data:`FAILED_CALL_GRACE_S` (they raised too, or returned), the workers agree on where
they are and the group stays usable (a request the policy's HTTP server could not sample must
not end the server). A worker that died, or peers that do not finish (waiting in a collective
for the rank that raised), stop the whole group, so a job never hangs on a dead rank; a call to
a stopped group raises :class:`GroupStopped` naming why it stopped.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_rl_offload.errors import UserInputError

_LOG = logging.getLogger("nemo_rl_offload.workers")
PLACEMENT_TIMEOUT_S = 60.0
# How long the other workers may take to finish a call after one raised in it, before the group
# is taken as stuck (they wait in a collective for that rank) and stopped.
FAILED_CALL_GRACE_S = 30.0


class WorkerError(RuntimeError):
    """A worker raised or died; the message names its rank and carries its error."""

    def __init__(self, group: str, rank: int, error: str) -> None:
        self.group, self.rank, self.error = group, rank, error
        super().__init__(f"{group} worker {rank} failed: {error}")


class GroupStopped(WorkerError):
    """A call to a group whose workers were stopped: ``why`` is the failure that stopped them
    (or that the group was shut down)."""

    def __init__(self, group: str, why: str) -> None:
        self.why = why
        RuntimeError.__init__(self, f"{group} workers were stopped ({why})")
        self.group, self.rank, self.error = group, -1, why


def _error_text(exc: BaseException) -> str:
    """The useful part of a Ray error: the worker's own exception, not Ray's wrapping."""
    import ray.exceptions

    if isinstance(exc, ray.exceptions.RayTaskError):
        inner = getattr(exc, "cause", None)
        text = f"{type(inner).__name__}: {inner}" if inner is not None else str(exc)
        trace = str(exc)  # Ray's text of the worker's traceback, then its error
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
        if frames:  # where in the worker it happened: the innermost frame
            path, line, function = frames[-1]
            text += f" (at {Path(path).name}:{line} in {function})"
        _LOG.debug("worker traceback:\n%s", trace)
        return text.strip()
    if isinstance(exc, ray.exceptions.RayActorError):
        return "the worker process died (" + " ".join(str(exc).split())[:400] + ")"
    return f"{type(exc).__name__}: {exc}"


def _user_input_problems(exc: BaseException) -> list[str]:
    """The lines of a UserInputError that a worker raised (empty for any other error): they
    reach the user as they are, like one raised in the driver."""
    import ray.exceptions

    inner = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else exc
    return list(inner.problems) if isinstance(inner, UserInputError) else []


class WorkerGroup:
    """``num_workers`` Ray actors of ``worker_cls``, one per placement-group bundle."""

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *,
        name: str,
        gpus_per_worker: float = 0,
        cpus_per_worker: float = 1,
        env_vars: dict[str, str] | None = None,
        init_kwargs: Callable[[int, int], dict[str, Any]] = lambda rank, world: {},
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name
        # Why the workers were stopped (None while they run).
        self.stopped: str | None = None
        self._checked_at = -float("inf")
        # Calls are submitted to every worker under this lock: two threads calling the group
        # (the policy's HTTP server sampling while the loop trains) must reach all workers in
        # the same order, or their collectives would wait on each other.
        self._submitting = threading.Lock()
        bundle: dict[str, float] = {"CPU": cpus_per_worker}
        if gpus_per_worker:
            bundle["GPU"] = gpus_per_worker
        self._placement = placement_group([dict(bundle) for _ in range(num_workers)], "PACK")
        ready, _ = ray.wait([self._placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self._placement)
            available = ray.available_resources()
            raise UserInputError(
                f"cluster: {name} needs {num_workers} worker(s) of {bundle} but the Ray cluster "
                f"has {{CPU: {available.get('CPU', 0):g}, GPU: {available.get('GPU', 0):g}}} "
                "free; lower the worker count or add resources"
            )
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=cpus_per_worker,
                num_gpus=gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": dict(env_vars)} if env_vars else None,
                name=None,
            ).remote(**init_kwargs(rank, num_workers))
            for rank in range(num_workers)
        ]

    def __len__(self) -> int:
        return len(self.workers)

    def run(
        self,
        method: str,
        *args: Any,
        per_worker: Sequence[tuple[tuple, dict]] | None = None,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``method`` on every worker (the same arguments, or ``per_worker[rank]``) and
        return the results in rank order. Raises WorkerError as soon as any worker fails
        (UserInputError when that failure is one: a problem in the user's input)."""
        futures = []
        with self._submitting:
            self._check_running()
            for rank, worker in enumerate(self.workers):
                call_args, call_kwargs = (
                    per_worker[rank] if per_worker is not None else (args, kwargs)
                )
                futures.append(getattr(worker, method).remote(*call_args, **call_kwargs))
        return self._gather(futures, method, timeout_s)

    def run_on(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on one worker only (with the same failure handling as :meth:`run`)."""
        with self._submitting:
            self._check_running()
            future = getattr(self.workers[rank], method).remote(*args, **kwargs)
        return self._gather([future], method, None, ranks=[rank])[0]

    def check_alive(self, *, every_s: float = 1.0) -> str | None:
        """Why the group is stopped, or None while its workers live: each worker's state is
        looked up in Ray's control store (at most every ``every_s``), not asked of the worker,
        so a long call in progress is no sign of death; a worker that died while idle stops
        the group here rather than at the next call (``nemo-rl-offload serve``'s watch)."""
        now = time.monotonic()
        if self.stopped is not None or now - self._checked_at < every_s:
            return self.stopped
        self._checked_at = now
        from ray._private import state  # Ray's actor table (ray.state.actors before Ray 2)

        for rank, worker in enumerate(list(self.workers)):
            try:
                info = state.actors(actor_id=worker._actor_id.hex())
            except Exception:  # the control store did not answer: no news of a death
                return None
            if info.get("State") == "DEAD":
                cause = " ".join(str(info.get("DeathCause") or "").split())[:300]
                self._stop(f"{self.name} worker {rank} died ({cause or 'no cause given'})")
                _LOG.error("%s", self.stopped)
                break
        return self.stopped

    def _check_running(self) -> None:
        if self.stopped is not None:
            raise GroupStopped(self.name, self.stopped)

    def _gather(
        self,
        futures: list[Any],
        method: str,
        timeout_s: float | None,
        ranks: list[int] | None = None,
    ) -> list[Any]:
        import ray

        ranks = ranks if ranks is not None else list(range(len(futures)))
        rank_of = dict(zip(futures, ranks, strict=True))
        results: dict[int, Any] = {}
        pending = list(futures)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait_s = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            done, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            for future in done:
                rank = rank_of[future]
                try:
                    results[rank] = ray.get(future)
                except Exception as exc:  # the worker's error or its death
                    self._fail(exc, rank, method, [f for f in pending if f is not future])
            if deadline is not None and time.monotonic() > deadline and pending:
                rank = rank_of[pending[0]]
                error = WorkerError(self.name, rank, f"{method} did not finish in {timeout_s:g} s")
                self._stop(str(error))
                raise error
        return [results[rank] for rank in ranks]

    def _fail(self, exc: Exception, rank: int, method: str, pending: list[Any]) -> None:
        """Raise the call's error for ``exc`` of worker ``rank``: after the other workers
        finish the call (the group stays usable), or with the group stopped when the worker
        died or the others do not finish in time."""
        import ray
        import ray.exceptions

        problems = _user_input_problems(exc)
        error: Exception = (
            UserInputError(problems) if problems else WorkerError(self.name, rank, _error_text(exc))
        )
        _LOG.error("%s (in %s)", error, method)
        if not isinstance(exc, ray.exceptions.RayTaskError):  # the worker died (or Ray lost it)
            self._stop(str(error))
            raise error from None
        if pending:
            _, stuck = ray.wait(pending, num_returns=len(pending), timeout=FAILED_CALL_GRACE_S)
            if stuck:  # waiting for the rank that raised (a collective): the group is stuck
                self._stop(f"{error}; the other workers did not finish {method}")
                raise error from None
            for future in pending:
                try:
                    ray.get(future)
                except ray.exceptions.RayTaskError:  # raised too: alive, and done with the call
                    pass
                except Exception:  # a peer that died meanwhile stops the group
                    self._stop(str(error))
                    raise error from None
        raise error from None

    def _stop(self, why: str) -> None:
        self.shutdown()
        self.stopped = why

    def shutdown(self) -> None:
        """Stop every worker and release their resources (safe to call twice)."""
        import ray

        self.stopped = self.stopped or "shut down"
        for worker in self.workers:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(worker, no_restart=True)
        self.workers = []
        if self._placement is not None:
            with contextlib.suppress(Exception):  # already removed
                ray.util.remove_placement_group(self._placement)
            self._placement = None
