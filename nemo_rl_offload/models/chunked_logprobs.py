"""``policy.logprob_chunk_size``: label log-probabilities in chunks of the sequence (and, with
``policy.megatron_cfg.chunked_output_layer``, the output layer in those chunks too); and GRPO's
sampling temperature on the logits they come from (:func:`install`).

Megatron's plain path holds the whole sequence's logits with a float32 copy, the largest tensors
of a long-context step; the two depths installed here avoid that, with the same values. What
each depth keeps and costs: docs/packing.md.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


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
            sum_exp = torch.sub(x, top.unsqueeze(-1)).exp_().sum(dim=-1)
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
        # A leaf's values belong to its caller: its gradient gets memory of its own.
        ctx.gradient_in_place = not logits.is_leaf
        return logprobs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        """The logits' gradient, written over the saved logits a chunk at a time (each chunk's
        softmax is read before its gradient replaces it): the backward holds the logits once,
        not the logits and a gradient beside them. Should another autograd node have saved the
        same logits, its backward fails on their version counter rather than reading the
        gradient. Logits that are a leaf (a caller's own tensor) are left as they are."""
        logits, target, lse = ctx.saved_tensors
        shard, first = logits.size(-1), ctx.first
        grad_logits = logits if ctx.gradient_in_place else torch.empty_like(logits)
        for lo in range(0, logits.size(0), ctx.chunk):
            g = grad[lo : lo + ctx.chunk].float()
            piece = logits[lo : lo + ctx.chunk].float()
            piece.sub_(lse[lo : lo + ctx.chunk, ..., None]).exp_().mul_(-g.unsqueeze(-1))
            t = target[lo : lo + ctx.chunk]
            here = (t >= first) & (t < first + shard)
            index = (t - first).clamp(0, shard - 1).unsqueeze(-1)
            piece.scatter_add_(-1, index, (g * here).unsqueeze(-1))
            grad_logits[lo : lo + ctx.chunk].copy_(piece)
        return grad_logits, None, None, None


def chunked_label_loss(labels: Tensor, logits: Tensor, chunk: int) -> Tensor:
    """Megatron's ``compute_language_model_loss`` contract: labels [b, s], logits [s, b, v/tp]
    -> minus the labels' log-probabilities [b, s], in float32."""
    target = labels.transpose(0, 1).contiguous()
    logprobs = ChunkedVocabParallelLogprob.apply(logits, target, int(chunk), _tp_group(None))
    return (-logprobs).transpose(0, 1).contiguous()


def _tp_group(output_layer: Any) -> Any:
    """The tensor-parallel group the vocabulary is split over when it has more than one rank,
    else None: the output layer's own group, or (None, or a layer without one) Megatron's."""
    group = getattr(output_layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            group = parallel_state.get_tensor_model_parallel_group()
    return group if group is not None and group.size() > 1 else None


def _chunk_logprobs(
    hidden: Tensor,
    output_weight: Tensor | None,
    labels: Tensor,
    *,
    lo: int,
    output_layer: Any,
    scale_logits: Any,
    temperature: float,
    group: Any,
    ranks: int,
    softmax_chunk: int | None = None,
) -> Tensor:
    """log p(label) of one chunk of hidden states [n, b, h] (positions ``lo`` to ``lo + n`` of
    each of ``ranks`` equal slices of the sequence, in rank order: the output layer's
    sequence-parallel gather; ``ranks`` 1 without it) -> [ranks * n, b] float32."""
    logits, _ = output_layer(hidden, weight=output_weight, runtime_gather_output=False)
    if scale_logits is not None:
        logits = scale_logits(logits)
    if temperature != 1.0:
        logits = logits / temperature
    rows, n = labels.size(0), hidden.size(0)
    target = labels.reshape(rows, ranks, -1)[:, :, lo : lo + n]  # [b, ranks, n]
    target = target.permute(1, 2, 0).reshape(ranks * n, rows)
    return ChunkedVocabParallelLogprob.apply(logits, target, softmax_chunk or logits.size(0), group)


class ChunkedOutputLogprobs:
    """``GPTModel.forward``'s ``output_processor`` for the labels path: the final hidden states
    [s_local, b, h] -> minus the labels' log-probabilities [b, s] in float32 (what Megatron's
    plain path returns). With ``output_layer_chunked``, ``chunk`` positions of the local
    sequence at a time, each chunk's logits recomputed in the backward (docs/packing.md);
    otherwise the output layer over the whole sequence and its log-softmax ``chunk`` positions
    at a time (``chunk`` None: at once; the processor then only carries the temperature)."""

    def __init__(
        self, chunk: int | None, temperature: float = 1.0, *, output_layer_chunked: bool = True
    ) -> None:
        self.chunk = int(chunk) if chunk else None
        self.temperature = float(temperature)
        self.output_layer_chunked = output_layer_chunked and self.chunk is not None

    def __call__(
        self,
        *,
        hidden_states: Tensor,
        output_layer: Any,
        output_weight: Tensor | None,
        labels: Tensor | None,
        config: Any,
        scale_logits: Any,
        **_: Any,
    ) -> Tensor:
        if labels is None:
            raise ValueError("policy.logprob_chunk_size: the output processor needs labels")
        group = _tp_group(output_layer)
        ranks = group.size() if group is not None and output_layer.sequence_parallel else 1
        local, rows = hidden_states.size(0), hidden_states.size(1)
        if labels.shape != (rows, ranks * local):
            raise ValueError(
                f"policy.logprob_chunk_size: labels {tuple(labels.shape)} do not match hidden "
                f"states {tuple(hidden_states.shape)} over {ranks} sequence-parallel rank(s)"
            )
        step = functools.partial(
            _chunk_logprobs,
            output_layer=output_layer,
            scale_logits=scale_logits if getattr(config, "use_mup", False) else None,
            temperature=self.temperature,
            group=group,
            ranks=ranks,
        )
        if not self.output_layer_chunked:
            logprobs = step(hidden_states, output_weight, labels, lo=0, softmax_chunk=self.chunk)
            return (-logprobs).transpose(0, 1).contiguous()
        checkpointed = torch.is_grad_enabled()
        pieces = []
        lo = 0
        # One split (one node in the backward) rather than a slice per chunk, whose gradients
        # would each be a zero-padded copy of the whole hidden states.
        for hidden in torch.split(hidden_states, self.chunk, dim=0):
            if checkpointed:
                piece = checkpoint(
                    functools.partial(step, lo=lo),
                    hidden,
                    output_weight,
                    labels,
                    use_reentrant=False,
                    preserve_rng_state=False,
                )
            else:
                piece = step(hidden, output_weight, labels, lo=lo)
            pieces.append(piece.view(ranks, hidden.size(0), rows))
            lo += hidden.size(0)
        logprobs = torch.cat(pieces, dim=1).reshape(ranks * local, rows)
        return (-logprobs).transpose(0, 1).contiguous()


# The chunked output processor of each model that has a chunk size (:func:`install`), keyed by
# the unwrapped GPTModel; :func:`forward_kwargs` hands it to the model's forward.
_PROCESSORS: weakref.WeakKeyDictionary[Any, ChunkedOutputLogprobs] = weakref.WeakKeyDictionary()


def chunk_settings(section: dict[str, Any]) -> tuple[int | None, bool]:
    """A policy section's (``logprob_chunk_size``, ``megatron_cfg.chunked_output_layer``): the
    positions per chunk (None: no chunks) and whether the output layer runs in those chunks."""
    chunk = section.get("logprob_chunk_size") or None
    megatron_cfg = section.get("megatron_cfg") or {}
    return chunk, bool(chunk and megatron_cfg.get("chunked_output_layer"))


def install(
    model: Any, chunk: int | None, temperature: float = 1.0, *, chunked_output_layer: bool = False
) -> None:
    """Make ``model`` (a GPTModel, or a wrapper around one) compute its per-token loss in
    chunks of ``chunk`` positions, and of the logits divided by ``temperature``: the
    distribution GRPO's sampler draws from, whose log-probabilities NeMo-RL's training, old
    and reference passes take (its ``apply_temperature_scaling``). None or 0 and 1.0 leave the
    model as it is.

    With a chunk size, the model's ``compute_language_model_loss`` takes the log-softmax in
    chunks of the logits; with ``chunked_output_layer`` too, the output layer is chunked as well
    when the forward is given :func:`forward_kwargs` (the training, log-probability and ledger
    passes do), and the replaced method serves any other caller.

    A model with multi-token prediction (``mtp_num_layers``) computes its MTP losses with that
    same method before the main loss; they are Megatron's, on the logits as they are (NeMo-RL
    applies the sampling temperature to the policy's log-probabilities only). So for such a
    model the temperature goes to the output processor alone (registered, whole-sequence when
    there is no chunk size), which only the main loss runs."""
    if not chunk and temperature == 1.0:
        return
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)
    plain = inner.compute_language_model_loss  # Megatron's, bound to this model
    has_mtp = bool(getattr(inner.config, "mtp_num_layers", None))
    tempered = temperature != 1.0 and not has_mtp

    def compute_language_model_loss(self: Any, labels: Tensor, logits: Tensor) -> Tensor:
        if tempered:
            logits = logits / temperature
        if chunk:
            return chunked_label_loss(labels, logits, chunk)
        return plain(labels, logits)

    inner.compute_language_model_loss = types.MethodType(compute_language_model_loss, inner)
    if (chunk and chunked_output_layer) or has_mtp:
        _PROCESSORS[inner] = ChunkedOutputLogprobs(
            chunk, temperature, output_layer_chunked=chunked_output_layer
        )
    else:
        _PROCESSORS.pop(inner, None)


def forward_kwargs(model: Any, has_labels: bool) -> dict[str, Any]:
    """The keyword arguments of ``model``'s forward (a GPTModel or a wrapper around one) that
    chunk its output layer: the output processor when :func:`install` gave the model a chunk
    size and the forward has labels, else none."""
    if not has_labels or not _PROCESSORS:
        return {}
    from megatron.core.utils import unwrap_model

    try:
        processor = _PROCESSORS.get(unwrap_model(model))
    except TypeError:  # not a module (no weak reference to it): nothing was installed on it
        return {}
    return {} if processor is None else {"output_processor": processor}


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
