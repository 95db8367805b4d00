"""Turn token sequences into the padded micro-batches the policy workers train on.

A sequence is its token ids, how many of them are prompt, and a loss multiplier (0 keeps a row
that must not train, e.g. a cut over-long prompt, without any of its tokens counting). Position
t of a micro-batch holds token t as input and token t+1 as label; the loss mask is 1 exactly
where that label is a response token, so prompt and padding never count. Rows are right-padded
to the longest row of their micro-batch, rounded up to ``round_to`` (fewer distinct shapes keep
offload plans and kernels reusable). Micro-batches by token budget (sequence packing, dynamic
batching) are built by :mod:`.packing` from the same sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_rl_offload.config.router_replay import NO_ROUTE, ROUTES_KEY


@dataclass
class TokenSequence:
    ids: list[int]
    prompt_len: int
    extras: dict[str, Any] = field(default_factory=dict)  # per-sequence values (advantages...)
    loss_multiplier: float = 1.0  # NeMo-RL's name; scales the row's loss mask
    # The sampler's experts of each position [len(ids), MoE layers, k] (policy.router_replay,
    # config/router_replay.py), None when not recorded.
    routes: np.ndarray | None = None
    # Token ranges [start, end) after the prompt that the policy did not sample (a multi-turn
    # rollout's tool results and user turns): they condition later turns but never train.
    env_spans: tuple[tuple[int, int], ...] = ()

    def label_mask(self) -> np.ndarray:
        """The loss mask on the label positions (position t holds token t+1's): the loss
        multiplier where the label is a token the policy sampled, 0 over the prompt and the
        environment's spans."""
        sampled = np.zeros(len(self.ids), dtype=np.float32)
        sampled[self.prompt_len :] = self.loss_multiplier
        for start, end in self.env_spans:
            sampled[start:end] = 0.0
        return sampled[1:]


def routes_array(sequences: Sequence[TokenSequence], rows: int, length: int) -> np.ndarray | None:
    """The micro-batch's ``routed_experts`` [rows, length, layers, k], NO_ROUTE wherever a
    sequence has no route (padding, a sequence sampled without recording); None when no
    sequence has routes. Rows are filled by :func:`place_routes`."""
    shapes = [s.routes for s in sequences if s.routes is not None]
    if not shapes:
        return None
    first = shapes[0]
    return np.full((rows, length, *first.shape[1:]), NO_ROUTE, dtype=first.dtype)


def place_routes(out: np.ndarray | None, row: int, start: int, seq: TokenSequence) -> None:
    """Put ``seq``'s routes at row ``row`` from position ``start`` of :func:`routes_array`."""
    if out is None or seq.routes is None:
        return
    n = min(len(seq.ids), seq.routes.shape[0])
    out[row, start : start + n] = seq.routes[:n]


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
        loss_mask[row, : n - 1] = seq.label_mask()
    batch = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}
    routes = routes_array(sequences, rows, length)
    if routes is not None:
        for row, seq in enumerate(sequences):
            place_routes(routes, row, 0, seq)
        batch[ROUTES_KEY] = routes
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


def microbatches(
    sequences: Sequence[TokenSequence], micro_batch_size: int, *, pad_id: int, round_to: int = 1
) -> list[dict[str, np.ndarray]]:
    """Consecutive groups of ``micro_batch_size`` sequences, each padded into a micro-batch."""
    return [
        make_microbatch(sequences[i : i + micro_batch_size], pad_id=pad_id, round_to=round_to)
        for i in range(0, len(sequences), micro_batch_size)
    ]


def rows_of(outputs: Sequence[Any]) -> list[Any]:
    """Per-row results of a pass over micro-batches: ``outputs`` holds one array per
    micro-batch ([rows, ...]) or one tuple of them (None for an absent member); each row's
    result keeps its micro-batch's padded length."""
    rows: list[Any] = []
    for output in outputs:
        if isinstance(output, tuple):
            count = len(next(part for part in output if part is not None))
            rows += [
                tuple(None if part is None else part[i] for part in output) for i in range(count)
            ]
        else:
            rows += list(output)
    return rows


def forward_only(
    sequences: Sequence[TokenSequence],
    rows: int,
    run_pass: Any,
    *,
    pad_id: int,
    round_to: int = 1,
    keep_labels: bool = True,
) -> list[Any]:
    """Per-sequence results of a forward-only pass (log-probabilities, a reference's, a
    teacher's top-k) run over micro-batches of ``rows`` sequences, the recipe's
    ``logprob_batch_size``: a forward pass keeps no activations for a backward pass, so it can
    take more rows than a training micro-batch. ``run_pass`` takes the micro-batches and
    returns one result per micro-batch (see :func:`rows_of`); :func:`attach_rows` puts the
    results on the training micro-batches of the same sequences."""
    mbs = microbatches(sequences, rows, pad_id=pad_id, round_to=round_to)
    if not keep_labels:
        for mb in mbs:
            del mb["labels"]
    return rows_of(run_pass(mbs))


def attach_rows(mbs: Sequence[dict[str, np.ndarray]], key: str, rows: Sequence[Any]) -> None:
    """Set ``mb[key]`` on micro-batches built from the sequences ``rows`` belong to, in the same
    order: per-row scalars become [rows]; per-position arrays are cut or zero-padded to the
    micro-batch's length (positions past a row's end are padding, which the loss mask
    excludes)."""
    start = 0
    for mb in mbs:
        count, length = mb["input_ids"].shape
        chunk = [np.asarray(row) for row in rows[start : start + count]]
        start += count
        if chunk[0].ndim == 0:
            mb[key] = np.stack(chunk)
            continue
        out = np.zeros((count, length, *chunk[0].shape[1:]), dtype=chunk[0].dtype)
        for index, row in enumerate(chunk):
            n = min(length, row.shape[0])
            out[index, :n] = row[:n]
        mb[key] = out
    if start != len(rows):
        raise ValueError(f"{len(rows)} rows for micro-batches of {start} rows")
