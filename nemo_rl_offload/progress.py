"""Progress lines for a job's long phases, as tqdm users expect: where the job is, on stderr.

A step's phases can each run for minutes; without a line the job looks hung. A
:class:`Progress` prints a line when a phase starts, at most one per interval, and one when a
long phase ends. Examples and settings: docs/telemetry.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

INTERVAL_ENV = "NEMO_RL_OFFLOAD_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 10.0
# How often a heartbeat thread looks whether a line is due (a fraction of the interval).
_HEARTBEAT_CHECKS_PER_INTERVAL = 10


def interval_from_env(environ: dict[str, str] | None = None) -> float | None:
    """The interval ``NEMO_RL_OFFLOAD_PROGRESS_INTERVAL_S`` asks for: seconds, None for no
    lines (0 or ``off``); a value that is not a number is said once and the default used."""
    raw = (os.environ if environ is None else environ).get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    if raw.lower() == "off":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        print(
            f"warning: {INTERVAL_ENV}={raw!r} is not a number of seconds; progress lines every "
            f"{DEFAULT_INTERVAL_S:g} s",
            file=sys.stderr,
        )
        return DEFAULT_INTERVAL_S
    return seconds if seconds > 0 else None


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def _number(value: float) -> str:
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _field(name: str, value: Any) -> str:
    """``new_tokens_per_s=1840.2`` as ``1,840 new tokens/s``; a text value after its name."""
    words = name.replace("_per_s", "/s").replace("_", " ")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{words} {value}"
    return f"{_number(value)} {words}"


class Progress:
    """A rate-limited reporter of one phase at a time, its lines prefixed ``[label]``.

    ``start(phase, total, unit=...)`` begins a phase (ending the one before), ``update(done,
    **fields)`` reports how far it is (printed when the interval has passed since the last
    line), ``finish()`` ends it. ``interval_s``: None reads ``NEMO_RL_OFFLOAD_PROGRESS_INTERVAL_S``;
    ``enabled=False`` prints nothing (a rank that does not report). Safe to call from several
    threads. From a worker's own loop (the driver announced the phase)::

        progress = Progress(f"policy rank 0, step {step}", enabled=rank == 0)
        progress.start("generation", rows, unit="rows", announce=False)
        ...  # each iteration: progress.update(done, new_tokens_per_s=rate)
        progress.finish(rows)
    """

    def __init__(
        self,
        label: str = "",
        *,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
        heartbeat: bool = False,
        enabled: bool = True,
    ) -> None:
        self.label = label
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self.enabled = enabled and self.interval_s is not None and self.interval_s > 0
        self._clock = clock
        self._stream = stream
        self._heartbeat = heartbeat
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._phase: str | None = None
        self._prefix = ""
        self._total: int | None = None
        self._unit = ""
        self._done: int | None = None
        self._fields: dict[str, Any] = {}
        self._started = 0.0
        self._last_line = 0.0

    # ------------------------------------------------------------------ the phase
    def start(
        self,
        phase: str,
        total: int | None = None,
        *,
        unit: str = "",
        announce: bool = True,
    ) -> None:
        """Begin ``phase`` (of ``total`` ``unit``s when known) and print its first line, unless
        ``announce`` is False (someone else said it started: the worker's half of a phase
        the driver announced); the phase before it ends first."""
        if not self.enabled:
            return
        self.finish()
        with self._lock:
            now = self._clock()
            self._phase, self._total, self._unit = phase, total, unit
            self._prefix = f"[{self.label}] " if self.label else ""
            self._done, self._fields = None, {}
            self._started = self._last_line = now
            if announce:
                size = f": {total:,} {unit}".rstrip() if total is not None else ""
                self._write(f"{self._prefix}{phase}{size} ...")
        if self._heartbeat:
            self._start_thread()

    def update(self, done: int | None = None, **fields: Any) -> None:
        """How far the phase is (``done`` of its total) and anything else worth saying
        (``new_tokens_per_s=...``); a line when the interval has passed since the last."""
        if not self.enabled:
            return
        with self._lock:
            if self._phase is None:
                return
            if done is not None:
                self._done = done
            self._fields.update(fields)
            self._line_if_due()

    def tick(self) -> None:
        """The heartbeat: the phase's last known state, when a line is due."""
        if not self.enabled:
            return
        with self._lock:
            if self._phase is not None:
                self._line_if_due()

    def finish(self, done: int | None = None, **fields: Any) -> None:
        """End the phase (``done``, ``fields``: its last state); its last line only when it
        ran for an interval or longer (a phase that was never slow says nothing more than its
        start)."""
        if not self.enabled:
            return
        with self._lock:
            if self._phase is None:
                return
            if done is not None:
                self._done = done
            self._fields.update(fields)
            elapsed = self._clock() - self._started
            if self.interval_s is not None and elapsed >= self.interval_s:
                state = self._state()
                self._write(
                    f"{self._prefix}{self._phase}: finished"
                    f"{', ' + state if state else ''} ({_duration(elapsed)})"
                )
            self._phase = None

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None, *, unit: str = "") -> Iterator[None]:
        """``with progress.phase("checkpoint save"):`` start, then finish however it ends."""
        self.start(name, total, unit=unit)
        try:
            yield
        finally:
            self.finish()

    def close(self) -> None:
        """End the phase and stop the heartbeat thread (safe to call twice)."""
        self.finish()
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    # ------------------------------------------------------------------ printing
    def _state(self) -> str:
        parts = []
        if self._done is not None:
            of = f"/{self._total:,}" if self._total is not None else ""
            unit = f" {self._unit}" if self._unit else ""
            parts.append(f"{self._done:,}{of}{unit} done")
        parts += [_field(name, value) for name, value in self._fields.items()]
        return ", ".join(parts)

    def _line_if_due(self) -> None:
        now = self._clock()
        if self.interval_s is None or now - self._last_line < self.interval_s:
            return
        self._last_line = now
        state = self._state() or "running"
        self._write(f"{self._prefix}{self._phase}: {state} ({_duration(now - self._started)})")

    def _write(self, line: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        with contextlib.suppress(OSError, ValueError):  # a closed stream must not end the job
            stream.write(line + "\n")
            stream.flush()

    def _start_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        wait_s = (self.interval_s or DEFAULT_INTERVAL_S) / _HEARTBEAT_CHECKS_PER_INTERVAL
        stop = self._stop

        def beat() -> None:
            while not stop.wait(wait_s):
                self.tick()

        self._thread = threading.Thread(target=beat, name="progress-heartbeat", daemon=True)
        self._thread.start()
