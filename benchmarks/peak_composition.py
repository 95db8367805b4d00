"""What is on the GPU at a training step's peak: the live allocations at that moment, by owner.

Why: the long-context matrix (benchmarks/long_context_matrix.sh) measures each plan's peak, and
the planner's cost model explains it as weights, optimizer state and saved activations; where a
plan peaks above that line the table alone cannot say what the extra bytes are. This runs
benchmark cases (offload_benchmark's names and recipe handling) a few steps each, records the
CUDA allocator's history over the steps, and replays the last one from its forward's first
allocation to its optimizer step: the moment of the highest bytes and the allocations alive
then, grouped by the innermost frame of this package or Megatron in their Python stack (the
autograd engine's backward allocations have none: they group under the last Python frame).

Two counts, each with its own peak: ``allocated`` ends a block when its free is requested (as
``torch.cuda.max_memory_allocated``, the benchmark's peak, does); ``blocked`` ends it when the
free completes: a block freed while a side stream's copy still reads it (an offloaded
activation) cannot be reused until then, so offload plans need more memory than their allocated
peak. Each count lists what is pending at its peak and how long such frees waited.

Run on a GPU machine, e.g. the matrix's 8k step:
    python3 benchmarks/peak_composition.py --model llama-1b \\
        --recipe examples/configs/grpo_math_1B_megatron.yaml --recipe-override=... \\
        --seq 8192 --microbatches 2 --cases no_offload,fgo:core_attn --out DIR
Writes DIR/peak_<model>_seq<N>.json (per case: both counts' peaks, the phase they fell in, the
owners alive and pending then) and prints a summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offload_benchmark as bench  # noqa: E402

OWN_CODE = ("nemo_rl_offload", "megatron/core")


def owner_of(frames: list[dict[str, Any]]) -> str:
    """The innermost frame of this package or Megatron (file:line function), else the
    outermost Python frame's function (what started the allocation)."""
    for frame in frames:
        name = frame.get("filename", "")
        at = max(name.rfind(part) for part in OWN_CODE)
        if at >= 0:
            return f"{name[at:]}:{frame.get('line')} {frame.get('name')}"
    if frames:
        return f"(no own frame) {frames[-1].get('name')}"
    return "(no Python frame: the autograd engine or a C++ caller)"


FORWARD_CODE = "megatron/core/models/gpt/gpt_model.py"
OPTIMIZER_CODE = ("megatron/core/optimizer", "torch/optim")


def in_optimizer(event: dict[str, Any]) -> bool:
    return any(
        part in frame.get("filename", "")
        for frame in event.get("frames") or []
        for part in OPTIMIZER_CODE
    )


def live_at_peak(
    trace: list[dict[str, Any]], begin: int = 0, *, until: str = "free_requested"
) -> tuple[int, int, dict[int, dict[str, Any]]]:
    """Replay one device's allocator trace: the highest net bytes (against where the trace
    starts) at or after event ``begin`` and before the optimizer step's first allocation after
    it, the event index where it was reached, and the allocations alive then. ``until``: the
    event that ends a block: ``free_requested`` counts as torch.cuda.memory_allocated does;
    ``free_completed`` also counts a freed block whose stream uses are pending (reserved for a
    side stream's copy, not reusable yet)."""
    live: dict[int, dict[str, Any]] = {}
    net = 0
    best, best_at = None, begin
    best_live: dict[int, dict[str, Any]] = {}
    for index, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc" and index >= begin and in_optimizer(event):
            break
        if action == "alloc":
            live[event["addr"]] = event
            net += event["size"]
        elif action == until:
            gone = live.pop(event["addr"], None)
            net -= gone["size"] if gone else event["size"]
        if index >= begin and (best is None or net > best):
            best, best_at = net, index
            best_live = dict(live)
    return best or 0, best_at, best_live


def pending_at(trace: list[dict[str, Any]], at: int) -> dict[str, Any]:
    """Blocks whose free was requested at or before event ``at`` and completes after it (a side
    stream's copy still reads them, so the allocator cannot reuse them yet), by the owner that
    allocated them; and how long those frees waited (request to completion, the trace's
    times)."""
    allocated: dict[int, dict[str, Any]] = {}
    requested: dict[int, dict[str, Any]] = {}
    for event in trace[: at + 1]:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            allocated[addr] = event
        elif action == "free_requested":
            requested[addr] = event
        elif action == "free_completed":
            requested.pop(addr, None)
    pending = {addr: allocated.get(addr, asked) for addr, asked in requested.items()}
    waiting = dict(requested)  # each pending free's wait, counted when it completes
    ms = []
    for event in trace[at + 1 :]:
        if event.get("action") == "free_completed" and event.get("addr") in waiting:
            asked = waiting.pop(event["addr"])
            ms.append((event.get("time_us", 0) - asked.get("time_us", 0)) / 1000)
    ms.sort()
    total, rows = _owners(pending, 12)
    return {
        "pending_gib": total / 2**30,
        "pending_blocks": len(pending),
        "wait_ms_median": ms[len(ms) // 2] if ms else None,
        "wait_ms_max": ms[-1] if ms else None,
        "pending_by_owner": rows,
    }


def replay_net(trace: list[dict[str, Any]]) -> int:
    """Net bytes of the whole trace (checks the replay against the allocator at the end)."""
    net = 0
    for event in trace:
        if event.get("action") == "alloc":
            net += event["size"]
        elif event.get("action") == "free_completed":
            net -= event["size"]
    return net


def _owners(alive: dict[int, dict[str, Any]], top: int) -> tuple[int, list[dict[str, Any]]]:
    owners: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for event in alive.values():
        key = owner_of(event.get("frames") or [])
        owners[key] += event["size"]
        counts[key] += 1
    rows = [{"owner": k, "gib": v / 2**30, "blocks": counts[k]} for k, v in owners.most_common(top)]
    return sum(owners.values()), rows


def _phase(trace: list[dict[str, Any]], begin: int, at: int) -> str:
    """Which forward the peak fell in: the count of output-layer losses begun before it."""
    losses = sum(
        1
        for event in trace[begin:at]
        if event.get("action") == "alloc"
        and any("calculate_logits_max" in f.get("name", "") for f in event.get("frames") or [])
    )
    return f"after {losses} loss computations"


def first_forward(trace: list[dict[str, Any]], begin: int) -> int:
    """The recorded step's first allocation by the model's forward (at or after ``begin``):
    what the previous step's optimizer left allocated (float32 gradient copies, freed at the
    step's start) is not the forward-backward's peak."""
    for index in range(begin, len(trace)):
        event = trace[index]
        if event.get("action") == "alloc" and any(
            FORWARD_CODE in frame.get("filename", "") for frame in event.get("frames") or []
        ):
            return index
    return begin


def summarize(
    trace: list[dict[str, Any]], allocated_at_trace_start: int, begin: int, top: int = 25
) -> dict[str, Any]:
    """Both counts' peaks in the recorded step (from its forward's first allocation): the
    allocator's ``allocated`` and the bytes ``blocked`` (also freed blocks a copy stream still
    uses), each with what is alive then and what is pending then."""
    start = first_forward(trace, begin)
    out: dict[str, Any] = {
        "allocated_at_trace_start_gib": allocated_at_trace_start / 2**30,
        "step_first_event": begin,
        "forward_first_event": start,
        "events": len(trace),
    }
    for until, label in (("free_requested", "allocated"), ("free_completed", "blocked")):
        peak, at, alive = live_at_peak(trace, start, until=until)
        in_trace, rows = _owners(alive, top)
        frames_at_peak = (trace[at].get("frames") or []) if trace else []
        out[label] = {
            "peak_gib": (allocated_at_trace_start + peak) / 2**30,
            "before_trace_alive_gib": (allocated_at_trace_start + peak - in_trace) / 2**30,
            "peak_event": at,
            "phase": _phase(trace, begin, at),
            "allocation_at_peak": owner_of(frames_at_peak),
            "stack_at_peak": [
                f"{f.get('filename')}:{f.get('line')} {f.get('name')}" for f in frames_at_peak[:10]
            ],
            "live_at_peak": rows,
            "pending": pending_at(trace, at),
        }
    return out


def run_one(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One case in this process (``--one-case``): warm-up steps, then the recorded step."""
    import torch

    from nemo_rl_offload.config.model_presets import architecture_for

    settings = bench.resolve_cases(args.model, [name])[name]
    if args.recipe:
        section = bench.recipe_section(
            args.recipe, args.recipe_override, args.model, args.seq, settings
        )
    else:
        section = bench.section_for(args.model, args.seq, settings)
    errors = bench.check_section(section)
    if errors:
        raise SystemExit("rejected: " + "; ".join(errors))
    os.environ.update(section["megatron_cfg"].get("env_vars") or {})
    vocab = architecture_for(args.model).vocab_size
    data = bench.batches(args.steps, args.microbatches, 1, args.seq, vocab)
    worker = bench.build_worker(section, True)
    device = torch.cuda.current_device()
    try:
        # Recorded from the first step: blocks the recorded step frees or keeps from the steps
        # before it (the optimizer's state, a previous step's leftovers) have their owners.
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
        try:
            for step in data[:-1]:
                worker.train(step, {"name": "nll"})
            torch.cuda.synchronize()
            begin = len(torch.cuda.memory._snapshot()["device_traces"][device])
            result = worker.train(data[-1], {"name": "nll"})
            torch.cuda.synchronize()
            end_allocated = torch.cuda.memory_allocated()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    finally:
        worker.close()
    trace = snapshot["device_traces"][device]
    return {
        "case": name,
        "settings": settings,
        "measured_peak_fwd_bwd_gib": result.get("peak_fwd_bwd_gpu_memory_gib"),
        "end_allocated_gib": end_allocated / 2**30,
        "replayed_end_gib": (start + replay_net(trace)) / 2**30,
        "actions": dict(collections.Counter(e.get("action") for e in trace)),
        **summarize(trace, start, begin),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--recipe", default=None)
    parser.add_argument("--recipe-override", action="append", default=[])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="the last one recorded")
    parser.add_argument("--cases", default="no_offload")
    parser.add_argument("--out", required=True)
    parser.add_argument("--one-case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one_case:  # the child: one case, its record (or failure) in --record
        return bench.write_case_record(
            Path(args.record), args.one_case, {}, lambda: run_one(args, args.one_case)
        )
    records = []
    for name in args.cases.split(","):
        # One process per case (the allocator starts empty), as the offload benchmark runs.
        target = out / f".{name.replace(':', '_')}.json"
        command = [
            sys.executable,
            __file__,
            *sys.argv[1:],
            f"--one-case={name}",
            f"--record={target}",
        ]
        records.append(bench.run_child(command, target, name, {}))
        record = records[-1]
        print(
            f"== {name}: measured {record.get('measured_peak_fwd_bwd_gib')} "
            f"{record.get('failed', '')} end {record.get('end_allocated_gib')} "
            f"replayed end {record.get('replayed_end_gib')}"
        )
        for label in ("allocated", "blocked"):
            part = record.get(label)
            if not part:
                continue
            pend = part["pending"]
            print(
                f"  [{label}] peak {part['peak_gib']:.3f} GiB at {part['phase']}: "
                f"{part['allocation_at_peak']}; pending {pend['pending_gib']:.3f} GiB "
                f"({pend['pending_blocks']} blocks, wait median {pend['wait_ms_median']} ms, "
                f"max {pend['wait_ms_max']} ms)"
            )
            for row in part["live_at_peak"]:
                print(f"   {row['gib']:7.3f} GiB {row['blocks']:5d}  {row['owner']}")
            print("   pending by owner:")
            for row in pend["pending_by_owner"]:
                print(f"   {row['gib']:7.3f} GiB {row['blocks']:5d}  {row['owner']}")
    target = out / f"peak_{args.model}_seq{args.seq}.json"
    target.write_text(
        json.dumps(
            {"environment": bench.environment(), "command": sys.argv, "cases": records}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
