"""Autoregressive sampling with the policy itself, colocated on its workers, with a KV cache.

One prefill pass, then decode steps that feed each row its newest token and attend over the
cache (:mod:`models.kv_cache`, :mod:`models.cached_forward`), on the policy's own weights; all
ranks agree on each token. Each token comes with its log-probability (:class:`Generated`).
CUDA graphs, shrinking batches and chunked calls: docs/generation.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from torch import Tensor

from nemo_rl_offload.config.generation_settings import EngineSettings, SamplingSettings
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models.attention import kv_cache_attached
from nemo_rl_offload.models.cached_forward import CachedForward
from nemo_rl_offload.models.kv_cache import KVCache
from nemo_rl_offload.models.moe_decode import dense_usable, experts_for_every_token
from nemo_rl_offload.policy.decode_graphs import DecodeGraphs, windows
from nemo_rl_offload.progress import Progress

_MCORE = "policy.generation.mcore_generation_config"


@dataclass(frozen=True)
class Generated:
    """One sampled continuation of a prompt: its token ids (without the prompt; the stop token
    included when hit) and each token's log-probability under the model (docs/generation.md);
    with ``record_routes``, each position's experts (prompt and continuation,
    [positions, MoE layers, k], -1 where no forward fed the position: ``models.router_replay``)."""

    ids: list[int]
    logprobs: list[float]
    routes: np.ndarray | None = None


def _filter_logits(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    logits = logits / max(settings.temperature, 1e-6)
    if settings.top_k and settings.top_k > 0:  # -1 (or null): no cut, as in NeMo-RL
        kth = torch.topk(logits, min(settings.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > settings.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


# The share of the GPU memory free at a call that its KV cache may take: the prefill's
# activations and the logits need the rest.
KV_CACHE_FREE_FRACTION = 0.6


def _attention_layers(forward: CachedForward) -> list[Any]:
    from nemo_rl_offload.models.attention import SDPACoreAttention

    layers = [m for m in forward.gpt.modules() if isinstance(m, SDPACoreAttention)]
    if not layers and forward.gpt.decoder.layers:
        raise UserInputError(
            "policy.megatron_cfg.transformer_impl: generation needs the local layer spec's "
            "attention (set transformer_impl: local)"
        )
    return layers


def _cache_shape(
    forward: CachedForward, layers: list[Any], rows: int, max_len: int
) -> dict[str, int]:
    groups = layers[0].num_query_groups_per_partition if layers else 1
    return {
        "rows": rows,
        "max_len": max_len,
        "groups": groups,
        "head_dim": forward.config.kv_channels,
    }


def _cache_bytes(forward: CachedForward, rows: int, max_len: int) -> int:
    layers = _attention_layers(forward)
    shape = _cache_shape(forward, layers, rows, max_len)
    return KVCache.nbytes(len(layers), dtype=forward.dtype, **shape)


def rows_per_chunk(
    forward: CachedForward, rows: int, max_len: int, engine: EngineSettings, device: torch.device
) -> int:
    """The most rows (a multiple of ``forward.multiple``, at most ``rows``) whose KV cache fits
    the recipe's buffer and :data:`KV_CACHE_FREE_FRACTION` of the free GPU memory, the same on
    every rank (the smallest over ranks); refuses (one line) when not even one row's does."""
    per_row = _cache_bytes(forward, 1, max_len)
    budget = math.inf
    if engine.buffer_size_gb is not None:
        budget = engine.buffer_size_gb * 2**30
    free = math.inf
    if device.type == "cuda":
        available, _ = torch.cuda.mem_get_info(device)
        free = available + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = min(budget, KV_CACHE_FREE_FRACTION * free)
    multiple = forward.multiple
    # What the budget holds, agreed before this rank's own row count caps it: a rank with
    # fewer prompts must not make the others split theirs.
    unbounded = 2**62
    fit = unbounded if budget == math.inf else int(budget // per_row) // multiple * multiple
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        agreed = torch.tensor([min(fit, unbounded)], device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        fit = int(agreed)
    fit = min(fit, rows)
    if fit < multiple:
        need = per_row * multiple / 2**30
        if engine.buffer_size_gb is not None and per_row * multiple > engine.buffer_size_gb * 2**30:
            raise UserInputError(
                f"{_MCORE}.buffer_size_gb: one row's KV cache needs {need:.2f} GiB, more than "
                f"{engine.buffer_size_gb} GiB; raise it or lower max_new_tokens"
            )
        raise UserInputError(
            f"{_MCORE}.buffer_size_gb: one row's KV cache needs {need:.2f} GiB, but "
            f"{free / 2**30:.2f} GiB of GPU memory are free on some rank; lower max_new_tokens "
            "or the prompts' length"
        )
    return fit


def _allocate(forward: CachedForward, rows: int, max_len: int, device: torch.device) -> KVCache:
    layers = _attention_layers(forward)
    numbers = [m.layer_number for m in layers]
    shape = _cache_shape(forward, layers, rows, max_len)
    return KVCache.allocate(numbers, dtype=forward.dtype, device=device, **shape)


def _graphable(forward: CachedForward, device: torch.device, *, recording: bool) -> bool:
    """A decode step without host synchronisation (see docs/generation.md): an MoE model's
    when every MoE layer takes the dense decode path (``models.moe_decode``) and no routes
    are recorded (a graph's replay would not record them)."""
    if device.type != "cuda" or forward.pp != 1 or forward.sp:
        return False
    if not forward.config.num_moe_experts:
        return True
    layers = [m for m in forward.gpt.modules() if isinstance(m, MoELayer)]
    return not recording and all(dense_usable(layer) for layer in layers)


def _stop_together() -> bool:
    """Expert-parallel ranks exchange tokens in every step: all of them take the same number
    of steps, so one rank stops only when every rank's rows are done."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size() > 1


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    settings: SamplingSettings,
    *,
    pad_id: int,
    vocab_size: int,
    seed: int,
    device: torch.device,
    engine: EngineSettings | None = None,
    record_routes: bool = False,
) -> list[Generated]:
    """The sampled continuation of each prompt, with its tokens' log-probabilities (and, with
    ``record_routes``, the experts of every position); in chunks of rows whose KV cache fits
    (docs/generation.md), drawn with one generator."""
    if not prompts:
        return []
    engine = engine or EngineSettings()
    forward = CachedForward(model, vocab_size)
    multiple = forward.multiple
    rows = math.ceil(len(prompts) / multiple) * multiple
    longest = max(len(p) for p in prompts)
    max_len = max(math.ceil(longest / multiple) * multiple, longest + settings.max_new_tokens)
    chunk = rows_per_chunk(forward, rows, max_len, engine, device)
    chunks = _chunks(prompts, chunk, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    limit = min(vocab_size, settings.vocab_limit or vocab_size)
    was_training = model.training
    model.eval()
    progress = _progress(len(prompts))
    began = time.monotonic()
    try:
        out: list[Generated] = []
        for part, real in chunks:
            report = _reporter(progress, began, len(out), sum(len(g.ids) for g in out))
            done = _sample_rows(
                forward,
                part,
                settings,
                pad_id,
                limit,
                generator,
                device,
                engine,
                record_routes,
                progress=report,
            )
            out.extend(done[:real])
        return out
    finally:
        progress.finish(len(prompts))
        model.train(was_training)


def _reporter(
    progress: Progress, began: float, rows_before: int, tokens_before: int
) -> Callable[[int, int], None]:
    """What a chunk tells ``progress``: the call's rows finished and new tokens per second."""

    def report(finished: int, new: int) -> None:
        rate = (tokens_before + new) / max(time.monotonic() - began, 1e-9)
        progress.update(rows_before + finished, new_tokens_per_s=rate)

    return report


def _progress(rows: int) -> Progress:
    """Rows finished during a long call, from the first rank only (the driver announced the
    phase and repeats its heartbeat; this says how far the sampler is)."""
    first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    progress = Progress("sampler", enabled=first)
    progress.start("generation", rows, unit="rows", announce=False)
    return progress


def _chunks(
    prompts: list[list[int]], rows: int, device: torch.device
) -> list[tuple[list[list[int]], int]]:
    """``prompts`` in consecutive chunks of at most ``rows`` (each with how many of its prompts
    are real). Expert-parallel ranks exchange tokens in every forward, so all of them run as
    many chunks as the rank that needs the most: a rank with fewer prompts than that repeats its
    first prompt in chunks whose results it drops."""
    count = max(1, math.ceil(len(prompts) / rows))
    if _stop_together():
        agreed = torch.tensor([count], device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        count = int(agreed)
    size = math.ceil(len(prompts) / count)
    parts = []
    for index in range(count):
        part = prompts[index * size : (index + 1) * size]
        parts.append((part or prompts[:1], len(part)))
    return parts


def _sample_rows(
    forward: CachedForward,
    prompts: list[list[int]],
    settings: SamplingSettings,
    pad_id: int,
    limit: int,
    generator: torch.Generator,
    device: torch.device,
    engine: EngineSettings,
    record_routes: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[Generated]:
    """One chunk of :func:`sample`: its prompts through one KV cache; ``progress`` hears the
    rows finished and the tokens sampled at each stop check."""
    multiple = forward.multiple
    count = len(prompts)
    rows = math.ceil(count / multiple) * multiple  # padded: the decode layout splits rows
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    longest = int(lengths.max())
    prefill = math.ceil(longest / multiple) * multiple
    max_len = max(prefill, longest + settings.max_new_tokens)
    ids = torch.full((count, max_len), pad_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
    start = lengths.clone()
    done = torch.zeros(count, dtype=torch.bool, device=device)
    stops = torch.tensor(settings.stop_token_ids, device=device)
    real = torch.arange(count, device=device)
    logprobs = torch.zeros(ids.shape, dtype=torch.float, device=device)
    check_every = 16 if device.type == "cuda" else 1  # a stop check synchronises with the host

    recorder = None
    if record_routes:
        from nemo_rl_offload.models.router_replay import Recorder

        recorder = Recorder(forward.gpt, count, max_len, device)
    recording = recorder.forward if recorder else contextlib.nullcontext
    # Finished rows leave the batch (docs/generation.md); recorded routes are kept per row of
    # the call and expert-parallel ranks step together, so there every row stays.
    compact = recorder is None and not _stop_together()
    cache = _allocate(forward, rows, max_len, device)
    table = forward.rotary_table(max_len)
    slots = _Slots.of(real, rows, pad_id)

    def decode_step() -> torch.Tensor:
        return forward.logits(slots.tokens, table[cache.positions], slots.index, slots.zeros)

    graphs = (
        DecodeGraphs(decode_step, cache)
        if engine.cuda_graphs and _graphable(forward, device, recording=recorder is not None)
        else None
    )
    spans = windows(longest + 1, max_len, engine.num_cuda_graphs if graphs else None)
    retired: list[DecodeGraphs] = []
    try:
        with kv_cache_attached(forward.gpt, cache), contextlib.ExitStack() as decoding:
            batch = torch.full((rows, prefill), pad_id, dtype=torch.long, device=device)
            batch[:count] = ids[:, :prefill]
            with recording():
                full = forward.logits(batch, table[:prefill], lengths - 1, real)
            if recorder:
                recorder.prefill(rows, lengths)
            cache.decoding = True
            decoding.enter_context(experts_for_every_token())
            for step in range(settings.max_new_tokens):
                active = slots.active
                if step > 0:
                    last = lengths[active] - 1
                    cache.positions[: active.numel()] = last
                    slots.tokens[0, : active.numel()] = ids[active, last]
                    window = spans(longest + step)
                    with recording():
                        full = graphs.run(window) if graphs else _eager(cache, window, decode_step)
                    if recorder:
                        recorder.decode(cache.positions[:count])
                logits = full[:, :limit]
                if settings.greedy:
                    token = logits.argmax(dim=-1)
                else:
                    probs = torch.softmax(_filter_logits(logits, settings), dim=-1)
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                finished = done[active]
                token = torch.where(finished, torch.full_like(token, pad_id), token)
                scaled = full if settings.greedy else full / max(settings.temperature, 1e-6)
                chosen = scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
                    scaled, dim=-1
                )
                at = lengths[active]
                ids[active, at] = token
                logprobs[active, at] = chosen
                lengths[active] = torch.where(finished, at, at + 1)
                done[active] = finished | torch.isin(token, stops)
                if (step + 1) % check_every == 0:
                    if _all_done(done):
                        break
                    if progress is not None:
                        finished_rows, new = torch.stack([done.sum(), (lengths - start).sum()])
                        progress(int(finished_rows), int(new))
                    if compact:
                        kept = (~done[active]).nonzero().squeeze(1)
                        size = _slots_for(kept.numel(), multiple)
                        if size <= slots.size // 2:
                            cache.keep_rows(kept, size)
                            slots = _Slots.of(active[kept], size, pad_id)
                            if graphs:
                                # The larger batch's graphs stay alive to the call's end: a
                                # memory pool whose graphs are all gone is freed, and capturing
                                # into it again fails.
                                retired.append(graphs)
                                graphs = DecodeGraphs(decode_step, cache, pool=graphs.pool)
    finally:
        for done_graphs in [*retired, graphs] if graphs else retired:
            done_graphs.release()
    routes = recorder.finish() if recorder else None
    ends = lengths.tolist()
    return [
        Generated(
            ids[row, start[row] : lengths[row]].tolist(),
            logprobs[row, start[row] : lengths[row]].tolist(),
            None if routes is None else routes[row, : ends[row]],
        )
        for row in range(count)
    ]


@dataclass(frozen=True)
class _Slots:
    """The rows a decode step feeds: ``active`` (the call's row in each slot in use, in the
    order the slots hold them) and the step's inputs for ``size`` slots, the ones past
    ``active`` padding; the inputs stay in place while the batch keeps its size (graphs
    replay them)."""

    active: Tensor
    size: int
    tokens: Tensor
    index: Tensor
    zeros: Tensor

    @classmethod
    def of(cls, active: Tensor, size: int, pad_id: int) -> _Slots:
        device, count = active.device, active.numel()
        return cls(
            active,
            size,
            torch.full((1, size), pad_id, dtype=torch.long, device=device),
            torch.arange(count, device=device),
            torch.zeros(count, dtype=torch.long, device=device),
        )


def _slots_for(rows: int, multiple: int) -> int:
    """The batch size ``rows`` unfinished rows decode in: a power of two (few sizes, so few
    graphs), a multiple of ``multiple`` (sequence parallelism splits the rows)."""
    size = 1 << max(rows - 1, 0).bit_length()
    return math.ceil(size / multiple) * multiple


def _eager(cache: KVCache, window: int, step: Any) -> torch.Tensor:
    """One decode step outside a graph: its window is one position longer than the last.
    cuDNN's attention, which torch prefers for masked attention on Hopper, builds a plan per
    new shape, so an eager step would pay a plan build per layer; the memory-efficient kernel
    takes any length as it comes (math where it cannot run, e.g. on CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cache.window = window
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return step()


def _all_done(done: torch.Tensor) -> bool:
    if not _stop_together():
        return bool(done.all())
    pending = (~done).any().to(torch.int)
    torch.distributed.all_reduce(pending)
    return int(pending) == 0
