"""Policy workers on several gloo ranks, in processes of their own (torch.multiprocessing's
spawn), for tests of what needs more than one rank: checkpoints saved with one parallel layout
and loaded with another.

A test calls :func:`run_ranks` with a function of this module; each rank's result is written
as JSON into ``out`` and returned in rank order. Spawned processes import this module by name,
so the functions live here, not in the test files.
"""

from __future__ import annotations

import json
import socket
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_offload.config.generation_settings import SamplingSettings

LOSS = {"name": "nll"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(function: Any, world: int, out: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``function(rank, world, port, out, **kwargs)`` on ``world`` spawned ranks."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        _rank_main,
        args=(function, world, _free_port(), str(out), kwargs),
        nprocs=world,
        start_method="spawn",
    )
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def _rank_main(rank: int, function: Any, world: int, port: int, out: str, kwargs: dict) -> None:
    try:
        result = function(rank, world, port, Path(out), **kwargs)
    except Exception:
        traceback.print_exc()
        raise
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    _leave()


def _leave() -> None:
    """End the rank once its result is written, without the interpreter's teardown: a gloo
    process group left to the destructors of a finishing process can abort it ("terminate
    called without an active exception", SIGABRT), which failed a CI run whose results were
    all written."""
    import os
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the other ranks have written theirs too
        dist.destroy_process_group()
    # os._exit runs no exit handler: a process this rank started would outlive it (Megatron's
    # checkpoint writer serves its results from a spawned Manager, about half a GiB each).
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def section(**megatron_cfg: Any) -> dict[str, Any]:
    """A float32 tiny-dense policy section with Adam and the given megatron_cfg keys."""
    optimizer = {"optimizer": "adam", "lr": 1e-3, "use_distributed_optimizer": False}
    optimizer.update(megatron_cfg.pop("optimizer", {}))
    return {
        "model_name": "tiny-dense",
        "precision": "float32",
        "max_total_sequence_length": 64,
        "megatron_cfg": {"enabled": True, "optimizer": optimizer, **megatron_cfg},
    }


def make_worker(rank: int, world: int, port: int, policy: dict[str, Any]) -> Any:
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    worker = PolicyWorker(
        settings=resolve_policy(policy), rank=rank, world_size=world, seed=7, on_gpu=False
    )
    worker.setup("127.0.0.1", port)
    return worker


def single_worker(policy: dict[str, Any]) -> Any:
    """A CPU policy worker of ``policy`` on one rank in this process (a second one joins the
    first one's torch.distributed and Megatron groups)."""
    return make_worker(0, 1, _free_port(), policy)


def resumes_exactly(trained: Any, policy: dict[str, Any], directory: Path, steps: Any) -> Any:
    """Save ``trained``'s checkpoint to ``directory``, load it into a fresh in-process worker of
    ``policy`` and train both on ``steps``: the same loss and gradient norm at each (asserted).
    Returns the resumed worker (the caller closes both)."""
    steps = list(steps)
    trained.save_checkpoint(str(directory))
    resumed = single_worker(policy)
    assert resumed.load_checkpoint(str(directory)) == steps[0] - 1
    for step in steps:
        want = trained.train(step_batches(step), LOSS)
        got = resumed.train(step_batches(step), LOSS)
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), step
    return resumed


def step_batches(step: int, count: int = 2, length: int = 24) -> list[dict[str, np.ndarray]]:
    """The micro-batches of one training step (the same on every layout)."""
    rng = np.random.default_rng(1000 + step)
    batches = []
    for _ in range(count):
        ids = rng.integers(1, 300, (2, length))
        mask = np.ones((2, length), np.float32)
        batches.append({"input_ids": ids, "labels": ids, "loss_mask": mask})
    return batches


def train_step(worker: Any, step: int, length: int = 24) -> dict[str, float]:
    """One step, each data-parallel rank on its share of the step's micro-batches."""
    layout = worker.parallel_layout()
    batches = step_batches(step, length=length)
    share = len(batches) // int(layout["dp_size"])
    mine = batches[int(layout["dp_rank"]) * share : (int(layout["dp_rank"]) + 1) * share]
    return worker.train(mine, LOSS)


def probe(worker: Any) -> list[float]:
    """Log-probabilities of a fixed batch: what the weights compute (on the ranks that report
    outputs; [] on the other pipeline stages)."""
    outputs = worker.token_logprobs(step_batches(99, 1))
    return [float(x) for x in outputs[0].ravel()] if outputs else []


def _result(worker: Any, metrics: dict[str, float]) -> dict[str, Any]:
    layout = worker.parallel_layout()
    return {
        "reports": bool(layout["reports"]),
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "probe": probe(worker),
    }


def train_save_and_step(
    rank: int, world: int, port: int, out: Path, policy: dict[str, Any]
) -> dict[str, Any]:
    """Two steps, a checkpoint in ``out/ckpt``, then the third step."""
    worker = make_worker(rank, world, port, policy)
    for step in (1, 2):
        train_step(worker, step)
    worker.save_checkpoint(str(out / "ckpt"))
    before = probe(worker)
    return {**_result(worker, train_step(worker, 3)), "probe_before": before}


def load_and_step(
    rank: int, world: int, port: int, out: Path, policy: dict[str, Any], ckpt: str
) -> dict[str, Any]:
    """Resume from ``ckpt``, then the third step."""
    worker = make_worker(rank, world, port, policy)
    step = worker.load_checkpoint(ckpt)
    return {**_result(worker, train_step(worker, 3)), "step": step}


PROMPTS = [[5, 17, 3, 9], [8, 2], [30, 31, 32]]


def three_sequence_pack() -> dict[str, np.ndarray]:
    """A pack of three sequences (17 tokens), each attended alone with positions restarting."""
    ids = step_batches(98, 1, length=17)[0]["input_ids"][:1]
    return {
        "input_ids": ids,
        "labels": ids,
        "cu_seqlens": np.asarray([0, 7, 12, 17], np.int32),
        "position_ids": np.concatenate([np.arange(7), np.arange(5), np.arange(5)])[None],
    }


def every_pass(worker: Any, train_length: int = 23) -> dict[str, Any]:
    """What each pass computes on fixed inputs (on the ranks that report outputs): label
    log-probabilities (of padded rows and of a pack), a teacher's top-k, greedy and sampled
    continuations, and one training step's loss and gradient norm and what the weights compute
    after it (last, since it changes the weights). Sequence lengths are odd (17, the pack, the
    prompts, the step's ``train_length``) as well as even, so a layout that pads them (sequence
    parallelism) is compared on padded lengths too."""
    batches = step_batches(99, 2)
    batches[1] = {key: value[:1, :17] for key, value in batches[1].items()}  # another shape
    logprobs = worker.token_logprobs(batches)
    packed = worker.token_logprobs([three_sequence_pack()])
    topk = worker.topk_logprobs(batches[:1], 4)
    greedy = worker.generate(
        PROMPTS, SamplingSettings(max_new_tokens=6, greedy=True), seed=3, pad_id=0
    )
    sampled = worker.generate(PROMPTS, SamplingSettings(max_new_tokens=6), seed=3, pad_id=0)
    step = train_step(worker, 7, length=train_length)
    reports = bool(worker.parallel_layout()["reports"])
    after = probe(worker)
    return {
        "reports": reports,
        "logprobs": [output.ravel().tolist() for output in logprobs],
        "shapes": [list(output.shape) for output in logprobs],
        "packed_logprobs": [output.ravel().tolist() for output in packed],
        "topk_values": topk[0][0].ravel().tolist() if topk else [],
        "topk_indices": topk[0][1].ravel().tolist() if topk else [],
        "greedy": [g.ids for g in greedy],
        "sampled": [g.ids for g in sampled],
        "sampled_logprobs": [g.logprobs for g in sampled],
        "loss": step["loss"] if reports else None,
        "grad_norm": step["grad_norm"],
        "probe_after_step": after,
        # Multi-token prediction's per-depth losses and acceptance rates (models.mtp).
        "mtp": {key: value for key, value in step.items() if key.startswith("mtp_")},
    }


def save_after_one_step(
    rank: int, world: int, port: int, out: Path, policy: dict[str, Any]
) -> dict[str, Any]:
    """One training step (weights away from their initialisation), then a checkpoint in
    ``out/ckpt``. Layouts are compared by loading it (:func:`load_then_every_pass`) on one rank
    and on theirs, so each starts the compared step from the same weights and a fresh
    optimizer."""
    worker = make_worker(rank, world, port, policy)
    train_step(worker, 1)
    worker.save_checkpoint(str(out / "ckpt"))
    return {}


def load_then_every_pass(
    rank: int,
    world: int,
    port: int,
    out: Path,
    policy: dict[str, Any],
    ckpt: str,
    train_length: int = 23,
) -> dict[str, Any]:
    """The weights of ``ckpt`` (on this layout), then :func:`every_pass`."""
    worker = make_worker(rank, world, port, policy)
    worker.load_checkpoint(ckpt, weights_only=True)
    return every_pass(worker, train_length)


def replay_routes(step: int, rows: int, length: int) -> np.ndarray:
    """Routes for the tiny MoE preset (2 MoE layers, 4 experts, top-2) that are not its
    routers' own: distinct random experts per token, the last quarter of positions without a
    route (-1), the same on every layout."""
    rng = np.random.default_rng(2000 + step)
    routes = np.argsort(rng.random((rows, length, 2, 4)), axis=-1)[..., :2].astype(np.int16)
    routes[:, -(length // 4) :] = -1
    return routes


def load_then_replay(
    rank: int, world: int, port: int, out: Path, policy: dict[str, Any], ckpt: str
) -> dict[str, Any]:
    """``policy.router_replay`` on this layout, from ``ckpt``'s weights: the routes greedy
    sampling records, label log-probabilities replaying fixed routes (padded rows and a pack),
    and a training step replaying them."""
    from nemo_rl_offload.config.router_replay import ROUTES_KEY

    worker = make_worker(rank, world, port, policy)
    worker.load_checkpoint(ckpt, weights_only=True)
    greedy = worker.generate(
        PROMPTS,
        SamplingSettings(max_new_tokens=6, greedy=True),
        seed=3,
        pad_id=0,
        record_routes=True,
    )
    batches = step_batches(99, 2, length=23)
    for index, batch in enumerate(batches):
        batch[ROUTES_KEY] = replay_routes(index, 2, 23)
    logprobs = worker.token_logprobs(batches)
    own = worker.token_logprobs(
        [{k: v for k, v in mb.items() if k != ROUTES_KEY} for mb in batches]
    )
    packed = worker.token_logprobs([{**three_sequence_pack(), ROUTES_KEY: replay_routes(5, 1, 17)}])
    layout = worker.parallel_layout()
    train = step_batches(7, length=24)
    for index, batch in enumerate(train):
        batch[ROUTES_KEY] = replay_routes(10 + index, 2, 24)
    share = len(train) // int(layout["dp_size"])
    mine = train[int(layout["dp_rank"]) * share : (int(layout["dp_rank"]) + 1) * share]
    step = worker.train(mine, LOSS)
    reports = bool(layout["reports"])
    return {
        "reports": reports,
        "greedy": [g.ids for g in greedy],
        "routes": [g.routes.tolist() for g in greedy],
        "logprobs": [output.ravel().tolist() for output in logprobs],
        "own_logprobs": [output.ravel().tolist() for output in own],
        "packed_logprobs": [output.ravel().tolist() for output in packed],
        "loss": step["loss"] if reports else None,
        "grad_norm": step["grad_norm"],
        "changed": step.get("router_replay_changed"),
    }


def dtensor_recipe_steps(rank: int, world: int, port: int, out: Path, recipe: dict, steps: int):
    """A DTensor-style recipe mapped onto megatron-core (config.dtensor_recipes) trained for
    ``steps`` steps by a policy worker: each step's lr after its scheduler step and its loss."""
    from nemo_rl_offload.config.dtensor_recipes import to_megatron

    mapped = to_megatron(recipe)
    assert not mapped.errors, mapped.errors
    worker = make_worker(rank, world, port, mapped.recipe["policy"])
    records = []
    for step in range(1, steps + 1):
        metrics = train_step(worker, step)
        records.append({"lr": metrics["lr"], "loss": metrics["loss"]})
    return {"steps": records}


def chunk_rows(rank: int, world: int, port: int, out: Path, buffer_rows: float) -> dict[str, Any]:
    """The sampler's chunk size on each rank when rank r has 3 + r prompts and the KV cache
    buffer holds ``buffer_rows`` rows, with and without that buffer."""
    from nemo_rl_offload.config.generation_settings import EngineSettings
    from nemo_rl_offload.models.cached_forward import CachedForward
    from nemo_rl_offload.policy.generation import _cache_bytes, rows_per_chunk

    worker = make_worker(rank, world, port, section())
    forward = CachedForward(worker.model, worker.architecture.vocab_size)
    gib = buffer_rows * _cache_bytes(forward, 1, 16) / 2**30
    rows = 3 + rank
    return {
        "unbounded": rows_per_chunk(forward, rows, 16, EngineSettings(), worker.device),
        "bounded": rows_per_chunk(
            forward, rows, 16, EngineSettings(buffer_size_gb=gib), worker.device
        ),
    }
