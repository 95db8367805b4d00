"""Why a measured case failed, as data: the benchmark's child processes and the planner's trials
record it, and their tables print it.

A failed case must tell an out-of-memory (a plan that does not fit, with the sizes PyTorch
reported) from a bug (the exception's type and message). The last line a failed process wrote
to stderr says neither: it is often a warning printed while the process shuts down (NCCL's,
for one). So the process that ran the case describes the exception itself
(:func:`from_exception`), and a parent that only has text (a worker's error through Ray, a
child that died before it could write) parses the exception back out of it (:func:`from_text`).

No torch import here: the parent of the benchmark's children and the tests read these records
without it. An out-of-memory is recognised by the exception's class name and torch's message.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

OOM_TYPES = frozenset({"OutOfMemoryError", "OutOfMemory"})
_UNITS = {"bytes": 1 / 2**30, "B": 1 / 2**30, "KiB": 1 / 2**20, "MiB": 1 / 2**10, "GiB": 1.0}
_SIZE = r"([\d.]+) ?(bytes|B|KiB|MiB|GiB)"
# The sizes torch's caching allocator puts in its out-of-memory message, as GiB.
_OOM_SIZES = {
    "tried_gib": rf"Tried to allocate {_SIZE}",
    "total_gib": rf"total capacity of {_SIZE}",
    "free_gib": rf"of which {_SIZE} is free",
    "in_use_gib": rf"this process has {_SIZE} memory in use",
    "allocated_gib": rf"{_SIZE} is allocated by PyTorch",
    "reserved_unallocated_gib": rf"{_SIZE} is reserved by PyTorch but unallocated",
}
# "SomeError: message" as Python prints an exception's last traceback line.
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception|Exit|Interrupt)): ?(.*)$")


@dataclass(frozen=True)
class Failure:
    """A failed case: the exception's class name and message, and for an out-of-memory the
    sizes the allocator reported (GiB; only those its message gave)."""

    type: str
    message: str
    oom: dict[str, float] | None = None

    def summary(self) -> str:
        """One line for a table or a log."""
        if self.oom is not None:
            return "out of memory: " + (oom_sizes_text(self.oom) or _first_line(self.message))
        return f"{self.type}: {_first_line(self.message)}".rstrip(": ")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Failure:
        return cls(str(data["type"]), str(data["message"]), data.get("oom"))


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _gib(number: str, unit: str) -> float:
    return float(number) * _UNITS[unit]


def parse_oom_sizes(message: str) -> dict[str, float]:
    """The sizes in torch's out-of-memory message, GiB (empty when it gives none)."""
    sizes = {}
    for key, pattern in _OOM_SIZES.items():
        found = re.search(pattern, message)
        if found:
            sizes[key] = _gib(found[1], found[2])
    return sizes


# How oom_sizes_text words each size, in its order.
_OOM_WORDS = (
    ("tried_gib", "tried to allocate {:.2f} GiB"),
    ("total_gib", "{:.2f} GiB total"),
    ("free_gib", "{:.2f} GiB free"),
    ("allocated_gib", "{:.2f} GiB allocated by PyTorch"),
    ("reserved_unallocated_gib", "{:.2f} GiB reserved but unallocated"),
)


def oom_sizes_text(sizes: dict[str, float]) -> str:
    return "; ".join(words.format(sizes[key]) for key, words in _OOM_WORDS if key in sizes)


def _is_oom(type_name: str, message: str) -> bool:
    return type_name in OOM_TYPES or "out of memory" in message.lower()


def describe(type_name: str, message: str) -> Failure:
    """A failure from an exception's class name and message."""
    oom = parse_oom_sizes(message) if _is_oom(type_name, message) else None
    return Failure(type_name, message.strip(), oom)


def from_exception(exc: BaseException) -> Failure:
    """The failure an exception raised (an exception a worker raised through Ray is read from
    its text: :func:`from_text`)."""
    cause = getattr(exc, "error", None)  # distributed.worker_group.WorkerError's worker text
    if isinstance(cause, str):
        return from_text(cause)
    return describe(type(exc).__name__, str(exc))


def from_text(text: str) -> Failure:
    """A failure parsed out of text: a worker's error as ``Type: message (at file:line in f)``,
    or a process's stderr, whose last exception line wins (warnings printed while the process
    shut down come after it). Text with no exception in it is kept as it is."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for index in range(len(lines) - 1, -1, -1):
        found = _EXCEPTION_LINE.match(lines[index])
        if found:
            # A message may span lines (torch's out-of-memory hint does).
            message = " ".join([found[2], *lines[index + 1 : index + 3]])
            if not _is_oom(found[1], message):
                message = found[2]
            return describe(found[1], message)
    if any("out of memory" in line.lower() for line in lines):
        joined = " ".join(lines)
        return Failure("OutOfMemoryError", joined, parse_oom_sizes(joined))
    return Failure("unknown", lines[-1] if lines else "no output")
