"""Where an offloading step's extra time goes: one profiled training step per case.

For each case of benchmarks/offload_benchmark.py named on the command line, the policy worker
trains a few steps (plans recorded, buffers allocated), then one step runs under torch's
profiler. From the trace's GPU timeline the step is split into:

- ``compute_busy_s``: the union of all kernels (a CUDA graph runs one step's kernels on several
  streams); ``side_stream_kernel_s``: kernel time off the busiest stream (in an eager step,
  kernels on the copy streams);
- ``idle_s``: the step window minus that, split by what the copy engines did meanwhile:
  ``idle_during_h2d_s`` (compute waiting while a reload runs: a reload on the critical path),
  ``idle_during_d2h_s`` (an offload copy runs, no reload), ``idle_no_copy_s`` (nothing on the
  GPU: the CPU is behind, launching kernels or running the offload hooks);
- ``idle_host_behind_s``: the idle stretches the host caused, across those three (the kernel
  that ends the stretch was launched after it began: the GPU had run out of queued work);
- copy-engine busy time per direction and with both directions at once
  (``both_directions_busy_s``: they then share the link), kernel count, and the host calls
  that block (syncs).

With ``--host``, no profiler runs: each case trains ``--host-steps`` more steps with a clock
around every entry point of Megatron's offload hooks (``perf_counter``, about a microsecond
per call), and reports per step (medians): the step's forward-backward GPU time, the host time
until Megatron's schedule returned (the CPU has issued the whole step by then), and the host
seconds spent inside the hooks, by entry point. A step whose host time reaches its GPU time is
host-bound: there, every microsecond of hook work is a microsecond of step time. With
``--host-detail`` it also clocks the functions the hooks call (``inner ...``, overlapping the
hooks' seconds) and the host calls that wait for the GPU (``sync ...``: event and stream
synchronize, ``item``, ``tolist``, ``cpu``), wherever they are called from. With ``--phases``
(:class:`PhaseClock`) each step's record also lists every micro-batch's forward and backward:
the host's time in it, the GPU's, and how far the GPU was behind when the host began it.

With ``--python``, one more step runs under cProfile: where the host's time goes by Python
function (``python_top``: the functions with the most own time; ``python_offload``: the
cumulative time of Megatron's offload hooks and this package's offload runtime), which the GPU
timeline shows only as "CPU behind".

With ``--profiled-steps N``, N consecutive steps run under the profiler and each gets its own
split (``per_step``, beside each step's forward-backward time): slow steps set beside fast ones
show where a step-to-step spread comes from. ``--recipe`` runs the cases on a recipe's policy,
as offload_benchmark.py's does.

Output: ``profile_<model>_seq<N>.json`` in --out (one summary per case) and a gzipped Chrome
trace per case, loadable in chrome://tracing or Perfetto; with ``--host``,
``host_<model>_seq<N>.json`` (the medians per case); with ``--python``, the cProfile profile of
the step per case (``pstats_<model>_seq<N>_<case>.prof``).

Run on a GPU machine:
    python3 benchmarks/profile_offload_step.py --model llama-1b --seq 4096 \\
        --cases no_offload,fgo_norms,fgo_all5 --out /tmp/profile
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gzip
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offload_benchmark as bench  # noqa: E402  (the benchmark's cases and batches)

Interval = tuple[float, float]
BLOCKING_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaMalloc",
    "cudaFree",
)


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _complement(intervals: list[Interval], window: Interval) -> list[Interval]:
    gaps, cursor = [], window[0]
    for start, end in intervals:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < window[1]:
        gaps.append((cursor, window[1]))
    return gaps


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


# The host's CUDA calls in a trace: the runtime API's and the driver API's (cuBLASLt's GEMMs and
# Triton's kernels are launched through the driver: without it their launch time is unknown).
HOST_API = ("cuda_runtime", "cuda_driver")


def _calls_between(
    starts: list[tuple[float, float | None, str]],
    index: int,
    host_calls: list[tuple[float, str]],
    call_times: list[float],
) -> list[str]:
    """The CUDA calls (runtime and driver API) the host made after launching kernel
    ``index - 1`` and before launching kernel ``index`` (the first 12 names, each with its
    count), or [] when either launch time is unknown."""
    if index <= 0 or index >= len(starts):
        return []
    before, after = starts[index - 1][1], starts[index][1]
    if before is None or after is None:
        return []
    low, high = bisect.bisect_right(call_times, before), bisect.bisect_left(call_times, after)
    counts: dict[str, int] = {}
    for _, name in host_calls[low:high]:
        counts[name] = counts.get(name, 0) + 1
    return [f"{name} x{count}" for name, count in list(counts.items())[:12]]


def summarise_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The step's GPU timeline split as the module docstring says (times in seconds)."""
    kernels: dict[Any, list[Interval]] = {}
    copies: dict[str, list[Interval]] = {"d2h": [], "h2d": []}
    blocking: dict[str, list[float]] = {}
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        span = (event["ts"] * 1e-6, (event["ts"] + event["dur"]) * 1e-6)
        category, name = event.get("cat", ""), event.get("name", "")
        if category == "kernel":
            kernels.setdefault(event.get("args", {}).get("stream"), []).append(span)
        elif category == "gpu_memcpy":
            if "DtoH" in name or "Device -> Pinned" in name:
                copies["d2h"].append(span)
            elif "HtoD" in name or "Pinned -> Device" in name:
                copies["h2d"].append(span)
        elif category == "cuda_runtime" and name.startswith(BLOCKING_CALLS):
            blocking.setdefault(name, []).append(event["dur"] * 1e-6)
    if not kernels:
        return {"error": "no kernels in the trace"}
    launches = {
        event["args"]["correlation"]: event["ts"] * 1e-6
        for event in events
        if event.get("cat") in HOST_API and "correlation" in event.get("args", {})
    }
    host_calls = sorted(
        (event["ts"] * 1e-6, str(event.get("name", "")))
        for event in events
        if event.get("cat") in HOST_API and event.get("ph") == "X"
    )
    call_times = [at for at, _ in host_calls]
    compute_stream = max(kernels, key=lambda stream: _length(bench.union(kernels[stream])))
    compute = bench.union([span for spans in kernels.values() for span in spans])
    every_gpu_span = [s for spans in kernels.values() for s in spans] + [
        s for spans in copies.values() for s in spans
    ]
    window = (min(s[0] for s in every_gpu_span), max(s[1] for s in every_gpu_span))
    idle = _complement(compute, window)
    d2h, h2d = bench.union(copies["d2h"]), bench.union(copies["h2d"])
    idle_h2d = _length(_intersect(idle, h2d))
    idle_d2h_only = _length(_intersect(_complement(h2d, window), _intersect(idle, d2h)))
    idle_total = _length(idle)
    # An idle stretch the host caused: the kernel that ends it was launched after it began
    # (the GPU had run out of work). Otherwise the kernel was queued and waited on an event.
    starts = sorted(
        (
            event["ts"] * 1e-6,
            launches.get(event.get("args", {}).get("correlation")),
            str(event.get("name", "")),
        )
        for event in events
        if event.get("cat") == "kernel" and event.get("ph") == "X"
    )
    next_kernel = [start for start, _, _ in starts]
    names = [name for _, _, name in starts]
    host_behind = 0.0
    stretches = []
    for gap_start, gap_end in idle:
        index = bisect.bisect_left(next_kernel, gap_end)
        behind = (
            index < len(starts) and starts[index][1] is not None and starts[index][1] > gap_start
        )
        if behind:
            host_behind += gap_end - gap_start
        stretches.append((gap_end - gap_start, gap_start, index, behind))
    # The longest idle stretches, where in the step and what ended them: a stretch that ends
    # with a kernel queued before it began waited on an event (a copy, another stream).
    longest = [
        {
            "at_ms": round((gap_start - window[0]) * 1e3, 2),
            "idle_ms": round(length * 1e3, 3),
            "host_behind": behind,
            "d2h_running": bool(_intersect([(gap_start, gap_start + length)], d2h)),
            "h2d_running": bool(_intersect([(gap_start, gap_start + length)], h2d)),
            "previous_kernel": names[index - 1][:80] if index > 0 else None,
            "next_kernel": names[index][:80] if index < len(names) else None,
            # What the host issued between launching the kernel before and the kernel after
            # (a stream wait there is what a queued kernel waited for).
            "calls_between": _calls_between(starts, index, host_calls, call_times),
        }
        for length, gap_start, index, behind in sorted(stretches, reverse=True)[:20]
    ]
    return {
        "window_s": window[1] - window[0],
        "compute_busy_s": _length(compute),
        "idle_s": idle_total,
        "idle_during_h2d_s": idle_h2d,
        "idle_during_d2h_s": idle_d2h_only,
        "idle_no_copy_s": idle_total - idle_h2d - idle_d2h_only,
        "idle_host_behind_s": host_behind,
        "longest_idle": longest,
        "d2h_busy_s": _length(d2h),
        "h2d_busy_s": _length(h2d),
        # Copies out and back at once share the PCIe link (~50 GB/s each way against ~55 for
        # one direction alone: benchmarks/copy_rates.py).
        "both_directions_busy_s": _length(_intersect(d2h, h2d)),
        "kernels": sum(len(spans) for spans in kernels.values()),
        "side_stream_kernel_s": sum(
            _length(bench.union(spans))
            for stream, spans in kernels.items()
            if stream != compute_stream
        ),
        "blocking_calls": {
            name: {"count": len(durations), "total_s": sum(durations)}
            for name, durations in sorted(blocking.items())
        },
    }


STEP_MARK = "profiled step "


def split_steps(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The trace's events by profiled step: each step ran inside a host range named
    ``STEP_MARK`` + its index and ended with a device synchronize, so a GPU event belongs to the
    step whose host range holds its start (the trace's host and GPU clocks are one timeline).
    The profiler also draws each range on the GPU timeline (``gpu_user_annotation``); those
    copies are events of their step, not steps."""
    ranges = sorted(
        (event["ts"], event["ts"] + event["dur"])
        for event in events
        if event.get("ph") == "X"
        and event.get("cat") == "user_annotation"  # not its copy on the GPU timeline
        and str(event.get("name", "")).startswith(STEP_MARK)
    )
    steps: list[list[dict[str, Any]]] = [[] for _ in ranges]
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        for index, (start, end) in enumerate(ranges):
            if start <= event["ts"] < end:
                steps[index].append(event)
                break
    return steps


OFFLOAD_CODE = ("fine_grained_activation_offload", "nemo_rl_offload/offload/")


def _file_safe(name: str) -> str:
    """A case name as a file name that survives copying between machines (``:`` and ``+`` out)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def python_profile(step: Any, dump: Path | None = None) -> dict[str, Any]:
    """Run ``step()`` under cProfile: the 25 functions with the most own time, and the
    cumulative time of each offload function (Megatron's hooks, this package's runtime). With
    ``dump``, the whole profile is written there too (``pstats.Stats(path)`` reads it: callers,
    callees and every function, for questions the summary does not answer)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(step)
    if dump is not None:
        profiler.dump_stats(str(dump))
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, _)

    def label(key: tuple[str, int, str]) -> str:
        return f"{Path(key[0]).name}:{key[1]}:{key[2]}"

    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)
    return {
        "python_total_s": sum(value[2] for value in stats.values()),
        "python_top": [
            {"function": label(key), "calls": value[1], "own_s": value[2], "cum_s": value[3]}
            for key, value in ranked[:25]
        ],
        "python_offload": {
            label(key): {"calls": value[1], "own_s": value[2], "cum_s": value[3]}
            for key, value in sorted(stats.items(), key=lambda item: -item[1][3])
            if any(part in key[0] for part in OFFLOAD_CODE) and value[3] > 1e-3
        },
    }


# The entry points of Megatron's offload hooks, none called from inside another: (where,
# attribute, label). "start"/"commit" run in the forward (the commit issues the offload
# copies), "reload"/"reload wait" are their backward halves (the reload issues the next
# group's copies back), "save"/"get" are autograd's saved-tensor hooks.
HOOK_ENTRIES = (
    ("module", "fine_grained_offloading_group_start", "start"),
    ("module", "fine_grained_offloading_group_offload", "commit"),
    ("PipelineOffloadManager", "__enter__", "context"),
    ("PipelineOffloadManager", "__exit__", "context"),
    ("PipelineOffloadManager", "on_save_for_backward", "save"),
    ("PipelineOffloadManager", "on_get_saved_tensor", "get"),
    ("PipelineOffloadManager", "init_model_chunk_offload_handler", "chunk"),
    ("PipelineOffloadManager", "reset", "chunk"),
    ("FineGrainedOffloadingGroupStartFunction", "backward", "reload"),
    ("FineGrainedOffloadingGroupCommitFunction", "backward", "reload wait"),
)
OWNED = "nemo_rl_offload.offload.owned"
RECOMPUTE = "nemo_rl_offload.models.discard_checkpoint"
# Called from inside the entry points (``--host-detail``): their seconds overlap the hooks'.
# ``where`` is a class of Megatron's offload module, or ``module.path:Class`` elsewhere.
INNER_ENTRIES = (
    ("ChunkOffloadHandler", "should_bulk_offload", "should offload"),
    ("ChunkOffloadHandler", "bulk_offload_group", "offload group"),
    ("ChunkOffloadHandler", "offload", "offload tensor"),
    ("ChunkOffloadHandler", "tensor_need_offloading_checker", "offload check"),
    ("ChunkOffloadHandler", "bulk_reload_group", "reload group"),
    ("ChunkOffloadHandler", "reload", "reload tensor"),
    ("ChunkOffloadHandler", "tensor_push", "push"),
    ("ChunkOffloadHandler", "tensor_pop", "pop"),
    ("OffloadTensorPool", "allocate", "pool allocate"),
    ("OffloadTensorPool", "free", "pool free"),
    # The project's own handler and pool (their lean hooks replace the methods above), and the
    # autograd Functions around each group (what a group costs beyond its hooks' own code).
    (f"{OWNED}:OwnedChunkHandler", "on_group_commit_forward", "owned commit"),
    (f"{OWNED}:OwnedChunkHandler", "_lean_bulk_offload_group", "owned offload group"),
    (f"{OWNED}:OwnedChunkHandler", "_host_copy", "owned host copy"),
    (f"{OWNED}:OwnedChunkHandler", "on_group_start_forward", "owned start"),
    (f"{OWNED}:OwnedChunkHandler", "_lean_bulk_reload_group", "owned reload group"),
    (f"{OWNED}:OwnedHostPool", "allocate", "owned pool allocate"),
    ("FineGrainedOffloadingGroupCommitFunction", "forward", "commit function"),
    ("FineGrainedOffloadingGroupStartFunction", "forward", "start function"),
    (f"{RECOMPUTE}:DiscardingCheckpoint", "checkpoint", "recompute checkpoint"),
    (
        f"{RECOMPUTE}:DiscardingCheckpoint",
        "discard_output_and_register_recompute",
        "recompute discard",
    ),
    (f"{RECOMPUTE}:DiscardingCheckpoint", "_rebuild", "recompute rebuild"),
)
# The host calls that wait for the GPU (``--host-detail``), clocked wherever they are called:
# a step whose syncs wait long is not host-bound by its own work. (torch attribute, label)
SYNC_ENTRIES = (
    ("cuda.Event", "synchronize", "sync event"),
    ("cuda.Stream", "synchronize", "sync stream"),
    ("Tensor", "item", "sync item"),
    ("Tensor", "tolist", "sync tolist"),
    ("Tensor", "cpu", "sync cpu"),
)


def entry_owner(where: str) -> Any:
    """The module or class a clocked entry's ``where`` names (see ``INNER_ENTRIES``)."""
    import importlib

    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    if where == "module":
        return fgo
    if ":" not in where:
        return getattr(fgo, where)
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def _clocked(function: Callable[..., Any], label: str, totals: dict[str, float]) -> Any:
    def clocked(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

    return clocked


@contextlib.contextmanager
def host_clock(detail: bool = False) -> Iterator[dict[str, float]]:
    """Clock Megatron's offload hooks and the schedule's host time while inside: the yielded
    dict gains ``hook <label>`` seconds, ``schedule`` (host seconds until the schedule
    returned) and, with ``detail``, ``inner <label>`` for the functions the hooks call and
    ``sync <label>`` for the calls that wait for the GPU; the caller clears it between steps."""
    import megatron.core.pipeline_parallel as pipeline
    import torch

    totals: dict[str, float] = {}
    # (owner, attribute, what its class dict held: None when inherited), to put back after.
    restore: list[tuple[Any, str, Any]] = []

    def clock(owner: Any, attribute: str, label: str) -> None:
        own = owner.__dict__.get(attribute)
        if isinstance(own, staticmethod):
            owner_function = own.__func__
        else:
            owner_function = getattr(owner, attribute)
        clocked = _clocked(owner_function, label, totals)
        setattr(
            owner, attribute, staticmethod(clocked) if isinstance(own, staticmethod) else clocked
        )
        restore.append((owner, attribute, own))

    entries = [("hook", entry) for entry in HOOK_ENTRIES]
    entries += [("inner", entry) for entry in INNER_ENTRIES] if detail else []
    for kind, (where, attribute, label) in entries:
        clock(entry_owner(where), attribute, f"{kind} {label}")
    for path, attribute, label in SYNC_ENTRIES if detail else ():
        owner = torch
        for part in path.split("."):
            owner = getattr(owner, part)
        clock(owner, attribute, label)
    get_schedule = pipeline.get_forward_backward_func
    pipeline.get_forward_backward_func = lambda: _clocked(get_schedule(), "schedule", totals)
    restore.append((pipeline, "get_forward_backward_func", get_schedule))
    try:
        yield totals
    finally:
        for owner, attribute, own in reversed(restore):
            if own is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, own)


class PhaseClock:
    """``--phases``: when the host issued each micro-batch's forward and backward
    (Megatron's ``forward_step`` and ``backward_step``) and when the GPU ran them (CUDA events
    recorded at each call's entry and exit on the current stream), on one time line from an
    origin synchronised once, before the first clocked step (a synchronisation between steps
    would take away the lead the host has when a step begins while the GPU still runs the
    previous one's optimizer). ``lead_ms`` at a phase's entry is the GPU work still queued
    when the host began it (zero: the GPU waits for the host); a phase whose GPU span equals
    its host span with no lead is host-bound."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, float, float, Any, Any]]] = []
        self.origin: tuple[float, Any] | None = None

    def start_step(self) -> None:
        import torch

        if self.origin is None:
            torch.cuda.synchronize()
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            self.origin = (time.perf_counter(), origin)
        self.steps.append([])

    def wrap(self, function: Callable[..., Any], kind: str) -> Callable[..., Any]:
        import torch

        def clocked(*args: Any, **kwargs: Any) -> Any:
            entry = torch.cuda.Event(enable_timing=True)
            entry.record()
            host_entry = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                exit_event = torch.cuda.Event(enable_timing=True)
                exit_event.record()
                if self.steps:
                    mark = (kind, host_entry, time.perf_counter(), entry, exit_event)
                    self.steps[-1].append(mark)

        return clocked

    def phases(self) -> list[list[dict[str, float | str]]]:
        """Each clocked step's phases in ms from the step's first host entry (call after the
        last step)."""
        import torch

        assert self.origin is not None
        host_origin, origin = self.origin
        torch.cuda.synchronize()
        steps = []
        for marks in self.steps:
            base = (marks[0][1] - host_origin) * 1e3 if marks else 0.0
            phases = []
            for kind, host_entry, host_exit, entry, exit_event in marks:
                gpu_entry, gpu_exit = origin.elapsed_time(entry), origin.elapsed_time(exit_event)
                host_entry_ms = (host_entry - host_origin) * 1e3
                phases.append(
                    {
                        "phase": kind,
                        "host_entry_ms": round(host_entry_ms - base, 3),
                        "host_ms": round((host_exit - host_entry) * 1e3, 3),
                        "gpu_entry_ms": round(gpu_entry - base, 3),
                        "gpu_ms": round(gpu_exit - gpu_entry, 3),
                        "lead_ms": round(gpu_entry - host_entry_ms, 3),
                    }
                )
            steps.append(phases)
        return steps


@contextlib.contextmanager
def phase_clock() -> Iterator[PhaseClock]:
    """Clock Megatron's ``forward_step`` and ``backward_step`` (:class:`PhaseClock`) while
    inside, and put both back after."""
    from megatron.core.pipeline_parallel import schedules

    clock = PhaseClock()
    originals = {name: getattr(schedules, name) for name in ("forward_step", "backward_step")}
    for name, function in originals.items():
        setattr(schedules, name, clock.wrap(function, name.removesuffix("_step")))
    try:
        yield clock
    finally:
        for name, function in originals.items():
            setattr(schedules, name, function)


def _case_worker(name: str, args: argparse.Namespace, steps: int) -> tuple[Any, list] | dict:
    """The case's policy worker (on Megatron's own handler code where the case asks) and
    ``steps`` batches; or the record of a case the offload rules reject."""
    from nemo_rl_offload.config.model_presets import architecture_for

    settings = bench.resolve_cases(args.model, [name])[name]
    if args.recipe:
        section = bench.recipe_section(
            args.recipe, args.recipe_override, args.model, args.seq, settings
        )
    else:
        section = bench.section_for(
            args.model, args.seq, settings, model_overrides=bench.parse_model_overrides(args)
        )
    errors = bench.check_section(section)
    if errors:
        return {"case": name, "rejected": errors}
    # The recipe's worker environment, as its Ray workers get it (the CUDA allocator's
    # settings are read when this process first allocates on the GPU).
    os.environ.update(section["megatron_cfg"].get("env_vars") or {})
    vocab = architecture_for(args.model).vocab_size
    data = bench.batches(steps, args.microbatches, args.rows, args.seq, vocab)
    worker = bench.build_worker(section, on_gpu=True)
    bench.use_megatron_handler(worker, settings)
    return worker, data


def host_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--host``: the case's steps with the hooks clocked (no profiler)."""
    prepared = _case_worker(name, args, args.warmup + args.host_steps)
    if isinstance(prepared, dict):
        return prepared
    worker, data = prepared
    steps: list[dict[str, float]] = []
    try:
        for step in data[: args.warmup]:
            worker.train(step, {"name": "nll"})
        phases = phase_clock() if args.phases else contextlib.nullcontext()
        with host_clock(args.host_detail) as totals, phases as clock:
            for step in data[args.warmup :]:
                totals.clear()
                if clock is not None:
                    clock.start_step()
                metrics = worker.train(step, {"name": "nll"})
                hooks = sum(v for k, v in totals.items() if k.startswith("hook "))
                steps.append({"fwd_bwd_s": metrics["fwd_bwd_time_s"], "hooks_s": hooks, **totals})
            if clock is not None:
                for record, phases_of_step in zip(steps, clock.phases(), strict=True):
                    record["phases"] = phases_of_step
    finally:
        worker.close()
    keys = sorted({key for step in steps for key in step if key != "phases"})
    medians = {key: statistics.median(step.get(key, 0.0) for step in steps) for key in keys}
    return {"case": name, "steps": len(steps), **medians, "per_step": steps}


def profile_case(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    profiled = args.profiled_steps
    prepared = _case_worker(name, args, args.warmup + profiled)
    if isinstance(prepared, dict):
        return prepared
    worker, data = prepared
    python: dict[str, Any] = {}
    per_step: list[dict[str, Any]] = []
    try:
        for step in data[:-profiled]:
            worker.train(step, {"name": "nll"})
        torch.cuda.synchronize()
        if args.python:
            python = python_profile(
                lambda: worker.train(data[-profiled - 1], {"name": "nll"}),
                out / f"pstats_{args.model}_seq{args.seq}_{_file_safe(name)}.prof",
            )
            torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for index, step in enumerate(data[-profiled:]):
                with torch.profiler.record_function(f"{STEP_MARK}{index}"):
                    metrics = worker.train(step, {"name": "nll"})
                    torch.cuda.synchronize()
                per_step.append(
                    {
                        "fwd_bwd_s": metrics.get("fwd_bwd_time_s"),
                        "offloaded_gib_per_step": metrics.get("offloaded_gib_per_step", 0.0),
                    }
                )
    finally:
        worker.close()
    raw = out / f".trace_{name}.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(out / f"trace_{args.model}_seq{args.seq}_{name}.json.gz", "wt") as sink:
        json.dump(trace, sink)
    raw.unlink()
    events = trace.get("traceEvents", [])
    if profiled == 1:
        return {"case": name, **per_step[0], **summarise_trace(events), **python}
    # Several steps: each step's own split, to set slow steps beside fast ones.
    for index, (record, step_events) in enumerate(zip(per_step, split_steps(events), strict=True)):
        record.update({"step": index, **summarise_trace(step_events)})
    return {"case": name, "per_step": per_step, **python}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled one")
    parser.add_argument(
        "--profiled-steps",
        type=int,
        default=1,
        help="consecutive steps under the profiler; with more than one, a split per step",
    )
    parser.add_argument(
        "--recipe",
        default=None,
        help="run the cases on this recipe's policy, as offload_benchmark.py's --recipe",
    )
    parser.add_argument(
        "--recipe-override",
        action="append",
        default=[],
        metavar="LINE",
        help="an override of --recipe (repeatable)",
    )
    parser.add_argument("--cases", default="no_offload,fgo_norms,fgo_all5")
    parser.add_argument(
        "--model-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a TransformerConfig field for every case (repeatable), as offload_benchmark.py's",
    )
    parser.add_argument("--out", default="results/profile")
    parser.add_argument(
        "--python", action="store_true", help="also profile one step's host side with cProfile"
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="no profiler: clock the offload hooks and the schedule's host time per step",
    )
    parser.add_argument("--host-steps", type=int, default=8, help="clocked steps with --host")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="with --host, also clock each micro-batch's forward and backward on the host and "
        "on the GPU (how far ahead the host was when each began)",
    )
    parser.add_argument(
        "--host-detail",
        action="store_true",
        help="with --host, also clock the functions the hooks call (their times overlap)",
    )
    args = parser.parse_args(argv)
    for flag, given in (("--host-detail", args.host_detail), ("--phases", args.phases)):
        if given and not args.host:
            print(f"{flag}: clocks --host steps; add --host", file=sys.stderr)
            return 2
    if bench.model_overrides_refused(args):
        return 2
    if args.recipe and args.model_override:
        print("--model-override: give it in --recipe-override lines with --recipe", file=sys.stderr)
        return 2
    if args.profiled_steps < 1:
        print("--profiled-steps: give 1 or more", file=sys.stderr)
        return 2
    wanted = args.cases.split(",")
    try:
        bench.resolve_cases(args.model, wanted)
    except KeyError as unknown:
        print(
            f"--cases: unknown {unknown}; offload_benchmark.py --list shows them", file=sys.stderr
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in wanted:
        result = host_case(name, args) if args.host else profile_case(name, args, out)
        brief = ("blocking_calls", "python_top", "python_offload")
        print(json.dumps({k: v for k, v in result.items() if k not in brief}), flush=True)
        results.append(result)
        # Written after every case: a later case that fails keeps the earlier ones.
        payload = {"environment": bench.environment(), "args": vars(args), "cases": results}
        kind = "host" if args.host else "profile"
        (out / f"{kind}_{args.model}_seq{args.seq}.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
