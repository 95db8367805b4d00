"""Host cost of the CUDA and autograd calls an offload hook makes, one at a time.

The offload hooks of an eager step run on the host; on a host-bound step (the 1B dense step at
4 x 4096 tokens on an H100: the schedule's host time is within a few percent of its GPU time)
their host time is step time. This prints the host microseconds per call of each primitive
they are built of (median of --repeat rounds of --calls calls; the GPU is kept busy meanwhile,
as in a training step), as JSON lines and, with --out, a JSON file.

Run on a GPU machine:
    python3 benchmarks/host_primitives.py --out /tmp/primitives
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _per_call_us(action: Callable[[], Any], calls: int, repeat: int) -> float:
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            action()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def primitives(mib: int) -> dict[str, Callable[[], Any]]:
    """Name -> one call of it, on tensors of ``mib`` MiB (a norm's group at 4 x 4096 tokens is
    16 MiB)."""
    import torch

    from nemo_rl_offload.offload.owned import is_dense_permutation

    elements = mib * 2**20 // 2
    device = torch.empty(elements, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(elements, dtype=torch.bfloat16, pin_memory=True)
    side = torch.cuda.Stream()
    timing = torch.cuda.Event(enable_timing=True)
    plain = torch.cuda.Event()
    permuted = torch.empty(4, 16, 1024, 64, device="cuda").transpose(1, 2)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: Any) -> Any:
            return tensor

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad

    leaf = torch.ones(8, device="cuda", requires_grad=True)

    def on_side(action: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> None:
            with torch.cuda.stream(side):
                action()

        return run

    return {
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "with torch.cuda.stream(side): pass": on_side(lambda: None),
        "side.wait_stream(current)": lambda: side.wait_stream(torch.cuda.current_stream()),
        "event.record(side) (no timing)": lambda: plain.record(side),
        "event.record(side) (timing)": lambda: timing.record(side),
        "Event(enable_timing=True) + record": lambda: torch.cuda.Event(enable_timing=True).record(
            side
        ),
        "side.wait_event(event)": lambda: side.wait_event(plain),
        f"host.copy_(device {mib} MiB, non_blocking) on side": on_side(
            lambda: host.copy_(device, non_blocking=True)
        ),
        f"torch.empty(cuda, {mib} MiB)": lambda: torch.empty(
            elements, dtype=torch.bfloat16, device="cuda"
        ),
        "tensor.record_stream(side)": lambda: device.record_stream(side),
        "tensor.is_contiguous()": device.is_contiguous,
        "is_dense_permutation(permuted view)": lambda: is_dense_permutation(permuted),
        "autograd Function.apply (identity)": lambda: Identity.apply(leaf),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from nemo_rl_offload.telemetry import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_primitives.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    busy = torch.randn(8192, 8192, device="cuda")
    results = {}
    for name, action in primitives(args.mib).items():
        for _ in range(4):  # the GPU busy while the calls are timed, as in a training step
            busy = busy @ busy.T / 8192
        results[name] = _per_call_us(action, args.calls, args.repeat)
        print(json.dumps({"primitive": name, "host_us_per_call": round(results[name], 2)}))
        torch.cuda.synchronize()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"environment": environment(), "args": vars(args), "host_us_per_call": results}
        (out / "host_primitives.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
