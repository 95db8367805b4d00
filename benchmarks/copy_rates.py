"""Plain pinned-copy rates by copy size, alone and in the company an offload plan's copies keep.

The benchmark's floor (docs/benchmark.md) takes the rate of one 1 GiB pinned copy each way. An
offload plan copies many smaller tensors (the 1B MoE step's expert inputs: 16 MiB each), while
the other direction and the compute may be running. This measures, for each copy size, a
series of copies between distinct GPU tensors and distinct pinned buffers (as the offload pool
holds them) on a side stream, timed with CUDA events from the series' first copy to its last:

- ``alone``: one direction, nothing else on the GPU;
- ``both``: device-to-host and host-to-device series at once, on two streams (each direction's
  rate over its own series);
- ``gemm`` / ``memory``: one direction beside a chain of bf16 matrix products / of GPU-to-GPU
  copies (memory-bound, as a step's elementwise kernels are) on the compute stream;
- ``graph``: the series captured in a CUDA graph and replayed (how a graphed step copies).

It prints JSON lines and a markdown table (GB/s, median of ``--repeat`` rounds) and, with
``--out``, writes ``copy_rates.json`` and ``copy_rates.md``.

Run on a GPU machine:
    python3 benchmarks/copy_rates.py --out /tmp/rates
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("alone", "both", "gemm", "memory", "graph")
DIRECTIONS = ("d2h", "h2d")


class Series:
    """``count`` copies of ``chunk_bytes`` each way between distinct GPU tensors and distinct
    pinned host buffers, issued on a stream of their own per direction."""

    def __init__(self, chunk_bytes: int, count: int) -> None:
        import torch

        self.bytes = chunk_bytes * count
        self.device = [
            torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda") for _ in range(count)
        ]
        self.host = [
            torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)
        ]
        self.streams = {direction: torch.cuda.Stream() for direction in DIRECTIONS}

    def issue(self, direction: str) -> None:
        """The copies of one direction, on the current stream."""
        pairs = zip(self.host, self.device, strict=True)
        for host, device in pairs:
            if direction == "d2h":
                host.copy_(device, non_blocking=True)
            else:
                device.copy_(host, non_blocking=True)

    def timed(
        self, direction: str, action: Callable[[], None] | None = None, after: bool = True
    ) -> Any:
        """Record start and end events around ``action`` (default: the copies) on the
        direction's stream, after the compute stream's work if ``after``; returns the pair."""
        import torch

        stream = self.streams[direction]
        if after:
            stream.wait_stream(torch.cuda.current_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            (action or (lambda: self.issue(direction)))()
            end.record()
        return start, end

    def rate(self, events: Any) -> float:
        """GB/s of a timed series, once the GPU has finished it."""
        start, end = events
        return self.bytes / (start.elapsed_time(end) / 1e3) / 1e9


def _loads(series_bytes: int) -> dict[str, Callable[[], None]]:
    """Work for the compute stream that outlasts a series of ``series_bytes`` (2 GiB: ~40 ms at
    55 GB/s), scaled with it: bf16 matrix products (``gemm``, ~1.5 ms each, 40 per 2 GiB), or
    copies between two 1 GiB GPU tensors (``memory``, ~0.65 ms each, 120 per 2 GiB: bound by
    the GPU's memory bandwidth, as a step's elementwise kernels are)."""
    import torch

    scale = max(1.0, series_bytes / 2**31)

    matrix = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 8192
    source, target = (torch.empty(2**30, dtype=torch.uint8, device="cuda") for _ in range(2))

    def gemm() -> None:
        for _ in range(round(40 * scale)):
            matrix.copy_(matrix @ matrix * (1.0 / matrix.shape[0]))

    def memory() -> None:
        for _ in range(round(120 * scale)):
            target.copy_(source)

    return {"gemm": gemm, "memory": memory}


def _graphs(series: Series) -> dict[str, Any]:
    """Each direction's series captured in a CUDA graph (after one eager warm-up)."""
    import torch

    graphs = {}
    for direction in DIRECTIONS:
        stream = series.streams[direction]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            series.issue(direction)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                series.issue(direction)
            graphs[direction] = graph
    torch.cuda.synchronize()
    return graphs


def measure(chunk_mib: float, total_mib: int, repeat: int) -> dict[str, float]:
    """``mode/direction`` -> median GB/s for copies of ``chunk_mib`` MiB."""
    import torch

    chunk = int(chunk_mib * 2**20)
    series = Series(chunk, max(1, int(total_mib * 2**20) // chunk))
    graphs, loads = _graphs(series), _loads(series.bytes)
    samples: dict[str, list[float]] = {}

    def sample(mode: str, direction: str, events: Any) -> None:
        torch.cuda.synchronize()
        samples.setdefault(f"{mode}/{direction}", []).append(series.rate(events))

    for _ in range(repeat):
        for direction in DIRECTIONS:
            sample("alone", direction, series.timed(direction))
            sample("graph", direction, series.timed(direction, graphs[direction].replay))
            for mode, load in loads.items():
                load()
                sample(mode, direction, series.timed(direction, after=False))
        both = {direction: series.timed(direction) for direction in DIRECTIONS}
        for direction, events in both.items():
            sample("both", direction, events)
    return {key: statistics.median(values) for key, values in samples.items()}


def table(results: dict[float, dict[str, float]]) -> str:
    """A markdown table: a row per copy size, a column per mode and direction (GB/s)."""
    keys = [f"{mode}/{direction}" for mode in MODES for direction in DIRECTIONS]
    lines = [
        "| copy MiB | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 1) + "|",
    ]
    for size, rates in results.items():
        lines.append(f"| {size:g} | " + " | ".join(f"{rates[k]:.1f}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    from nemo_rl_offload.telemetry import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,4,16,64,256,1024")
    parser.add_argument("--total-mib", type=int, default=2048, help="bytes per series")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        sizes = [float(size) for size in args.sizes_mib.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0 or args.total_mib < max(sizes) or args.repeat < 1:
        print(
            f"copy_rates.py: --sizes-mib {args.sizes_mib!r} --total-mib {args.total_mib} "
            f"--repeat {args.repeat}: give sizes in MiB above 0, comma-separated (e.g. 4,16), "
            "a total at least the largest size and at least one round",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("copy_rates.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = {}
    for size in sizes:
        results[size] = measure(size, args.total_mib, args.repeat)
        print(json.dumps({"copy_mib": size, "gb_per_s": results[size]}))
        torch.cuda.empty_cache()
    print(table(results))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"environment": environment(), "args": vars(args), "gb_per_s": results}
        (out / "copy_rates.json").write_text(json.dumps(payload, indent=1))
        (out / "copy_rates.md").write_text(table(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
