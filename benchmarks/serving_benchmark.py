"""The policy's HTTP server against the sampler it fronts: new tokens per second of N
concurrent ``/v1/completions`` requests (one prompt each, as NeMo-Gym's agents send them)
beside one direct sampler call over the same N prompts, on one device.

The clients run in a process of their own. Both paths sample random ``--prompt-len``-token
prompts with no stop (``ignore_eos``: every row runs to ``--new-tokens``), so they do the same
work; the ratio is what the HTTP layer,
megatron-core's endpoints and the request batching cost. Each case runs once to warm up
(kernels, CUDA graphs), then is timed.

On a GPU:
    python3 benchmarks/serving_benchmark.py --model llama-1b --requests 64,256 \\
        --new-tokens 256 --out /tmp/serving
On CPU, a smoke run of the bookkeeping:
    python3 benchmarks/serving_benchmark.py --model tiny-dense --requests 4 --prompt-len 8 \\
        --new-tokens 4 --precision float32 --out /tmp/serving
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def run_clients(url: str) -> int:
    """Send the JSON bodies on stdin to ``url`` all at once; print the seconds from the first
    send to the last answer and each answer's number of new tokens."""
    bodies = json.loads(sys.stdin.read())
    # One request first, untimed: urllib builds its opener (and loads the system's TLS
    # certificates) on its first call, a pause that would split the burst below.
    _post(url, {**bodies[0], "max_tokens": 1})
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(len(bodies), 512)) as pool:
        answers = list(pool.map(lambda body: _post(url, body), bodies))
    seconds = time.perf_counter() - began
    tokens = [len(a["choices"][0]["generation_token_ids"]) for a in answers]
    print(json.dumps({"seconds": seconds, "tokens": tokens}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        return run_clients(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--requests", type=_ints, default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument(
        "--gather-quiet-s",
        type=float,
        default=None,
        help="the sampler's burst window (default: SamplerClient's GATHER_QUIET_S)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from generation_benchmark import build_worker, section_for

    from nemo_rl_offload.config.generation_settings import SamplingSettings
    from nemo_rl_offload.data.tokenizer import ByteTokenizer
    from nemo_rl_offload.serving.http_server import PolicyServer
    from nemo_rl_offload.serving.sampler_client import SamplerClient

    on_gpu = torch.cuda.is_available()
    max_len = args.prompt_len + args.new_tokens
    graph_args = argparse.Namespace(cuda_graphs=on_gpu, num_cuda_graphs=4)
    worker = build_worker(section_for(args.model, max_len, args.precision, graph_args), on_gpu)
    tokenizer = ByteTokenizer()
    calls: list[int] = []

    call_seconds: list[float] = []

    def generate(prompts: list[list[int]], settings: SamplingSettings, seed: int) -> list:
        calls.append(len(prompts))
        began = time.perf_counter()
        generated = worker.generate(prompts, settings, seed=seed, pad_id=tokenizer.pad_id)
        if on_gpu:
            torch.cuda.synchronize()
        call_seconds.append(time.perf_counter() - began)
        return generated

    client = SamplerClient(
        generate,
        decode=tokenizer.decode,
        max_len=max_len,
        eos_id=tokenizer.eos_id,
        vocab_limit=tokenizer.vocab_size,
        max_batch=max(args.requests),
        **({} if args.gather_quiet_s is None else {"gather_quiet_s": args.gather_quiet_s}),
    )
    rng = np.random.default_rng(0)
    cases = []
    with PolicyServer(client, tokenizer, model_name=args.model) as server:
        url = f"{server.base_url}/completions"
        for count in args.requests:
            prompts = [rng.integers(0, 256, args.prompt_len).tolist() for _ in range(count)]
            settings = SamplingSettings(
                max_new_tokens=args.new_tokens, vocab_limit=tokenizer.vocab_size
            )

            def direct(prompts: list = prompts, settings: SamplingSettings = settings) -> float:
                began = time.perf_counter()
                generated = generate(prompts, settings, 1)
                seconds = time.perf_counter() - began
                assert all(len(g.ids) == args.new_tokens for g in generated)
                return seconds

            def served(prompts: list = prompts, count: int = count) -> float:
                bodies = [
                    {
                        "prompt": prompt,
                        "max_tokens": args.new_tokens,
                        "temperature": 1.0,
                        "ignore_eos": True,
                    }
                    for prompt in prompts
                ]
                # The clients run in a process of their own, as an agent framework's do (in
                # this one they would share the server's interpreter lock).
                done = subprocess.run(
                    [sys.executable, __file__, "--client", url],
                    input=json.dumps(bodies),
                    capture_output=True,
                    text=True,
                    check=True,
                )
                report = json.loads(done.stdout.strip().splitlines()[-1])
                assert report["tokens"] == [args.new_tokens] * count, report["tokens"][:4]
                return report["seconds"]

            direct(), served()  # warm-up
            calls.clear()
            direct_s = direct()
            calls.clear()
            call_seconds.clear()
            served_s = served()
            served_calls, served_call_s = list(calls), list(call_seconds)
            new_tokens = count * args.new_tokens
            case = {
                "requests": count,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "direct_s": direct_s,
                "served_s": served_s,
                "direct_new_tokens_per_s": new_tokens / direct_s,
                "served_new_tokens_per_s": new_tokens / served_s,
                "served_over_direct": direct_s / served_s,
                "sampler_calls_served": served_calls,
                # each served sampler call's own time (the rest is HTTP, waiting, formatting)
                "sampler_call_s_served": served_call_s,
            }
            cases.append(case)
            print(json.dumps(case), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import megatron.core

    record = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "model": args.model,
        "precision": args.precision,
        "cuda_graphs": on_gpu,
        "gather_quiet_s": args.gather_quiet_s,
        "cases": cases,
    }
    name = (
        "serving.json"
        if args.gather_quiet_s is None
        else f"serving_quiet{args.gather_quiet_s:g}.json"
    )
    (out / name).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
