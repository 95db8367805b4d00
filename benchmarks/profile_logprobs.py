"""Where a forward-only pass's time goes, beside a training step's, on the recipe's own packs.

GRPO's log-probability passes (policy, reference) should run at about three times training's
tokens/s: a forward is a third of a forward+backward's FLOPs. ``rl_step.py`` measures the job's
rates; this probe builds the recipe's policy worker in this process, packs one step's worth of
random sequences as the job packs them (training by ``train_mb_tokens``, forward-only by
``logprob_mb_tokens``), and times both, then profiles one of each with torch's profiler:
GPU-busy share of the wall time, and the operators with the most GPU and host time.

On a GPU machine, from the repository root:
    python3 benchmarks/profile_logprobs.py \\
        --config examples/configs/grpo_math_1B_megatron_fgo.yaml \\
        --out /tmp/logprobs policy.max_total_sequence_length=2048
Output in --out: ``profile_logprobs.json`` (timings, rates, the profiles' top operators).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def sequences(count: int, longest: int, vocab: int, seed: int = 0) -> list[Any]:
    """``count`` random sequences of a GRPO step's shape: short prompts, responses of lengths
    spread up to the longest (one of them at it, as the step's longest row is)."""
    from nemo_rl_offload.algorithms.batching import TokenSequence

    rng = np.random.default_rng(seed)
    lengths = rng.integers(longest // 8, longest // 2, count)
    lengths[0] = longest
    out = []
    for length in lengths:
        ids = rng.integers(0, vocab, int(length)).tolist()
        out.append(TokenSequence(ids, prompt_len=min(64, int(length) // 2)))
    return out


def profiled(fn: Any, rows: int = 25) -> dict[str, Any]:
    """One call of ``fn`` under torch's profiler: its wall time, the GPU's busy time (the union
    of kernel intervals), and the top operators by GPU and by host time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0.0, None
    for a, b in kernels:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    averages = prof.key_averages()

    def top(key: str) -> list[dict[str, Any]]:
        ranked = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:rows]
        return [
            {
                "name": e.key,
                "calls": e.count,
                "device_ms": round(e.self_device_time_total / 1e3, 3),
                "host_self_ms": round(e.self_cpu_time_total / 1e3, 3),
            }
            for e in ranked
        ]

    return {
        "wall_s": wall,
        "gpu_busy_s": busy / 1e6,
        "gpu_busy_share": busy / 1e6 / wall,
        "top_device": top("self_device_time_total"),
        "top_host": top("self_cpu_time_total"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from nemo_rl_offload.algorithms import packing
    from nemo_rl_offload.config.loader import load_recipe
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import check_recipe

    report = check_recipe(load_recipe(args.config, args.overrides), base_dir=Path.cwd())
    if not report.ok:
        print("\n".join(report.errors), file=sys.stderr)
        return 1
    settings = report.policies["policy"]
    worker = PolicyWorker(settings=settings, rank=0, world_size=1, seed=1, on_gpu=True)
    worker.setup(*worker.node_address())
    batching = settings.batching
    seqs = sequences(
        args.sequences, settings.max_total_sequence_length, settings.architecture.vocab_size
    )
    tokens = sum(len(s.ids) for s in seqs)
    train_mbs = packing.training_batches(seqs, batching, 1, pad_id=0).shards[0]
    forward_mbs = packing.forward_batches(seqs, batching, pad_id=0).flat

    def train() -> None:
        worker.train(train_mbs, {"name": "nll"})

    def forward() -> None:
        worker.token_logprobs(forward_mbs)

    import torch

    times: dict[str, list[float]] = {"train": [], "forward": []}
    for _ in range(2):  # warm-up: plans recorded, allocator grown
        train()
        forward()
    for _ in range(args.repeats):
        for name, fn in (("train", train), ("forward", forward)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    payload = {
        "config": str(args.config),
        "overrides": args.overrides,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sequences": args.sequences,
        "tokens": tokens,
        "train_microbatches": [list(mb["input_ids"].shape) for mb in train_mbs],
        "forward_microbatches": [list(mb["input_ids"].shape) for mb in forward_mbs],
        "seconds": times,
        "tokens_per_s": {name: tokens / value for name, value in median.items()},
        "forward_vs_train": median["train"] / median["forward"],
        "profile": {"train": profiled(train), "forward": profiled(forward)},
    }
    (args.out / "profile_logprobs.json").write_text(json.dumps(payload, indent=1))
    print(json.dumps({k: payload[k] for k in ("tokens_per_s", "forward_vs_train")}, indent=1))
    for name in ("train", "forward"):
        prof = payload["profile"][name]
        print(f"{name}: wall {prof['wall_s']:.3f} s, GPU busy {prof['gpu_busy_share']:.0%}")
        for row in prof["top_device"][:12]:
            print(f"  {row['device_ms']:9.1f} ms gpu {row['calls']:6d}x {row['name'][:90]}")
    worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
