"""What router replay (``policy.router_replay``) costs: one policy worker of an MoE preset, the
same micro-batches trained and log-probed with and without routes, alternating which goes first,
and greedy sampling with and without recording the routes.

``--routes own`` replays the routes the model's routers choose for those tokens themselves, so
the two passes route alike and differ only by the replay's own work; ``random`` replays
distinct random experts per token (balanced loads, unlike a freshly initialised router's).

    python3 benchmarks/router_replay_cost.py --model moe-1b --routes own --out DIR

Writes ``DIR/router_replay_cost_<routes>.json`` (each repetition's seconds, medians without the
first, the device and versions). Results: benchmarks/results/*_router_replay_*.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_offload.config.generation_settings import SamplingSettings


def medians(seconds: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Each pass's median over its repetitions after the first (which warms caches up)."""
    return {
        phase: {name: statistics.median(values[1:] or values) for name, values in runs.items()}
        for phase, runs in seconds.items()
    }


def _worker(model: str, port: int) -> Any:
    import torch

    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    on_gpu = torch.cuda.is_available()
    optimizer = {"optimizer": "adam", "lr": 1e-6, "use_distributed_optimizer": True}
    section = {
        "model_name": model,
        "precision": "bfloat16" if on_gpu else "float32",
        "max_total_sequence_length": 4096,
        "router_replay": {"enabled": True},
        "megatron_cfg": {"enabled": True, "optimizer": {**optimizer, "bf16": on_gpu}},
    }
    worker = PolicyWorker(
        settings=resolve_policy(section), rank=0, world_size=1, seed=7, on_gpu=on_gpu
    )
    worker.setup("127.0.0.1", port)
    return worker


def _own_routes(worker: Any, batch: dict[str, np.ndarray]) -> np.ndarray:
    """The routes the worker's routers choose over ``batch``'s tokens [rows, s, layers, k]."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from nemo_rl_offload.models import router_replay

    replays = router_replay.decoder_replays(worker.model)
    for _, replay in replays:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    worker.token_logprobs([batch])
    recorded = torch.stack([r.get_recorded_indices() for _, r in replays], dim=1)
    router_replay.disarm(worker.model)
    rows, length = batch["input_ids"].shape
    per_position = recorded.view(length, rows, *recorded.shape[1:]).transpose(0, 1)
    return per_position.cpu().numpy().astype(np.int16)


def _timed(function: Any) -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from nemo_rl_offload.config.router_replay import ROUTES_KEY

    worker = _worker(args.model, args.port)
    rng = np.random.default_rng(0)
    vocab = worker.architecture.vocab_size
    plain = []
    for _ in range(args.microbatches):
        ids = rng.integers(1, vocab, (args.rows, args.seq))
        mask = np.ones((args.rows, args.seq), np.float32)
        plain.append({"input_ids": ids, "labels": np.roll(ids, -1, 1), "loss_mask": mask})
    config = worker.model.config
    replayed = []
    for batch in plain:
        if args.routes == "own":
            routes = _own_routes(worker, batch)
        else:
            shape = (*batch["input_ids"].shape, config.num_layers, config.num_moe_experts)
            routes = np.argsort(rng.random(shape), axis=-1)[..., : config.moe_router_topk]
        replayed.append({**batch, ROUTES_KEY: routes.astype(np.int16)})

    prompts = [list(rng.integers(1, vocab, args.prompt_len)) for _ in range(args.prompts)]
    settings = SamplingSettings(max_new_tokens=args.new_tokens, greedy=True)
    sampled: dict[str, list[Any]] = {}
    generate_s: dict[str, list[float]] = {"plain": [], "record": []}
    for _ in range(2):
        for name in ("record", "plain"):
            generate_s[name].append(
                _timed(
                    lambda name=name: sampled.__setitem__(
                        name,
                        worker.generate(
                            prompts, settings, seed=1, pad_id=0, record_routes=name == "record"
                        ),
                    )
                )
            )
    seconds: dict[str, dict[str, list[float]]] = {
        "train": {"plain": [], "replay": []},
        "logprobs": {"plain": [], "replay": []},
        "generate": generate_s,
    }
    loss = {"name": "nll"}
    for repetition in range(args.repetitions):
        order = [("plain", plain), ("replay", replayed)]
        for name, data in order if repetition % 2 == 0 else order[::-1]:
            seconds["train"][name].append(_timed(lambda data=data: worker.train(data, loss)))
            seconds["logprobs"][name].append(_timed(lambda data=data: worker.token_logprobs(data)))
    import megatron.core

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": megatron.core.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "routes": args.routes,
        "shape": f"{args.microbatches} micro-batches of {args.rows} x {args.seq} tokens",
        "sampling": f"{args.prompts} prompts of {args.prompt_len} tokens, {args.new_tokens} new",
        "same_tokens_with_recording": [g.ids for g in sampled["record"]]
        == [g.ids for g in sampled["plain"]],
        "seconds": seconds,
        "median_s": medians(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="moe-1b")
    parser.add_argument("--routes", choices=("own", "random"), default="own")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repetitions", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"router_replay_cost_{args.routes}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["median_s"]))


if __name__ == "__main__":
    main()
