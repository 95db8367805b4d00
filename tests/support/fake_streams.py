"""Fake CUDA streams, events and device memory on CPU, for checking the offload hooks' ordering.

The offload hooks order work on three streams (compute, device-to-host, host-to-device) with
``wait_event``, ``wait_stream``, event records and ``record_stream``; a missing edge corrupts
data only on a GPU, where the streams really run concurrently. Here every stream operation is
logged in issue order with a vector clock (what each stream is known to have finished before
it), so whether one operation happens before another is a property of the log:

- an operation issued on stream S gets S's clock, with S's own count advanced;
- ``event.record(S)`` keeps S's clock in the event; ``S.wait_event(e)`` joins the event's clock
  into S's; ``S.wait_stream(T)`` joins T's clock into S's;
- ``a`` happens before ``b`` when ``b``'s clock has seen ``a``'s position on ``a``'s stream.

Memory is modelled as the GPU has it: tensors that the run made "on the device" (through
:meth:`FakeCuda.produce` or ``torch.empty(..., device="cuda")``) report a ``cuda`` device and
are CPU tensors underneath; copies (``copy_``, ``contiguous``) are logged as reads and writes of
storages on the current stream. A device tensor freed (:meth:`FakeCuda.free`) goes back to the
caching allocator of the stream it was allocated on, which may hand its memory to the next
tensor allocated on that stream: that allocation is logged as a write of the freed memory
("reuse"), ordered after the streams the tensor was ``record_stream``-ed on as of the free (the
allocator holds the block until their work up to then has ended) and nothing else.

:meth:`FakeCuda.races` then lists every pair of operations on the same memory, one a write, that
are not ordered: each is a happens-before edge missing. A stream operation can be dropped by
where it was issued (``drop``: the Megatron or runtime method that issued it), which is how the
tests show that deleting any one edge is caught.

Everything is patched through pytest's ``monkeypatch`` (restored after the test) and a torch
function mode active only inside :meth:`FakeCuda.active`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
from torch.overrides import TorchFunctionMode

from nemo_rl_offload.offload import owned

Clock = dict[str, int]

# Files whose methods count as the site of a stream operation, and the helpers between such a
# method and the stream (the site is the method that called the helper).
_SITE_FILES = (owned.__file__, fgo.__file__)
_HELPERS = frozenset(
    {
        "_wait_for",
        "OffloadTensorGroup.wait_offload_event",
        "OffloadTensorGroup.wait_reload_event",
        "OffloadTensorGroup.record_offload_event",
        "OffloadTensorGroup.record_reload_event",
        "ChunkOffloadHandler.offload",
        "ChunkOffloadHandler.reload",
        "OwnedChunkHandler.offload",
        "OwnedChunkHandler.reload",
        "_Streams.current",
        "_Streams.use",
    }
)


def _join(into: Clock, other: Clock) -> None:
    for stream, count in other.items():
        if into.get(stream, 0) < count:
            into[stream] = count


def _site() -> str:
    """The Megatron or runtime method that issued the stream operation being logged."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename in _SITE_FILES and code.co_qualname not in _HELPERS:
            return code.co_qualname
        frame = frame.f_back
    return "test"


@dataclass
class Op:
    """One logged stream operation. ``kind``: produce (the forward computes an activation),
    use (the backward reads one), d2h / h2d (copies), kernel (another copy kernel), reuse (the
    allocator hands freed memory to a new tensor), record, wait, wait_stream, record_stream,
    free. ``at``: the stream's clock when it was issued."""

    index: int
    stream: str
    kind: str
    site: str
    at: Clock
    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    what: str = ""
    dropped: bool = False


def happens_before(first: Op, second: Op) -> bool:
    """Whether ``first`` has ended before ``second`` starts, by the streams' waits."""
    return second.at.get(first.stream, 0) >= first.at[first.stream]


@dataclass(frozen=True)
class Race:
    """Two operations on the same memory, one a write, not ordered: the edge ``edge`` missing."""

    edge: str
    first: Op
    second: Op

    def __str__(self) -> str:
        return (
            f"{self.edge}: {self.first.kind} on {self.first.stream} ({self.first.site}, "
            f"{self.first.what}) is not ordered before {self.second.kind} on "
            f"{self.second.stream} ({self.second.site}, {self.second.what})"
        )


# The happens-before edges, named by the pair of operations they order.
EDGES = {
    ("produce", "d2h"): "offload after the compute that produced the tensor",
    ("produce", "kernel"): "offload after the compute that produced the tensor",
    ("kernel", "d2h"): "offload after the compute that produced the tensor",
    ("d2h", "h2d@h2d"): "bulk reload after the group's offload",
    ("d2h", "h2d@compute"): "reload on the compute stream after the group's offload (7398)",
    ("h2d", "use"): "backward use after the group's reload",
    ("h2d", "d2h"): "pinned buffer rewritten by an offload only after the reload that read it",
    ("d2h", "reuse"): "device memory of an offloaded tensor reused only after its offload copy",
    ("kernel", "reuse"): "device memory of an offloaded tensor reused only after its offload copy",
    ("use", "reuse"): "device memory of a reloaded tensor reused only after the backward's use",
}


def edge_of(first: Op, second: Op) -> str:
    """The name of the edge that orders ``first`` before ``second``."""
    later = f"{second.kind}@{second.stream}" if second.kind == "h2d" else second.kind
    return EDGES.get((first.kind, later)) or EDGES.get(
        (first.kind, second.kind), f"{first.kind} before {second.kind}"
    )


class FakeEvent:
    """A CUDA event: the clock of the stream it was last recorded on."""

    def __init__(self, cuda: FakeCuda, **_: Any) -> None:
        self.cuda = cuda
        self.clock: Clock | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.cuda._record(self, stream or self.cuda.current)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.cuda.current).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeStream:
    """A CUDA stream: its clock, and the ids ``torch._C``'s stream calls use."""

    def __init__(self, cuda: FakeCuda, name: str, stream_id: int) -> None:
        self.cuda, self.name = cuda, name
        self.stream_id, self.device_index, self.device_type = stream_id, 0, 1
        self.clock: Clock = {name: 0}

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda._wait(self, event.clock, "wait", "event")

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda._wait(self, dict(other.clock), "wait_stream", other.name)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.cuda)
        event.record(self)
        return event

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


@dataclass
class _Block:
    """A device tensor's memory: the stream it was allocated on, and the streams it was
    ``record_stream``-ed on."""

    label: str
    stream: str
    recorded: set[str] = field(default_factory=set)


class FakeCuda:
    """The fake CUDA layer and its log (:attr:`ops`). ``drop``: (kind, site) pairs of stream
    operations to leave out, as if the line issuing them were deleted (kind ``wait`` covers
    ``wait_event`` and ``wait_stream``). ``capturing``: what
    ``torch.cuda.is_current_stream_capturing`` answers (a graph being captured, as the
    runtime's full-iteration graphs capture with ``torch.cuda.graph``); ``megatron_capturing``:
    what Megatron's own capture flag (``is_graph_capturing``) answers, set only by Megatron's
    graph code."""

    def __init__(self, drop: set[tuple[str, str]] | None = None) -> None:
        self.drop = drop or set()
        self.capturing = False
        self.megatron_capturing = False
        self.ops: list[Op] = []
        self.marks: list[int] = []  # where the test marked the log (a step's first op)
        self.streams: dict[int, FakeStream] = {}
        self.compute = self._new_stream("compute")
        self.current = self.compute
        self._names = iter(("d2h", "h2d", "graph"))
        self._blocks: dict[int, _Block] = {}  # device storages by address
        self._freed: dict[str, list[tuple[int, Clock]]] = {}  # per stream: blocks to reuse
        self._labels: dict[int, str] = {}
        self._alive: list[torch.Tensor] = []  # keeps addresses unique for the whole run

    # --- streams and events ----------------------------------------------------------------

    def _new_stream(self, name: str) -> FakeStream:
        stream = FakeStream(self, name, stream_id=len(self.streams) + 1)
        self.streams[stream.stream_id] = stream
        return stream

    def make_stream(self, *args: Any, stream_id: int | None = None, **kwargs: Any) -> FakeStream:
        """``torch.cuda.Stream``: a new stream (d2h, h2d, then others), or the known one of an
        id (what ``_Streams.current`` builds from ``torch._C``'s current-stream ids)."""
        if stream_id is not None:
            return self.streams[stream_id]
        return self._new_stream(next(self._names, f"stream{len(self.streams)}"))

    def _log(self, stream: FakeStream, kind: str, **fields: Any) -> Op:
        stream.clock[stream.name] += 1
        op = Op(len(self.ops), stream.name, kind, _site(), dict(stream.clock), **fields)
        self.ops.append(op)
        return op

    def _record(self, event: FakeEvent, stream: FakeStream) -> None:
        op = self._log(stream, "record")
        if ("record", op.site) in self.drop:
            op.dropped = True
            return
        event.clock = dict(stream.clock)

    def _wait(self, stream: FakeStream, clock: Clock | None, kind: str, what: str) -> None:
        op = self._log(stream, kind, what=what)
        if ("wait", op.site) in self.drop:
            op.dropped = True
        elif clock is not None:  # an event never recorded has nothing to wait for
            _join(stream.clock, clock)

    @contextlib.contextmanager
    def stream_context(self, stream: FakeStream | None) -> Iterator[None]:
        """``torch.cuda.stream``."""
        before = self.current
        self.current = stream or before
        try:
            yield
        finally:
            self.current = before

    # --- memory ----------------------------------------------------------------------------

    def _key(self, tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    def label(self, tensor: torch.Tensor) -> str:
        key = self._key(tensor)
        return self._labels.get(key, f"host buffer {key:#x}")

    def is_device(self, tensor: torch.Tensor) -> bool:
        return self._key(tensor) in self._blocks

    def _allocate(self, tensor: torch.Tensor, label: str) -> None:
        """A new device tensor on the current stream: it may take freed memory of that stream
        (logged as a write of that memory, after the streams it was recorded on)."""
        stream = self.current
        self._alive.append(tensor)
        key = self._key(tensor)
        self._blocks[key] = _Block(label, stream.name)
        self._labels[key] = label
        for freed, held_until in self._freed.pop(stream.name, []):
            op = self._log(stream, "reuse", writes=(freed,), what=self._labels[freed])
            _join(op.at, held_until)

    def produce(self, shape: tuple[int, ...], label: str) -> torch.Tensor:
        """An activation the forward computes on the current stream."""
        tensor = torch.randn(shape)
        self._allocate(tensor, label)
        self._log(self.current, "produce", writes=(self._key(tensor),), what=label)
        return tensor

    def use(self, tensor: torch.Tensor) -> None:
        """The backward reads a saved tensor on the current stream."""
        self._log(self.current, "use", reads=(self._key(tensor),), what=self.label(tensor))

    def free(self, tensor: torch.Tensor) -> None:
        """The last reference to a device tensor is gone: the caching allocator of its stream
        may give its memory to the next tensor allocated there, once the work issued so far on
        the streams it was recorded on has ended."""
        key = self._key(tensor)
        block = self._blocks[key]
        held_until: Clock = {}
        for name in block.recorded:
            stream = next(s for s in self.streams.values() if s.name == name)
            _join(held_until, stream.clock)
        self._freed.setdefault(block.stream, []).append((key, held_until))

    def _record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        op = self._log(stream, "record_stream", what=self.label(tensor))
        if ("record_stream", op.site) in self.drop:
            op.dropped = True
            return
        block = self._blocks.get(self._key(tensor))
        if block is not None and stream.name != block.stream:
            block.recorded.add(stream.name)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        to_device, from_device = self.is_device(dst), self.is_device(src)
        kind = {(False, True): "d2h", (True, False): "h2d"}.get((to_device, from_device), "kernel")
        what = f"{self.label(src)} -> {self.label(dst)}"
        self._log(self.current, kind, reads=(self._key(src),), writes=(self._key(dst),), what=what)

    # --- the check -------------------------------------------------------------------------

    def races(self) -> list[Race]:
        """Every pair of operations on the same memory, one of them a write, in issue order,
        whose first does not happen before the second."""
        found: list[Race] = []
        touching: dict[int, list[Op]] = {}
        for op in self.ops:
            for key in {*op.reads, *op.writes}:
                for earlier in touching.get(key, []):
                    writes = key in op.writes or key in earlier.writes
                    if writes and not happens_before(earlier, op):
                        found.append(Race(edge_of(earlier, op), earlier, op))
                touching.setdefault(key, []).append(op)
        return found

    def ordered_pairs(self) -> dict[str, int]:
        """How many pairs of operations on two streams each edge ordered (the checks are not
        vacuous); pairs on one stream are ordered by the stream itself."""
        counts: dict[str, int] = {}
        touching: dict[int, list[Op]] = {}
        for op in self.ops:
            for key in {*op.reads, *op.writes}:
                for earlier in touching.get(key, []):
                    if earlier.stream == op.stream:
                        continue
                    if key in op.writes or key in earlier.writes:
                        edge = edge_of(earlier, op)
                        counts[edge] = counts.get(edge, 0) + 1
                touching.setdefault(key, []).append(op)
        return counts

    # --- installation ----------------------------------------------------------------------

    def install(self, monkeypatch: Any) -> None:
        """Patch torch.cuda's streams and events, the ``torch._C`` stream calls the lean hooks
        use, ``Tensor.record_stream``, the capture checks, and the runtime's stream caches
        (fresh for this run), all through ``monkeypatch``."""
        cuda = self
        monkeypatch.setattr(torch.cuda, "Stream", self.make_stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(cuda, **k))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: cuda.current)
        monkeypatch.setattr(torch.cuda, "stream", self.stream_context)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: cuda.capturing)
        monkeypatch.setattr(fgo, "is_graph_capturing", lambda: cuda.megatron_capturing)
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
        monkeypatch.setattr(
            torch._C,
            "_cuda_getCurrentStream",
            lambda device: (cuda.current.stream_id, 0, 1),
            raising=False,
        )

        def set_stream(stream_id: int, device_index: int, device_type: int) -> None:
            cuda.current = cuda.streams[stream_id]

        monkeypatch.setattr(torch._C, "_cuda_setStream", set_stream, raising=False)
        monkeypatch.setattr(
            torch.Tensor,
            "record_stream",
            lambda tensor, stream: cuda._record_stream(tensor, stream),
        )
        monkeypatch.setattr(fgo, "nvtx_range_push", lambda *a, **k: None)
        monkeypatch.setattr(fgo, "nvtx_range_pop", lambda *a, **k: None)
        monkeypatch.setattr(owned, "_STREAMS", owned._Streams())
        monkeypatch.setattr(owned, "_WAITED", {})

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Device tensors and their copies logged (a torch function mode)."""
        with _DeviceMode(self):
            yield


_DEVICE_GETTER = torch.Tensor.device.__get__
_ALLOCATORS = (torch.empty, torch.empty_strided, torch.empty_like)


class _DeviceMode(TorchFunctionMode):
    """Device tensors of a :class:`FakeCuda`: their ``device`` is ``cuda``; allocations on
    ``cuda`` are CPU tensors noted as device ones; copies are logged on the current stream."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        cuda = self.cuda
        if func == _DEVICE_GETTER and cuda.is_device(args[0]):
            return torch.device("cuda")
        if func in _ALLOCATORS and torch.device(kwargs.get("device") or "cpu").type == "cuda":
            kwargs["device"] = "cpu"
            result = func(*args, **kwargs)
            cuda._allocate(result, f"reloaded #{len(cuda._alive)}")
            return result
        if func is torch.Tensor.copy_:
            cuda._copy(args[0], args[1])
            return func(*args, **kwargs)
        if func is torch.Tensor.contiguous and cuda.is_device(args[0]):
            result = func(*args, **kwargs)
            if result is not args[0]:
                cuda._allocate(result, f"contiguous {cuda.label(args[0])}")
                cuda._copy(result, args[0])
            return result
        return func(*args, **kwargs)
