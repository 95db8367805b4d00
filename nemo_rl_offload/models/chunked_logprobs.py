"""``policy.logprob_chunk_size``: label log-probabilities in chunks of the sequence; and
GRPO's sampling temperature on the logits they come from (:func:`install`).

Why: the model's per-token loss (minus each label's log-probability, what every algorithm's
token log-probs and the SFT, GRPO and DPO losses come from) is Megatron's vocab-parallel cross
entropy, which upcasts the whole logits tensor [seq, batch, vocab] to float32 and keeps its
float32 softmax for the backward pass: at long context and a large vocabulary that copy is the
largest tensor of the step. With a chunk size, :func:`install` replaces the model's
``compute_language_model_loss`` with one that takes the float32 log-softmax ``chunk`` positions
at a time and keeps only each position's log-sum-exp; the backward pass recomputes each chunk's
softmax from the logits. The output layer still materialises the logits themselves (in the
model's precision): they are the output layer's result, which this does not change.

Exact: the same log-sum-exp and label logit per position, reduced over the tensor-parallel
vocabulary shards as Megatron does. Teacher top-k scores take their float32 log-softmax in the
same chunks (``PolicyWorker.topk_logprobs``); the distillation loss's log-softmax over the
student's logits is not chunked.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor


def _all_reduce(tensor: Tensor, op: Any, group: Any) -> None:
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(tensor, op=op, group=group)


class ChunkedVocabParallelLogprob(torch.autograd.Function):
    """log p(target) from vocab-parallel logits [s, b, v/tp], ``chunk`` positions at a time."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, chunk: int, group: Any) -> Tensor:
        shard = logits.size(-1)
        rank = group.rank() if group is not None else 0
        first = rank * shard
        logprobs = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        for lo in range(0, logits.size(0), chunk):
            x = logits[lo : lo + chunk].float()
            top = x.max(dim=-1).values
            _all_reduce(top, torch.distributed.ReduceOp.MAX, group)
            sum_exp = (x - top.unsqueeze(-1)).exp().sum(dim=-1)
            _all_reduce(sum_exp, torch.distributed.ReduceOp.SUM, group)
            t = target[lo : lo + chunk]
            here = (t >= first) & (t < first + shard)
            index = (t - first).clamp(0, shard - 1).unsqueeze(-1)
            picked = x.gather(-1, index).squeeze(-1) * here
            _all_reduce(picked, torch.distributed.ReduceOp.SUM, group)
            lse[lo : lo + chunk] = top + sum_exp.log()
            logprobs[lo : lo + chunk] = picked - lse[lo : lo + chunk]
        ctx.save_for_backward(logits, target, lse)
        ctx.chunk, ctx.first = chunk, first
        return logprobs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        logits, target, lse = ctx.saved_tensors
        shard, first = logits.size(-1), ctx.first
        grad_logits = torch.empty_like(logits)
        for lo in range(0, logits.size(0), ctx.chunk):
            g = grad[lo : lo + ctx.chunk].float()
            softmax = (
                logits[lo : lo + ctx.chunk].float() - lse[lo : lo + ctx.chunk, ..., None]
            ).exp()
            piece = -softmax * g.unsqueeze(-1)
            t = target[lo : lo + ctx.chunk]
            here = (t >= first) & (t < first + shard)
            index = (t - first).clamp(0, shard - 1).unsqueeze(-1)
            piece.scatter_add_(-1, index, (g * here).unsqueeze(-1))
            grad_logits[lo : lo + ctx.chunk] = piece.to(logits.dtype)
        return grad_logits, None, None, None


def chunked_label_loss(labels: Tensor, logits: Tensor, chunk: int) -> Tensor:
    """Megatron's ``compute_language_model_loss`` contract: labels [b, s], logits [s, b, v/tp]
    -> minus the labels' log-probabilities [b, s], in float32."""
    from megatron.core import parallel_state

    group = (
        parallel_state.get_tensor_model_parallel_group()
        if parallel_state.get_tensor_model_parallel_world_size() > 1
        else None
    )
    target = labels.transpose(0, 1).contiguous()
    logprobs = ChunkedVocabParallelLogprob.apply(logits, target, int(chunk), group)
    return (-logprobs).transpose(0, 1).contiguous()


def install(model: Any, chunk: int | None, temperature: float = 1.0) -> None:
    """Make ``model`` (a GPTModel, or a wrapper around one) compute its per-token loss in
    chunks of ``chunk`` positions, and of the logits divided by ``temperature``: the
    distribution GRPO's sampler draws from, whose log-probabilities NeMo-RL's training, old
    and reference passes take (its ``apply_temperature_scaling``). None or 0 and 1.0 leave the
    model as it is."""
    if not chunk and temperature == 1.0:
        return
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)
    plain = inner.compute_language_model_loss  # Megatron's, bound to this model

    def compute_language_model_loss(self: Any, labels: Tensor, logits: Tensor) -> Tensor:
        if temperature != 1.0:
            logits = logits / temperature
        if chunk:
            return chunked_label_loss(labels, logits, chunk)
        return plain(labels, logits)

    inner.compute_language_model_loss = types.MethodType(compute_language_model_loss, inner)


def topk_logprobs(logits: Tensor, k: int | None, chunk: int | None) -> dict[str, Tensor]:
    """The top-k float32 next-token log-probabilities of [b, s, v] logits (full vocabulary) and
    their token ids (all of them, no ids, when ``k`` is None), taken ``chunk`` positions at a
    time so that only one chunk's float32 log-softmax exists at once (forward-only)."""
    step = int(chunk) if chunk else logits.size(1)
    values, indices = [], []
    for lo in range(0, logits.size(1), step):
        logprobs = torch.log_softmax(logits[:, lo : lo + step].float(), dim=-1)
        if k is None:
            values.append(logprobs)
            continue
        top = logprobs.topk(k, dim=-1)
        values.append(top.values)
        indices.append(top.indices)
    out = {"values": torch.cat(values, dim=1)}
    if indices:
        out["indices"] = torch.cat(indices, dim=1)
    return out
