"""Context parallelism: which tokens of a sequence each context-parallel (CP) rank holds.

Megatron's layout, which its rotary embedding assumes (``get_pos_emb_on_this_cp_rank`` and the
packed ``_apply_rotary_pos_emb_thd``): a sequence whose length is a multiple of 2 * CP is cut
into 2 * CP equal chunks and rank r holds chunks r and 2 * CP - 1 - r, so that under causal
attention every rank has the same amount of work (an early chunk sees few keys, a late one
many). A packed row is split the same way sequence by sequence, each sequence padded to a
multiple of 2 * CP first; the rank's part of the pack is its chunks of every sequence in order,
so its segment offsets are the global ones divided by CP.

This module only computes positions and moves tensors between the two layouts; the attention
(``models.attention``) and the passes (``policy.train_step``) use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def cp_world() -> tuple[int, int]:
    """(CP size, this rank's CP rank); (1, 0) without Megatron's parallel state."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return (
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_context_parallel_rank(),
    )


def local_positions(cu_seqlens: Tensor, cp: int, rank: int) -> Tensor:
    """The global positions rank ``rank`` holds, in its local order: for each sequence of the
    (padded) offsets ``cu_seqlens``, its chunks ``rank`` and ``2 * cp - 1 - rank``."""
    pieces = []
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        chunk = (end - start) // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            first = start + index * chunk
            pieces.append(torch.arange(first, first + chunk))
    if not pieces:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(pieces)


def gathered_order(cu_seqlens: Tensor, cp: int) -> Tensor:
    """Index that puts the rank-major concatenation of every rank's local tokens (what an
    all-gather returns) back into global order: ``full = gathered[order]``."""
    held = torch.cat([local_positions(cu_seqlens, cp, rank) for rank in range(cp)])
    return torch.argsort(held)


@dataclass(frozen=True)
class SplitLayout:
    """How a micro-batch of ``length`` positions maps onto the padded global layout that CP
    splits: ``padded_cu_seqlens`` (one sequence for an unpacked row), ``keep`` the padded
    position of each original position, ``padded_length`` the padded row's length."""

    padded_cu_seqlens: Tensor
    keep: Tensor
    padded_length: int
    packed: bool


def split_layout(
    length: int,
    cu_seqlens: Tensor | None,
    cp: int,
    multiple: int = 1,
    *,
    at_least: int | None = None,
) -> SplitLayout:
    """The padded layout of a row of ``length`` tokens (a pack when ``cu_seqlens`` is given).

    Each sequence is padded on its right to a multiple of 2 * CP; the row's total is then
    padded to a multiple of ``multiple`` too (by a padding sequence of its own in a pack:
    under sequence parallelism each CP rank's part must split over the tensor-parallel
    ranks), and to ``at_least`` (a length this one's multiples divide) when given."""
    total_multiple = math.lcm(2 * cp, multiple)

    def grown(size: int) -> int:
        return max(-(-size // total_multiple) * total_multiple, at_least or 0)

    if cu_seqlens is None:
        padded = grown(length)
        return SplitLayout(
            padded_cu_seqlens=torch.tensor([0, padded], dtype=torch.int32),
            keep=torch.arange(length),
            padded_length=padded,
            packed=False,
        )
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[-1] < length:  # tokens after the last offset: a sequence of their own
        bounds.append(length)
    new_bounds, keep = [0], []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        size = end - start
        if size == 0:
            continue
        keep.append(torch.arange(size) + new_bounds[-1])
        new_bounds.append(new_bounds[-1] + -(-size // (2 * cp)) * (2 * cp))
    total = grown(new_bounds[-1])
    if total > new_bounds[-1]:
        new_bounds.append(total)
    return SplitLayout(
        padded_cu_seqlens=torch.tensor(new_bounds, dtype=torch.int32),
        keep=torch.cat(keep) if keep else torch.zeros(0, dtype=torch.long),
        padded_length=total,
        packed=True,
    )


def to_local(
    values: Tensor, layout: SplitLayout, cp: int, rank: int, *, fill: int | float = 0
) -> Tensor:
    """[rows, length, ...] in original positions -> [rows, padded_length / cp, ...]: this
    rank's positions of the padded layout (``fill`` on padding)."""
    keep = layout.keep.to(values.device)
    padded = values.new_full((values.shape[0], layout.padded_length, *values.shape[2:]), fill)
    padded[:, keep] = values
    held = local_positions(layout.padded_cu_seqlens, cp, rank).to(values.device)
    return padded[:, held]


def gather_to_full(local: Tensor, layout: SplitLayout, cp: int, *, with_grad: bool) -> Tensor:
    """[rows, local positions, ...] on every CP rank -> [rows, original length, ...], the same
    on every rank. ``with_grad``: the backward hands each rank the gradient of its own
    positions only (every rank computes the same loss from the same gathered values, so the
    sum of their parameter gradients, which Megatron's DDP takes over the data-and-context
    parallel group, is the gradient of that loss once)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    group = parallel_state.get_context_parallel_group()
    seq_first = local.transpose(0, 1).contiguous()
    if with_grad:
        gathered = gather_from_sequence_parallel_region(
            seq_first, tensor_parallel_output_grad=False, group=group
        )
    else:
        parts = [torch.empty_like(seq_first) for _ in range(cp)]
        torch.distributed.all_gather(parts, seq_first, group=group)
        gathered = torch.cat(parts)
    order = gathered_order(layout.padded_cu_seqlens, cp).to(local.device)
    full = gathered[order[layout.keep.to(local.device)]]
    return full.transpose(0, 1)
