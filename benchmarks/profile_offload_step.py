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
- copy-engine busy time per direction, kernel count, and the host calls that block (syncs).

With ``--python``, one more step runs under cProfile: where the host's time goes by Python
function (``python_top``: the functions with the most own time; ``python_offload``: the
cumulative time of Megatron's offload hooks and this package's offload runtime), which the GPU
timeline shows only as "CPU behind".

Output: ``profile_<model>_seq<N>.json`` in --out (one summary per case) and a gzipped Chrome
trace per case, loadable in chrome://tracing or Perfetto.

Run on a GPU machine:
    python3 benchmarks/profile_offload_step.py --model llama-1b --seq 4096 \\
        --cases no_offload,fgo_norms,fgo_all5 --out /tmp/profile
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
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
    return {
        "window_s": window[1] - window[0],
        "compute_busy_s": _length(compute),
        "idle_s": idle_total,
        "idle_during_h2d_s": idle_h2d,
        "idle_during_d2h_s": idle_d2h_only,
        "idle_no_copy_s": idle_total - idle_h2d - idle_d2h_only,
        "d2h_busy_s": _length(d2h),
        "h2d_busy_s": _length(h2d),
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


OFFLOAD_CODE = ("fine_grained_activation_offload", "nemo_rl_offload/offload/")


def python_profile(step: Any) -> dict[str, Any]:
    """Run ``step()`` under cProfile: the 25 functions with the most own time, and the
    cumulative time of each offload function (Megatron's hooks, this package's runtime)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(step)
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


def profile_case(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from nemo_rl_offload.config.model_presets import architecture_for

    settings = bench.resolve_cases(args.model, [name])[name]
    section = bench.section_for(args.model, args.seq, settings)
    errors = bench.check_section(section)
    if errors:
        return {"case": name, "rejected": errors}
    vocab = architecture_for(args.model).vocab_size
    data = bench.batches(args.warmup + 1, args.microbatches, args.rows, args.seq, vocab)
    bench.use_megatron_copies(settings)
    worker = bench.build_worker(section, on_gpu=True)
    python: dict[str, Any] = {}
    try:
        for step in data[:-1]:
            worker.train(step, {"name": "nll"})
        torch.cuda.synchronize()
        if args.python:
            python = python_profile(lambda: worker.train(data[-2], {"name": "nll"}))
            torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            metrics = worker.train(data[-1], {"name": "nll"})
            torch.cuda.synchronize()
    finally:
        worker.close()
    raw = out / f".trace_{name}.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(out / f"trace_{args.model}_seq{args.seq}_{name}.json.gz", "wt") as sink:
        json.dump(trace, sink)
    raw.unlink()
    summary = summarise_trace(trace.get("traceEvents", []))
    return {
        "case": name,
        "fwd_bwd_s": metrics.get("fwd_bwd_time_s"),
        "offloaded_gib_per_step": metrics.get("offloaded_gib_per_step", 0.0),
        **summary,
        **python,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled one")
    parser.add_argument("--cases", default="no_offload,fgo_norms,fgo_all5")
    parser.add_argument("--out", default="results/profile")
    parser.add_argument(
        "--python", action="store_true", help="also profile one step's host side with cProfile"
    )
    args = parser.parse_args(argv)
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
        result = profile_case(name, args, out)
        brief = ("blocking_calls", "python_top", "python_offload")
        print(json.dumps({k: v for k, v in result.items() if k not in brief}), flush=True)
        results.append(result)
    payload = {"environment": bench.environment(), "args": vars(args), "cases": results}
    (out / f"profile_{args.model}_seq{args.seq}.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
