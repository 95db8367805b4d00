"""Autoregressive sampling with the policy itself (no separate inference engine).

Prompts are right-padded into one batch; with causal attention the padding after a row's last
token cannot influence that token's logits, so each step runs the model over the batch and
samples, for every unfinished row, the token after its current end. There is no KV cache: each
step recomputes the prefix, which is cheap for the short answers of the built-in tasks and keeps
one model code path (training and sampling share the forward, through Megatron's schedule, so
pipeline stages exchange activations as in training). The last pipeline stage's next-token
logits are broadcast to the other stages, and every rank draws with the same generator state,
so all tensor- and pipeline-parallel ranks agree on each token.

Each sampled token comes with its log-probability under the model (:class:`Generated`): the
log-softmax over the model's whole vocabulary of the next-token logits divided by the sampling
temperature (raw logits when greedy), before top-k and top-p: what GRPO's training forward
computes for the same token (it takes the temperature too, as NeMo-RL's does, and no filter).
GRPO compares the two (importance sampling, the sequence log-probability error); another engine
(e.g. one with a KV cache) returns the same pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Generated:
    """One sampled continuation of a prompt: its token ids (without the prompt; the stop token
    included when hit) and each token's log-probability under the model (module docstring)."""

    ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Sample only ids the tokenizer knows (a model's embedding table may be larger).
    vocab_limit: int | None = None

    @classmethod
    def from_recipe(
        cls,
        generation: dict[str, Any] | None,
        *,
        eos_id: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        vocab_limit: int | None = None,
    ) -> SamplingSettings:
        generation = generation or {}
        stops = tuple(generation.get("stop_token_ids") or ()) + (eos_id,)
        return cls(
            max_new_tokens=max_new_tokens or int(generation.get("max_new_tokens", 64)),
            temperature=float(generation.get("temperature", 1.0)),
            top_p=float(generation.get("top_p", 1.0)),
            top_k=generation.get("top_k"),
            greedy=greedy,
            stop_token_ids=stops,
            vocab_limit=vocab_limit,
        )


def _filter_logits(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    logits = logits / max(settings.temperature, 1e-6)
    if settings.top_k:
        kth = torch.topk(logits, settings.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > settings.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def _full_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Logits are split over the vocabulary across tensor-parallel ranks: gather them."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits


def _next_token_logits(
    model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor, limit: int
) -> torch.Tensor:
    """Float32 logits [rows, limit] of the token after each row's end, on every rank (``limit``
    is the model's vocabulary size: the part of it the tokenizer knows is cut by the caller)."""
    from megatron.core import parallel_state

    from nemo_rl_offload.models.train_step import forward_outputs

    rows = torch.arange(ids.shape[0], device=ids.device)

    def at_row_ends(batch: dict[str, torch.Tensor], logits: torch.Tensor) -> dict:
        ends = logits[rows, lengths - 1]  # padded rows (pipeline parallel) are cut off after
        return {"logits": _full_vocab(ends)[:, :limit].float()}

    outputs = forward_outputs(model, [{"input_ids": ids}], at_row_ends, per_position=False)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return outputs[0]["logits"]
    logits = (
        outputs[0]["logits"] if outputs else ids.new_empty((ids.shape[0], limit), dtype=torch.float)
    )
    torch.distributed.broadcast(
        logits,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return logits


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
) -> list[Generated]:
    """The sampled continuation of each prompt, with its tokens' log-probabilities."""
    if not prompts:
        return []
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    total = int(lengths.max()) + settings.max_new_tokens
    ids = torch.full((len(prompts), total), pad_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
    start = lengths.clone()
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    stops = torch.tensor(settings.stop_token_ids, device=device)
    rows = torch.arange(len(prompts), device=device)
    limit = min(vocab_size, settings.vocab_limit or vocab_size)
    logprobs = torch.zeros(ids.shape, dtype=torch.float, device=device)
    model.eval()
    for _ in range(settings.max_new_tokens):
        width = int(lengths.max())
        full = _next_token_logits(model, ids[:, :width], lengths, vocab_size)
        logits = full[:, :limit]
        if settings.greedy:
            token = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(_filter_logits(logits, settings), dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        scaled = full if settings.greedy else full / max(settings.temperature, 1e-6)
        chosen = scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
            scaled, dim=-1
        )
        ids[rows, lengths] = token
        logprobs[rows, lengths] = chosen
        lengths = torch.where(done, lengths, lengths + 1)
        done |= torch.isin(token, stops)
        if bool(done.all()):
            break
    model.train()
    return [
        Generated(
            ids[row, start[row] : lengths[row]].tolist(),
            logprobs[row, start[row] : lengths[row]].tolist(),
        )
        for row in range(len(prompts))
    ]
