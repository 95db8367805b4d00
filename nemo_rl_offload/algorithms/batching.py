"""Turn token sequences into the padded micro-batches the policy workers train on.

A sequence is its token ids plus how many of them are prompt. Position t of a micro-batch holds
token t as input and token t+1 as label; the loss mask is 1 exactly where that label is a
response token, so prompt and padding never count. Rows are right-padded to the longest row of
their micro-batch, rounded up to ``round_to`` (fewer distinct shapes keep offload plans and
kernels reusable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TokenSequence:
    ids: list[int]
    prompt_len: int
    extras: dict[str, Any] = field(default_factory=dict)  # per-sequence values (advantages...)


def padded_length(lengths: Sequence[int], round_to: int) -> int:
    longest = max(lengths)
    round_to = max(1, round_to)
    return -(-longest // round_to) * round_to


def make_microbatch(
    sequences: Sequence[TokenSequence], *, pad_id: int, round_to: int = 1
) -> dict[str, np.ndarray]:
    """``input_ids``, ``labels`` and ``loss_mask`` [rows, length], plus one array per extra
    (scalars become [rows], per-token lists become [rows, length] aligned with labels)."""
    length = padded_length([len(s.ids) for s in sequences], round_to)
    rows = len(sequences)
    input_ids = np.full((rows, length), pad_id, dtype=np.int64)
    labels = np.full((rows, length), pad_id, dtype=np.int64)
    loss_mask = np.zeros((rows, length), dtype=np.float32)
    for row, seq in enumerate(sequences):
        n = len(seq.ids)
        input_ids[row, :n] = seq.ids
        labels[row, : n - 1] = seq.ids[1:]
        loss_mask[row, max(seq.prompt_len - 1, 0) : n - 1] = 1.0
    batch = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}
    for key in sequences[0].extras if sequences else ():
        values = [s.extras[key] for s in sequences]
        if np.isscalar(values[0]):
            batch[key] = np.asarray(values, dtype=np.float32)
        else:
            array = np.zeros((rows, length), dtype=np.float32)
            for row, value in enumerate(values):
                array[row, : len(value)] = value
            batch[key] = array
    return batch


def split(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one."""
    base, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        chunks.append(list(items[start : start + size]))
        start += size
    return chunks


def microbatches(
    sequences: Sequence[TokenSequence], micro_batch_size: int, *, pad_id: int, round_to: int = 1
) -> list[dict[str, np.ndarray]]:
    """Consecutive groups of ``micro_batch_size`` sequences, each padded into a micro-batch."""
    return [
        make_microbatch(sequences[i : i + micro_batch_size], pad_id=pad_id, round_to=round_to)
        for i in range(0, len(sequences), micro_batch_size)
    ]
