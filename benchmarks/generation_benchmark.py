"""Generation throughput of the KV-cached sampler against its memory-bandwidth floor.

For each model preset, batch size and number of new tokens, a policy worker (forward only, no
optimizer) samples from random 128-token prompts with no stop token (every row runs to the
end) and records new tokens per second. The floor: a decode step must read the weights and
every row's keys and values up to its current length once; summed over the steps, divided by
the HBM bandwidth measured in the same run (a large device-to-device copy), it gives the
fastest possible time and so the highest possible tokens/s. ``--reference N`` also times the
full-prefix sampler (every token re-runs the model over the whole prefix, what generation was
before the KV cache) over N new tokens, for the speed-up.

Output in --out: ``generation.json`` (every case, the device, torch / megatron-core versions,
the date) and ``generation.md`` (the table).

On a GPU (see docs/generation.md for the commands):
    python3 benchmarks/generation_benchmark.py --models llama-1b,moe-1b --batches 64,256 \\
        --new-tokens 256,1024,4096 --reference 64 --out /tmp/generation
On CPU, a smoke run of the bookkeeping:
    python3 benchmarks/generation_benchmark.py --models tiny-dense --batches 2 \\
        --prompt-len 8 --new-tokens 4 --reference 2 --precision float32 --out /tmp/gen
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.generation_settings import SamplingSettings

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def section_for(model: str, max_len: int, precision: str, args: argparse.Namespace) -> dict:
    return {
        "model_name": model,
        "precision": precision,
        "max_total_sequence_length": max_len,
        "megatron_cfg": {"enabled": True},
        "generation": {
            "mcore_generation_config": {
                "cuda_graph_impl": "local" if args.cuda_graphs else "none",
                "num_cuda_graphs": args.num_cuda_graphs,
            }
        },
    }


def build_worker(section: dict[str, Any], on_gpu: bool) -> Any:
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    worker = PolicyWorker(
        settings=resolve_policy(section),
        rank=0,
        world_size=1,
        seed=1,
        on_gpu=on_gpu,
        trainable=False,
    )
    worker.setup(*worker.node_address())
    return worker


def hbm_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second of a large device copy (each byte read once and written once)."""
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * n / min(times)


def floor_seconds(
    weight_bytes: int, kv_bytes_per_token: int, batch: int, prompt: int, new: int, bw: float
) -> float:
    """Every decode step reads the weights and each row's cache up to its length once (the
    prefill step reads the weights once too)."""
    steps = range(new)
    read = sum(weight_bytes + batch * (prompt + t) * kv_bytes_per_token for t in steps)
    return read / bw


def model_bytes(worker: Any, dtype_bytes: int) -> tuple[int, int]:
    """Bytes of the weights and of one token's keys and values over all layers."""
    from nemo_rl_offload.models.attention import SDPACoreAttention

    model = worker.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    groups = layers[0].num_query_groups_per_partition
    per_token = 2 * len(layers) * groups * layers[0].config.kv_channels * dtype_bytes
    return weights, per_token


def full_prefix_rate(worker: Any, prompts: list[list[int]], new: int) -> float:
    """New tokens per second of greedy sampling that re-runs the model over the whole prefix
    for every token (no cache): the sampler before the KV cache, for the speed-up."""
    import torch

    ids = torch.tensor(prompts, device=worker.device)
    model = worker.model
    model.eval()
    _sync(worker)
    start = time.perf_counter()
    with torch.no_grad(), worker.runtime.forward_only():
        for _ in range(new):
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            logits = model(ids, positions, None)[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    _sync(worker)
    return len(prompts) * new / (time.perf_counter() - start)


def _sync(worker: Any) -> None:
    import torch

    if worker.on_gpu:
        torch.cuda.synchronize()


def run_case(
    worker: Any, vocab: int, batch: int, prompt_len: int, new: int, seed: int
) -> tuple[dict[str, Any], list[list[int]]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (batch, prompt_len), generator=generator).tolist()
    settings = SamplingSettings(max_new_tokens=new)
    worker.generate(prompts, SamplingSettings(max_new_tokens=2), seed=seed, pad_id=0)  # warm-up
    if worker.on_gpu:
        torch.cuda.reset_peak_memory_stats()
    _sync(worker)
    start = time.perf_counter()
    out = worker.generate(prompts, settings, seed=seed, pad_id=0)
    _sync(worker)
    seconds = time.perf_counter() - start
    tokens = sum(len(g.ids) for g in out)
    record = {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "generated_tokens": tokens,
    }
    if worker.on_gpu:
        record["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return record, prompts


def table(payload: dict[str, Any]) -> str:
    env = payload["environment"]
    lines = [
        f"Generation throughput on {env['device']} (torch {env['torch']}, megatron-core "
        f"{env['megatron_core']}, {payload['date']}); HBM copy bandwidth "
        f"{payload['hbm_gbps']:.0f} GB/s; CUDA graphs asked for: {payload['cuda_graphs']} "
        "(the graphs column: whether a model's decode steps ran as graphs).",
        "",
        "| model | graphs | batch | new tokens | tokens/s | floor tokens/s | of floor "
        "| full-prefix tokens/s | speed-up | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["cases"]:
        ref = r.get("full_prefix_tokens_per_s")
        lines.append(
            f"| {r['model']} | {'yes' if r.get('decode_graphs') else 'no'} | {r['batch']} | "
            f"{r['new_tokens']} | {r['tokens_per_s']:.0f} | "
            f"{r['floor_tokens_per_s']:.0f} | {r['of_floor']:.0%} | "
            f"{f'{ref:.0f}' if ref else '-'} | "
            f"{f'{r["tokens_per_s"] / ref:.1f}x' if ref else '-'} | "
            f"{r.get('peak_gpu_memory_gib', float('nan')):.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-1b,moe-1b")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", default="256,1024,4096")
    parser.add_argument("--precision", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="eager decode steps"
    )
    parser.add_argument("--num-cuda-graphs", type=int, default=4)
    parser.add_argument(
        "--moe-experts",
        choices=("dense", "routed"),
        default="dense",
        help="decode steps of a model with experts: every token through every expert "
        "(models/moe_decode.py, graphable) or Megatron's routed experts (eager; the path "
        "before moe_decode, for comparison)",
    )
    parser.add_argument(
        "--reference",
        type=int,
        default=0,
        help="also time the full-prefix sampler over this many new tokens (0: not)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import megatron.core
    import torch

    from nemo_rl_offload.config.model_presets import architecture_for, has_experts

    on_gpu = torch.cuda.is_available()
    if args.moe_experts == "routed":
        from nemo_rl_offload.models import moe_decode
        from nemo_rl_offload.policy import generation

        moe_decode.dense_usable = generation.dense_usable = lambda layer: False
    bandwidth = hbm_bandwidth()
    element = 2 if args.precision == "bfloat16" else 4
    cases = []
    for model in args.models.split(","):
        longest = args.prompt_len + max(_ints(args.new_tokens))
        worker = build_worker(section_for(model, longest, args.precision, args), on_gpu)
        architecture = architecture_for(model)
        vocab = architecture.vocab_size
        # Decode steps of a model with experts are graphed on the dense expert path only.
        routed = args.moe_experts == "routed" and has_experts(architecture.num_moe_experts)
        graphed = bool(args.cuda_graphs and on_gpu and not routed)
        weights, per_token = model_bytes(worker, element)
        for batch in _ints(args.batches):
            for new in _ints(args.new_tokens):
                try:
                    record, prompts = run_case(worker, vocab, batch, args.prompt_len, new, seed=1)
                except Exception as error:  # e.g. a KV cache that does not fit: recorded
                    print(f"{model} batch {batch} new {new}: {error}", file=sys.stderr)
                    cases.append(
                        {"model": model, "batch": batch, "new_tokens": new, "error": str(error)}
                    )
                    continue
                floor = floor_seconds(weights, per_token, batch, args.prompt_len, new, bandwidth)
                record.update(
                    model=model,
                    decode_graphs=graphed,
                    moe_experts=args.moe_experts
                    if has_experts(architecture.num_moe_experts)
                    else None,
                    weight_bytes=weights,
                    kv_bytes_per_token=per_token,
                    floor_s=floor,
                    floor_tokens_per_s=batch * new / floor,
                    of_floor=floor / record["seconds"],
                )
                if args.reference:
                    record["full_prefix_new_tokens"] = args.reference
                    record["full_prefix_tokens_per_s"] = full_prefix_rate(
                        worker, prompts, args.reference
                    )
                cases.append(record)
                print(json.dumps(record), flush=True)
        worker.close()
        del worker
        if on_gpu:
            torch.cuda.empty_cache()
    payload = {
        "environment": {
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "torch": torch.__version__,
            "megatron_core": megatron.core.__version__,
        },
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hbm_gbps": bandwidth / 1e9,
        "cuda_graphs": bool(args.cuda_graphs and on_gpu),
        "num_cuda_graphs": args.num_cuda_graphs,
        "cases": cases,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generation.json").write_text(json.dumps(payload, indent=1))
    ok = {**payload, "cases": [c for c in cases if "error" not in c]}
    (args.out / "generation.md").write_text(table(ok))
    print(table(ok))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
