"""Every happens-before edge the offload hooks rely on, checked on CPU.

ANALYSIS

Hooks issue work on three streams: the compute stream (the layers, and reloads issued by
``tensor_pop`` itself), the device-to-host stream ``d2h`` (offload copies) and the host-to-device
stream ``h2d`` (bulk reloads). On a GPU they run concurrently; only the waits order them. Each edge
below is a pair of accesses to the same memory (one a write) that must not overlap, and the
wait or record that orders them:

1. Offload after the compute that produced the tensor (the d2h copy must read the finished
   activation). Enforced at the forward commit: ``d2h.wait_stream(current_stream())`` in
   Megatron's ``ChunkOffloadHandler.on_group_commit_forward``, ``_wait_for(d2h, compute)`` in the
   lean ``OwnedChunkHandler.on_group_commit_forward``. Lost: the host copy holds a partly
   computed activation, and the backward reads it back.
2. Bulk reload after the group's offload (the h2d copy must read a host buffer that the d2h copy
   has finished writing). Enforced by the h2d stream's wait on the group's offload event:
   Megatron's ``bulk_reload_group`` (``wait_offload_event``, not under Megatron's own capture
   flag), the lean ``_lean_bulk_reload_group`` (same wait). The timed
   ``OwnedChunkHandler.bulk_reload_group`` waits too, before its timing event, but Megatron's
   then waits again: that wait only keeps the wait out of the timed interval and is not an edge
   of its own.
3. Reload on the compute stream after the group's offload (Megatron-LM issue 7398): in the
   warm-up step every group is offloaded, and ``tensor_pop`` reloads a group that no bulk reload
   brought back on the compute stream, which never waited for the d2h stream. Enforced by
   ``OwnedChunkHandler.tensor_pop``'s ``wait_offload_event(current_stream)``
   (``reload_waits_for_offload``); Megatron's own ``tensor_pop`` lacks it (shown below). Lost:
   the warm-up step's gradients computed from partly stale activations.
4. Backward use after the group's reload (the backward must read a finished reload). Enforced at
   the backward commit: the compute stream waits for the group's reload event
   (``wait_reload_event(current_stream)``) in Megatron's and the lean
   ``on_group_commit_backward`` (not under Megatron's own capture flag). Lost: gradients from
   partly reloaded activations.
5. A pinned buffer is rewritten by a later offload only after the reload that read it. The pool
   takes a buffer back on the host as soon as the reload is issued (``reload`` frees it to the
   pool), and a later offload may take it at once; its d2h copy is ordered after that reload by
   edge 4 (the compute stream waited for the reload) then edge 1 (the d2h stream waited for the
   compute stream). Lost (either of them): a reload reads a buffer that the next micro-batch's
   offload is overwriting.
6. The device memory of an offloaded tensor is reused only after its d2h copy. The layer drops
   the tensor once it is offloaded; the caching allocator gives its memory to the next compute
   allocation unless the tensor was ``record_stream``-ed on the d2h stream, as Megatron's
   ``bulk_offload_group`` and the lean ``_lean_bulk_offload_group`` do. Lost: the host copy
   holds whatever the next layer wrote there.
7. The device memory of a reloaded tensor is reused by the next reload only after the backward
   used it. A bulk reload allocates on the h2d stream, and its tensor is used and dropped on the
   compute stream (never ``record_stream``-ed there); the next bulk reload may take that memory.
   Enforced at the backward start: ``h2d.wait_stream(current_stream())`` in Megatron's
   ``on_group_start_backward``, ``_wait_for(h2d, compute)`` in the lean one, before the next
   group's reload. Lost: a backward kernel reads an activation that the next reload overwrites.

8. The d2h stream's event records and the reload events (``record_offload_event``,
   ``record_reload_event``) that edges 2, 3 and 4 wait on: recorded after the group's copies in
   Megatron's ``bulk_offload_group`` / ``bulk_reload_group`` and the lean ones. Lost: the wait
   waits for nothing (an event never recorded), or for an earlier step's copies.

Captured steps: the runtime captures whole steps with ``torch.cuda.graph``, which does not set
Megatron's own capture flag (``is_graph_capturing``), so during its capture the lean hooks and
the copy timing step aside (``_lean_now``, ``_timing_wanted``) and Megatron's hooks run with all
the waits above, captured into the graph (checked below). Megatron's own flag, set by its
per-layer graph code, makes Megatron skip the waits of edges 2 and 4; there the fake log shows
those pairs unordered (``max_inflight_offloads`` 0 orders edge 2 through the compute stream,
nothing orders edge 4): that path is Megatron's, not run by the runtime's full-iteration graphs,
and not checked here. ``max_inflight_offloads`` otherwise only adds waits. TE's layer-graph
hooks (``forward_record``, ``backward_record``) are not used by the runtime.

HOW

``tests/support/fake_streams.py`` logs every stream operation with a vector clock and models the
caching allocator's reuse of freed device memory; :func:`run_steps` drives the runtime's manager
and handlers through warm-up and steady steps of two micro-batches as Megatron's layers and
autograd call them; ``FakeCuda.races`` lists every unordered pair of accesses, named by the edge
that should have ordered it. Each edge's test checks that the run has such pairs and that all of
them are ordered, on the lean and Megatron hook paths, timed and not. The deletion tests drop
each wait (or ``record_stream``) at the method that issues it, as if its line were deleted, and
check that the edge's race appears: deleting any one edge fails CI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo
from support.fake_streams import FakeCuda, Race

from nemo_rl_offload.offload import owned

LAYERS = 3
NAMES = ("attn_norm", "core_attn")  # core_attn saves a permuted view, as SDPA does
SHAPE = (4, 8)

OFFLOAD = "offload after the compute that produced the tensor"
BULK_RELOAD = "bulk reload after the group's offload"
RELOAD_7398 = "reload on the compute stream after the group's offload (7398)"
USE = "backward use after the group's reload"
POOL = "pinned buffer rewritten by an offload only after the reload that read it"
RELEASE_OFFLOADED = "device memory of an offloaded tensor reused only after its offload copy"
RELEASE_RELOADED = "device memory of a reloaded tensor reused only after the backward's use"
EDGES = (OFFLOAD, BULK_RELOAD, RELOAD_7398, USE, POOL, RELEASE_OFFLOADED, RELEASE_RELOADED)


def _choices(lean: bool, timed: bool, strided: bool = True) -> owned.PlanChoices:
    """A plan's choices as the runtime makes them (it always waits for the offload on a
    compute-stream reload), with or without lean hooks and copy timing."""
    return owned.PlanChoices(
        reload_waits_for_offload=True,
        strided_copies=strided,
        lean_hooks=lean,
        copy_timer=owned.CopyTimer() if timed else None,
    )


# The hook paths: lean or Megatron's, each timed or not (Megatron's untimed one also without
# strided copies: Megatron's offload and reload, a contiguous() kernel on the d2h stream).
PATHS: dict[str, Callable[[], owned.PlanChoices]] = {
    "lean": lambda: _choices(lean=True, timed=False),
    "lean-timed": lambda: _choices(lean=True, timed=True),
    "megatron": lambda: _choices(lean=False, timed=False, strided=False),
    "megatron-timed": lambda: _choices(lean=False, timed=True),
}


def _forward(manager: Any, cuda: FakeCuda, label: str) -> list[tuple[Any, str, Any]]:
    """One micro-batch's forward as Megatron's model calls the hooks: a handler per
    micro-batch (``GPTModel.preprocess_for_fine_grained_offloading``); per group, its start
    (``fine_grained_offloading_group_start``), the activations autograd saves
    (``on_save_for_backward``) and its commit (``fine_grained_offloading_group_offload``). The
    layer drops an activation once its group is committed: if offloaded, its device memory goes
    back to the allocator."""
    manager.init_model_chunk_offload_handler(0, None, None, min_offloaded_tensor_size=1)
    saved = []
    for layer in range(LAYERS):
        for name in NAMES:
            chunk = manager.pop_forward_chunk(name=name)
            chunk.on_group_start_forward(name)
            produced = cuda.produce(SHAPE, f"{label} layer {layer} {name}")
            tensor = produced.t() if name == "core_attn" else produced
            tag = manager.cur_forward_chunk().tensor_push(tensor)
            manager.cur_forward_chunk().on_group_commit_forward(name, [])
            if chunk.offload_groups[tag[0] - 1]._tensors.get(tag) is not tensor:
                cuda.free(produced)
            saved.append((chunk, name, tag))
    return saved


def _backward(manager: Any, cuda: FakeCuda, saved: list[tuple[Any, str, Any]]) -> None:
    """That micro-batch's backward as autograd calls the hooks: per group, last first, the
    commit's backward (``on_group_commit_backward``), the saved activations unpacked
    (``on_get_saved_tensor``: ``tensor_pop``), used and dropped, then the start's backward
    (``on_group_start_backward``, which reloads the group before)."""
    for chunk, name, tag in reversed(saved):
        chunk.on_group_commit_backward(name)
        tensor = manager.cur_backward_chunk().tensor_pop(tag)
        cuda.use(tensor)
        cuda.free(tensor)
        chunk.on_group_start_backward()


def run_steps(
    monkeypatch: pytest.MonkeyPatch,
    choices: owned.PlanChoices,
    *,
    drop: set[tuple[str, str]] | None = None,
    schedule: str = "interleaved",
    steps: int = 2,
    captured: int | None = None,
) -> FakeCuda:
    """A warm-up step and a steady one of two micro-batches on fake streams: ``interleaved``,
    each micro-batch's backward right after its forward (no pipeline parallelism);
    ``forwards-first``, both forwards then both backwards (a pipeline's warm-up and cool-down,
    where a backward pre-reloads the next micro-batch's last group). ``captured``: the step
    run as the runtime's full-iteration graphs capture it (``torch.cuda.graph``: a stream
    capture, Megatron's own capture flag off)."""
    cuda = FakeCuda(drop=drop)
    cuda.install(monkeypatch)
    monkeypatch.setattr(fgo, "print_offload_summary_table", lambda table: None)
    pool = owned.OwnedHostPool(device="cpu", pin_memory=False)
    manager = owned.OwnedOffloadManager(choices, pool=pool)
    monkeypatch.setattr(fgo.PipelineOffloadManager, "OFFLOAD_MGR", manager)
    with cuda.active():
        for step in range(steps):
            cuda.capturing = step == captured
            cuda.marks.append(len(cuda.ops))
            if schedule == "interleaved":
                for micro_batch in range(2):
                    _backward(
                        manager, cuda, _forward(manager, cuda, f"step {step} mb {micro_batch}")
                    )
            else:
                saved = [_forward(manager, cuda, f"step {step} mb {mb}") for mb in range(2)]
                for each in saved:
                    _backward(manager, cuda, each)
            manager.reset()  # the schedule's off_interface.reset() after the step
    return cuda


_RUNS: dict[tuple[str, str], tuple[dict[str, list[str]], dict[str, int]]] = {}


def _clean_run(monkeypatch: pytest.MonkeyPatch, path: str, schedule: str) -> Any:
    """The races and ordered pairs of a run with every edge in place (one run per path and
    schedule for the whole module: the edge tests read the same log)."""
    key = (path, schedule)
    if key not in _RUNS:
        cuda = run_steps(monkeypatch, PATHS[path](), schedule=schedule)
        _RUNS[key] = (_by_edge(cuda.races()), cuda.ordered_pairs())
    return _RUNS[key]


def _by_edge(races: list[Race]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for race in races:
        found.setdefault(race.edge, []).append(str(race))
    return found


@pytest.mark.parametrize("schedule", ["interleaved", "forwards-first"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("edge", EDGES)
def test_each_edge_orders_its_accesses(monkeypatch, edge, path, schedule):
    """The run has accesses this edge must order (on two streams: the check is not vacuous),
    and every one of them is ordered."""
    races, ordered = _clean_run(monkeypatch, path, schedule)
    assert ordered.get(edge, 0) > 0
    assert races.get(edge, []) == []


@pytest.mark.parametrize("schedule", ["interleaved", "forwards-first"])
@pytest.mark.parametrize("path", list(PATHS))
def test_no_other_access_to_offloaded_memory_is_unordered(monkeypatch, path, schedule):
    """Every pair of accesses of the run belongs to a known edge, and none is a race."""
    races, ordered = _clean_run(monkeypatch, path, schedule)
    assert races == {}
    assert set(ordered) == set(EDGES)


_LEAN, _MEGATRON = "OwnedChunkHandler", "ChunkOffloadHandler"

# Each wait, event record and record_stream the edges rest on, by the method issuing it, and
# the races its deletion leaves (interleaved schedule). The pinned-buffer edge has no operation
# of its own: it rests on the forward commit's and the backward commit's waits together.
DELETIONS: list[tuple[str, str, str, set[str]]] = [
    ("lean", "wait", f"{_LEAN}.on_group_commit_forward", {OFFLOAD, POOL}),
    ("lean", "wait", f"{_LEAN}._lean_bulk_reload_group", {BULK_RELOAD}),
    ("lean", "wait", f"{_LEAN}.tensor_pop", {RELOAD_7398}),
    ("lean", "wait", f"{_LEAN}.on_group_commit_backward", {USE, POOL}),
    ("lean", "wait", f"{_LEAN}.on_group_start_backward", {RELEASE_RELOADED}),
    ("lean", "record_stream", f"{_LEAN}._lean_bulk_offload_group", {RELEASE_OFFLOADED}),
    ("lean", "record", f"{_LEAN}._lean_bulk_offload_group", {BULK_RELOAD, RELOAD_7398}),
    ("lean", "record", f"{_LEAN}._lean_bulk_reload_group", {USE, POOL}),
    ("lean-timed", "wait", f"{_LEAN}._lean_bulk_reload_group", {BULK_RELOAD}),
    ("lean-timed", "wait", f"{_LEAN}.on_group_commit_backward", {USE, POOL}),
    ("megatron", "wait", f"{_MEGATRON}.on_group_commit_forward", {OFFLOAD, POOL}),
    ("megatron", "wait", f"{_MEGATRON}.bulk_reload_group", {BULK_RELOAD}),
    ("megatron", "wait", f"{_LEAN}.tensor_pop", {RELOAD_7398}),
    ("megatron", "wait", f"{_MEGATRON}.on_group_commit_backward", {USE, POOL}),
    ("megatron", "wait", f"{_MEGATRON}.on_group_start_backward", {RELEASE_RELOADED}),
    ("megatron", "record_stream", f"{_MEGATRON}.bulk_offload_group", {RELEASE_OFFLOADED}),
    ("megatron", "record", f"{_MEGATRON}.bulk_offload_group", {BULK_RELOAD, RELOAD_7398}),
    ("megatron", "record", f"{_MEGATRON}.bulk_reload_group", {USE, POOL}),
    ("megatron-timed", "wait", f"{_LEAN}.tensor_pop", {RELOAD_7398}),
    ("megatron-timed", "wait", f"{_MEGATRON}.on_group_commit_backward", {USE, POOL}),
]


@pytest.mark.parametrize(
    ("path", "kind", "site", "edges"),
    DELETIONS,
    ids=[f"{path}:{kind}@{site.split('.')[1]}" for path, kind, site, _ in DELETIONS],
)
def test_deleting_an_edge_is_caught(monkeypatch, path, kind, site, edges):
    """The operation left out, as if its line were deleted: the edges it carries show races."""
    cuda = run_steps(monkeypatch, PATHS[path](), drop={(kind, site)})
    assert any(op.dropped for op in cuda.ops), "the operation was not issued where named"
    assert set(_by_edge(cuda.races())) == edges


def test_every_edge_has_a_deletion_that_is_caught():
    for path in ("lean", "megatron"):
        caught = set().union(*(edges for p, *_, edges in DELETIONS if p == path))
        assert caught == set(EDGES), path


def test_the_timed_bulk_reload_waits_twice_for_one_edge(monkeypatch):
    """With Megatron's hooks and copy timing, the bulk reload waits for the offload before its
    timing event and Megatron's reload waits again: either alone keeps the edge (deleting one
    is no race), both deleted break it."""
    ours, megatrons = (
        ("wait", f"{_LEAN}.bulk_reload_group"),
        ("wait", f"{_MEGATRON}.bulk_reload_group"),
    )
    for drop in ({ours}, {megatrons}):
        assert run_steps(monkeypatch, PATHS["megatron-timed"](), drop=drop).races() == []
    cuda = run_steps(monkeypatch, PATHS["megatron-timed"](), drop={ours, megatrons})
    assert set(_by_edge(cuda.races())) == {BULK_RELOAD}


@pytest.mark.parametrize("lean", [True, False])
def test_megatrons_own_tensor_pop_reloads_before_the_offload_ends(monkeypatch, lean):
    """Megatron-LM issue 7398, as Megatron's code has it (``reload_waits_for_offload`` off):
    the warm-up step's reloads on the compute stream are not ordered after their offload."""
    choices = owned.PlanChoices(lean_hooks=lean)
    races = _by_edge(run_steps(monkeypatch, choices).races())
    assert set(races) == {RELOAD_7398}
    assert all("step 0" in race for race in races[RELOAD_7398])  # the warm-up step only


@pytest.mark.parametrize("path", list(PATHS))
def test_a_captured_step_keeps_every_edge(monkeypatch, path):
    """The runtime captures whole steps with ``torch.cuda.graph``, which does not set
    Megatron's own capture flag: the lean hooks and the copy timing step aside and Megatron's
    hooks run with all their waits (captured into the graph, so every replay keeps them)."""
    cuda = run_steps(monkeypatch, PATHS[path](), steps=3, captured=2)
    assert _by_edge(cuda.races()) == {}
    sites = {(op.kind, op.site) for op in cuda.ops[cuda.marks[2] :]}
    assert not any(site.startswith(f"{_LEAN}._lean") for _, site in sites)
    assert ("wait_stream", f"{_MEGATRON}.on_group_commit_forward") in sites
    assert ("wait", f"{_MEGATRON}.on_group_commit_backward") in sites


# --- the checker itself ----------------------------------------------------------------------


def _offload_one(
    monkeypatch: pytest.MonkeyPatch, order: Callable[[FakeCuda, Any, Any], None]
) -> list[str]:
    """An activation computed, copied to the host on a side stream (after ``order`` ordered
    the streams), dropped, and its memory taken by the next activation: the edges missing."""
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    with cuda.active():
        d2h = torch.cuda.Stream()
        produced = cuda.produce(SHAPE, "x")
        host = torch.empty(SHAPE)
        order(cuda, d2h, produced)
        with torch.cuda.stream(d2h):
            host.copy_(produced)
        produced.record_stream(d2h)
        cuda.free(produced)
        cuda.produce(SHAPE, "next")
    return sorted(_by_edge(cuda.races()))


def test_the_checker_sees_a_copy_that_no_wait_ordered(monkeypatch):
    def wait_stream(cuda: FakeCuda, d2h: Any, produced: Any) -> None:
        d2h.wait_stream(torch.cuda.current_stream())

    def wait_event(cuda: FakeCuda, d2h: Any, produced: Any) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        d2h.wait_event(event)

    def unrecorded_event(cuda: FakeCuda, d2h: Any, produced: Any) -> None:
        d2h.wait_event(torch.cuda.Event())  # nothing recorded: nothing to wait for

    assert _offload_one(monkeypatch, wait_stream) == []
    assert _offload_one(monkeypatch, wait_event) == []
    assert _offload_one(monkeypatch, unrecorded_event) == [OFFLOAD]
    assert _offload_one(monkeypatch, lambda *_: None) == [OFFLOAD]


def test_the_checker_sees_memory_reused_before_a_copy_ends(monkeypatch):
    """Without ``record_stream`` on the copy's stream, the allocator may give the activation's
    memory to the next one while the copy still reads it."""

    def wait_stream(cuda: FakeCuda, d2h: Any, produced: Any) -> None:
        d2h.wait_stream(torch.cuda.current_stream())
        cuda.drop.add(("record_stream", "test"))

    assert _offload_one(monkeypatch, wait_stream) == [RELEASE_OFFLOADED]
