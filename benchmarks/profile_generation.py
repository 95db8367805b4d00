"""Where a KV-cached decode step's time goes on a GPU (torch profiler, llama-1b, bf16).

    python3 benchmarks/profile_generation.py --out DIR

Prints the kernels and host operations by total time over one profiled call, and times the same
call greedy and sampled (decode steps as CUDA graphs); writes profile_generation.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_benchmark import build_worker, section_for  # noqa: E402

from nemo_rl_offload.config.generation_settings import SamplingSettings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from nemo_rl_offload.config.model_presets import architecture_for

    vocab = architecture_for("llama-1b").vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, 128).tolist() for _ in range(args.batch)]
    results: dict = {}
    engine = argparse.Namespace(cuda_graphs=True, num_cuda_graphs=4)
    worker = build_worker(section_for("llama-1b", 2048, "bfloat16", engine), on_gpu=True)
    for greedy in (True, False):
        settings = SamplingSettings(max_new_tokens=args.new_tokens, greedy=greedy)
        worker.generate(prompts, settings, seed=1, pad_id=0)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        worker.generate(prompts, settings, seed=1, pad_id=0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        results[f"graphs_greedy_{greedy}"] = {
            "seconds": seconds,
            "ms_per_step": 1000 * seconds / args.new_tokens,
        }
        print(results, flush=True)
    settings = SamplingSettings(max_new_tokens=128)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        worker.generate(prompts, settings, seed=1, pad_id=0)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    print(table)
    cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    print(cpu_table)
    (args.out / "profile_generation.txt").write_text(table + "\n\n" + cpu_table)
    (args.out / "profile_generation.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
