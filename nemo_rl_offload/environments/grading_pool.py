"""Helper processes that grade on their main thread, with a backstop against a stuck grader.

math-verify bounds its own work with ``signal.alarm``, which only works on a process's main
thread; each helper runs one call at a time on its main thread, so those bounds hold there. A
call that still outlives ``backstop_s`` (a grader stuck where no alarm reaches it, a helper that
died) gets the ``failed`` value and the helpers are replaced, so a batch always finishes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.pool import Pool
from typing import Any

__all__ = ["GradingPool"]

# Extra time for the first results of fresh helpers: starting a Python process and importing
# sympy (``warm_up``) takes seconds on a busy machine.
_START_ALLOWANCE_S = 120.0


def _start_helper(warm_up: Callable[[], Any] | None) -> None:
    # Ctrl-C is the parent's to handle; helpers would otherwise each print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if warm_up is not None:
        # A helper failing here would be restarted forever; its calls report the error instead.
        with contextlib.suppress(Exception):
            warm_up()


def _call(job: tuple[Callable[..., Any], tuple[Any, ...], Any]) -> Any:
    fn, args, failed = job
    try:
        return fn(*args)
    except Exception:
        return failed


class GradingPool:
    """``processes`` helper processes (started on first use, with ``spawn``: the parent may run
    threads, which ``fork`` does not copy safely), each running ``warm_up`` (importable by name)
    before its first call. Calls from several threads take turns."""

    def __init__(
        self,
        processes: int,
        backstop_s: float = 60.0,
        warm_up: Callable[[], Any] | None = None,
    ) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.processes = processes
        self.backstop_s = backstop_s
        self.warm_up = warm_up
        self._pool: Pool | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    def map(self, fn: Callable[..., Any], jobs: Sequence[tuple[Any, ...]], failed: Any) -> list:
        """``[fn(*args) for args in jobs]`` in order, graded by the helpers; ``failed`` for a
        call that raised or outlived the backstop. ``fn`` must be importable by name."""
        results: list[Any] = []
        todo = [(fn, tuple(args), failed) for args in jobs]
        with self._lock:
            while todo:
                fresh = self._pool is None
                outputs = self._started().imap(_call, todo, chunksize=1)
                # Helpers take calls in order, so the call waited for has started by the time
                # the ones before it are back: each wait bounds one call's own run time.
                for index in range(len(todo)):
                    starting = fresh and index < self.processes  # a helper's first call
                    wait = self.backstop_s + (_START_ALLOWANCE_S if starting else 0)
                    try:
                        results.append(outputs.next(timeout=wait))
                    except multiprocessing.TimeoutError:
                        results.append(failed)
                        self._stop()
                        todo = todo[index + 1 :]
                        break
                else:
                    todo = []
        return results

    def close(self) -> None:
        """Stop the helpers (the next ``map`` starts new ones)."""
        with self._lock:
            self._stop()

    def _started(self) -> Pool:
        if self._pool is None:
            pool = multiprocessing.get_context("spawn").Pool(
                self.processes, initializer=_start_helper, initargs=(self.warm_up,)
            )
            self._pool = pool
            self._finalizer = weakref.finalize(self, pool.terminate)
        return self._pool

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # terminates the pool, once
        self._pool, self._finalizer = None, None
