"""Micro-batches by token budget: sequence packing and dynamic batching (NeMo-RL's
``policy.sequence_packing`` and ``policy.dynamic_batching``).

Padded rows waste compute and memory when lengths vary; both modes keep the loss exact, since
every loss returns sums and the step divides once by the global token count. A
:class:`Batches` remembers where each sequence went. How each mode cuts: docs/packing.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_rl_offload.algorithms.batching import place_routes, routes_array
from nemo_rl_offload.config.batching_settings import (
    PACKER_NAMES,
    BatchingSettings,
    round_up,
)
from nemo_rl_offload.config.router_replay import ROUTES_KEY
from nemo_rl_offload.errors import UserInputError

# Where a sequence sits: (micro-batch index, row, first position, length).
Place = tuple[int, int, int, int]


# ---------------------------------------------------------------------------- packing algorithms
def _first_fit(order: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for index in order:
        size = lengths[index]
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(index)
                room[b] -= size
                break
        else:
            bins.append([index])
            room.append(capacity - size)
    return bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Longest first, each into the first pack with room."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return _first_fit(order, lengths, capacity)


def first_fit_shuffle(lengths: Sequence[int], capacity: int, *, seed: int = 0) -> list[list[int]]:
    """A seeded random order, each into the first pack with room (seeded, so a resumed run
    packs as the original did)."""
    order = list(np.random.default_rng(seed).permutation(len(lengths)))
    return _first_fit([int(i) for i in order], lengths, capacity)


def concatenative(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """In order, a new pack whenever the next sequence does not fit."""
    bins: list[list[int]] = []
    used = capacity
    for index, size in enumerate(lengths):
        if used + size > capacity:
            bins.append([])
            used = 0
        bins[-1].append(index)
        used += size
    return bins


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Johnson and Garey's modified first-fit decreasing (NeMo-RL's default): sequences are
    large (over half a pack), medium (over a third), small (over a sixth) or tiny. Each large
    one opens a pack; the largest medium that fits joins each; packs without a medium take the
    two smallest smalls that fit, in reverse order of the packs; then the rest, largest first,
    fill the packs in order, and what is left is packed first-fit decreasing."""
    items = list(enumerate(lengths))
    large = sorted((it for it in items if it[1] > capacity / 2), key=lambda it: -it[1])
    medium = sorted(
        (it for it in items if capacity / 3 < it[1] <= capacity / 2), key=lambda it: -it[1]
    )
    small = sorted(
        (it for it in items if capacity / 6 < it[1] <= capacity / 3), key=lambda it: it[1]
    )
    tiny = sorted((it for it in items if it[1] <= capacity / 6), key=lambda it: it[1])
    bins: list[list[tuple[int, int]]] = [[it] for it in large]

    def free(b: list[tuple[int, int]]) -> int:
        return capacity - sum(size for _, size in b)

    for b in bins:
        for i, (_, size) in enumerate(medium):
            if size <= free(b):
                b.append(medium.pop(i))
                break
    for b in reversed(bins):
        if any(capacity / 3 < size <= capacity / 2 for _, size in b) or len(small) < 2:
            continue
        room = free(b)
        if small[0][1] + small[1][1] > room:
            continue
        first = small.pop(0)
        for j in range(len(small) - 1, -1, -1):
            if small[j][1] <= room - first[1]:
                b.extend([first, small.pop(j)])
                break
        else:
            small.insert(0, first)
    rest = sorted(medium + small + tiny, key=lambda it: -it[1])
    for b in bins:
        while rest:
            room = free(b)
            chosen = next((i for i, (_, size) in enumerate(rest) if size <= room), None)
            if chosen is None:
                break
            b.append(rest.pop(chosen))
    leftover = [index for index, _ in rest]
    packed = [[index for index, _ in b] for b in bins]
    if leftover:
        sub = first_fit_decreasing([lengths[i] for i in leftover], capacity)
        packed += [[leftover[i] for i in b] for b in sub]
    return packed


PACKERS: dict[str, Callable[..., list[list[int]]]] = {
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
    "concatenative": concatenative,
}
if tuple(PACKERS) != PACKER_NAMES:  # the recipe checks accept exactly the packers that exist
    raise ImportError(f"PACKERS {tuple(PACKERS)} differ from config's PACKER_NAMES")


def pack(
    lengths: Sequence[int], capacity: int, algorithm: str, *, bins_multiple_of: int = 1
) -> list[list[int]]:
    """Indices of ``lengths`` grouped into packs of at most ``capacity`` tokens, by
    ``algorithm`` (a :data:`PACKERS` name, case-insensitive), at least ``bins_multiple_of``
    packs and a multiple of it (one per data-parallel rank and step of the round-robin): extra
    packs take one sequence each from the packs that hold the most."""
    if not lengths:
        return []
    longest = max(lengths)
    if longest > capacity:
        raise ValueError(f"a {longest}-token sequence does not fit a {capacity}-token pack")
    packer = PACKERS[algorithm.lower()]
    bins = [b for b in packer(list(lengths), capacity) if b]
    multiple = max(1, bins_multiple_of)
    target = round_up(max(len(bins), multiple), multiple)
    if target > len(lengths):
        raise ValueError(
            f"{len(lengths)} sequences cannot fill {target} packs (one per data-parallel rank)"
        )
    while len(bins) < target:
        source = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        bins.append([bins[source].pop()])
    return bins


# ---------------------------------------------------------------------------- micro-batches
def pack_microbatch(sequences: Sequence[Any], *, pad_id: int, length: int) -> dict[str, np.ndarray]:
    """One pack [1, length] of ``sequences`` (``batching.TokenSequence``) end to end:
    ``input_ids``, ``labels`` and ``loss_mask`` as a padded row of each sequence would have
    them (a sequence's last position has no label), ``position_ids`` restarting at 0 for each
    sequence, ``segment_ids`` (-1 on padding), ``cu_seqlens`` [segments + 1] (int32; trailing
    padding is one more segment) and per-token arrays for the extras (a per-sequence scalar is
    repeated over its sequence's positions)."""
    total = sum(len(s.ids) for s in sequences)
    if total > length:
        raise ValueError(f"{total} tokens do not fit a {length}-token pack")
    input_ids = np.full((1, length), pad_id, dtype=np.int64)
    labels = np.full((1, length), pad_id, dtype=np.int64)
    loss_mask = np.zeros((1, length), dtype=np.float32)
    position_ids = np.zeros((1, length), dtype=np.int64)
    segment_ids = np.full((1, length), -1, dtype=np.int64)
    extras = {key: np.zeros((1, length), dtype=np.float32) for key in sequences[0].extras}
    routes = routes_array(sequences, 1, length)
    bounds = [0]
    offset = 0
    for index, seq in enumerate(sequences):
        n = len(seq.ids)
        end = offset + n
        input_ids[0, offset:end] = seq.ids
        labels[0, offset : end - 1] = seq.ids[1:]
        loss_mask[0, offset : end - 1] = seq.label_mask()
        position_ids[0, offset:end] = np.arange(n)
        segment_ids[0, offset:end] = index
        place_routes(routes, 0, offset, seq)
        for key, value in seq.extras.items():
            if np.isscalar(value):
                extras[key][0, offset:end] = value
            else:
                value = np.asarray(value, dtype=np.float32)[:n]
                extras[key][0, offset : offset + len(value)] = value
        offset = end
        bounds.append(end)
    if offset < length:
        position_ids[0, offset:] = np.arange(length - offset)
        bounds.append(length)
    packed = {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "cu_seqlens": np.asarray(bounds, dtype=np.int32),
        **extras,
    }
    if routes is not None:
        packed[ROUTES_KEY] = routes
    return packed


@dataclass
class Batches:
    """A step's micro-batches per data-parallel rank (``shards``) and where each sequence
    went (``places[i]`` for sequence i), to attach per-sequence arrays."""

    shards: list[list[dict[str, np.ndarray]]]
    places: list[Place] = field(default_factory=list)

    @property
    def flat(self) -> list[dict[str, np.ndarray]]:
        """The micro-batches rank after rank (the index a :data:`Place` refers to)."""
        return [mb for shard in self.shards for mb in shard]

    def attach(self, key: str, per_sequence: Sequence[Any]) -> None:
        """Set ``mb[key]`` from one value per sequence: scalars become [rows] (padded rows) or
        are spread over the sequence's positions (packs); per-position arrays ([len, ...]) are
        placed at the sequence's positions, cut to its length, zeros elsewhere (positions the
        loss mask excludes)."""
        mbs = self.flat
        if len(per_sequence) != len(self.places):
            raise ValueError(f"{len(per_sequence)} values for {len(self.places)} sequences")
        values = [np.asarray(v) for v in per_sequence]
        scalar = values[0].ndim == 0 if values else True
        by_mb: dict[int, list[tuple[int, Place]]] = {}
        for i, place in enumerate(self.places):
            by_mb.setdefault(place[0], []).append((i, place))
        for index, mb in enumerate(mbs):
            rows, length = mb["input_ids"].shape
            members = by_mb.get(index, [])
            packed = "cu_seqlens" in mb
            if scalar and not packed:
                out = np.zeros(rows, dtype=values[0].dtype)
                for i, (_, row, _, _) in members:
                    out[row] = values[i]
            else:
                trailing = () if scalar else values[0].shape[1:]
                out = np.zeros((rows, length, *trailing), dtype=values[0].dtype)
                for i, (_, row, start, n) in members:
                    if scalar:
                        out[row, start : start + n] = values[i]
                    else:
                        m = min(n, values[i].shape[0], length - start)
                        out[row, start : start + m] = values[i][:m]
            mb[key] = out

    def per_sequence(self, outputs: Sequence[Any]) -> list[Any]:
        """Per-sequence results of a pass over :attr:`flat` (one array [rows, length, ...], or
        a tuple of them with None for an absent member, per micro-batch), each cut to its
        sequence's positions (padded rows keep the row's padded length, as ``batching.rows_of``
        does)."""

        def cut(part: Any, row: int, start: int, n: int, packed: bool) -> Any:
            if part is None:
                return None
            return part[row, start : start + n] if packed else part[row]

        mbs = self.flat
        results = []
        for index, row, start, n in self.places:
            output, packed = outputs[index], "cu_seqlens" in mbs[index]
            if isinstance(output, tuple):
                results.append(tuple(cut(part, row, start, n, packed) for part in output))
            else:
                results.append(cut(output, row, start, n, packed))
        return results


def _packed_batches(
    sequences: Sequence[Any],
    settings: BatchingSettings,
    shards: int,
    *,
    pad_id: int,
    training: bool,
) -> Batches:
    length = settings.pack_length(training=training)
    lengths = [len(s.ids) for s in sequences]
    longest = max(lengths, default=0)
    if longest > length:
        # validate only warns about a budget below max_total_sequence_length (as NeMo-RL,
        # whose packers refuse the sequence when it comes), so this is where it is refused.
        budget = "train_mb_tokens" if training else "logprob_mb_tokens"
        raise UserInputError(
            f"{settings.where}.sequence_packing.{budget}: a {longest}-token sequence does not "
            f"fit a {length}-token pack; set {budget} to at least {longest} (or "
            "max_total_sequence_length, to hold any sequence)"
        )
    bins = pack(lengths, length, settings.algorithm, bins_multiple_of=shards if training else 1)
    per_rank: list[list[list[int]]] = [bins[d::shards] for d in range(shards)]
    if settings.largest_first:  # each rank's largest packs first, the packer's order otherwise
        per_rank = [sorted(r, key=lambda b: -sum(lengths[i] for i in b)) for r in per_rank]
    places: list[Place | None] = [None] * len(sequences)
    out: list[list[dict[str, np.ndarray]]] = []
    index = 0
    for rank_bins in per_rank:
        rank_mbs = []
        for b in rank_bins:
            mb = pack_microbatch([sequences[i] for i in b], pad_id=pad_id, length=length)
            start = 0
            for i in b:
                places[i] = (index, 0, start, lengths[i])
                start += lengths[i]
            rank_mbs.append(mb)
            index += 1
        out.append(rank_mbs)
    return Batches(out, [p for p in places if p is not None])


def _dynamic_batches(
    sequences: Sequence[Any],
    settings: BatchingSettings,
    shards: int,
    *,
    pad_id: int,
    training: bool,
) -> Batches:
    from nemo_rl_offload.algorithms.batching import make_microbatch

    budget = settings.train_tokens if training else settings.logprob_tokens
    count = len(sequences)
    if count % shards:
        raise ValueError(f"{count} sequences do not split evenly over {shards} ranks")
    lengths = [len(s.ids) for s in sequences]
    order = sorted(range(count), key=lambda i: (lengths[i], i))
    rank_rows = [order[d::shards] for d in range(shards)]  # stride the sorted batch
    per_rank = count // shards
    multiple = max(settings.sequence_length_round, settings.round_to)
    cuts: list[tuple[int, int]] = []  # [start, end) row ranges, the same on every rank
    start, longest = 0, 0
    for row in range(per_rank):
        padded = round_up(max(lengths[r[row]] for r in rank_rows), multiple)
        if padded > budget:
            raise ValueError(
                f"a {padded}-token padded sequence does not fit a {budget}-token micro-batch"
            )
        grown = max(longest, padded)
        if row > start and (row - start + 1) * grown > budget:
            cuts.append((start, row))
            start, grown = row, padded
        longest = grown
    cuts.append((start, per_rank))
    places: list[Place | None] = [None] * count
    out: list[list[dict[str, np.ndarray]]] = []
    index = 0
    for rows in rank_rows:
        rank_mbs = []
        for lo, hi in cuts:
            members = rows[lo:hi]
            rank_mbs.append(
                make_microbatch([sequences[i] for i in members], pad_id=pad_id, round_to=multiple)
            )
            for row, i in enumerate(members):
                places[i] = (index, row, 0, lengths[i])
            index += 1
        out.append(rank_mbs)
    return Batches(out, [p for p in places if p is not None])


def _row_batches(
    sequences: Sequence[Any], rows: int, shards: int, *, pad_id: int, round_to: int
) -> Batches:
    """Padded rows of a fixed count, consecutive sequences per micro-batch, consecutive
    micro-batches per rank (``batching.microbatches`` then ``sharding.split``)."""
    from nemo_rl_offload.algorithms.batching import microbatches
    from nemo_rl_offload.distributed.sharding import split

    mbs = microbatches(sequences, rows, pad_id=pad_id, round_to=round_to)
    places = [(i // rows, i % rows, 0, len(s.ids)) for i, s in enumerate(sequences)]
    return Batches(split(mbs, shards), places)


def training_batches(
    sequences: Sequence[Any], settings: BatchingSettings, shards: int, *, pad_id: int
) -> Batches:
    """A training step's micro-batches for ``shards`` data-parallel ranks."""
    if settings.mode == "packing":
        return _packed_batches(sequences, settings, shards, pad_id=pad_id, training=True)
    if settings.mode == "dynamic":
        return _dynamic_batches(sequences, settings, shards, pad_id=pad_id, training=True)
    return _row_batches(
        sequences, settings.train_rows, shards, pad_id=pad_id, round_to=settings.round_to
    )


def forward_batches(
    sequences: Sequence[Any], settings: BatchingSettings, *, pad_id: int
) -> Batches:
    """Micro-batches of a forward-only pass (one list: the policy group spreads them over its
    ranks), by ``logprob_mb_tokens`` or ``logprob_batch_size`` rows."""
    if settings.mode == "packing":
        return _packed_batches(sequences, settings, 1, pad_id=pad_id, training=False)
    if settings.mode == "dynamic":
        return _dynamic_batches(sequences, settings, 1, pad_id=pad_id, training=False)
    return _row_batches(
        sequences, settings.logprob_rows, 1, pad_id=pad_id, round_to=settings.round_to
    )
