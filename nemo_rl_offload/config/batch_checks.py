"""Whether a step's sequences split into data-parallel shards of whole micro-batches.

These are recipe checks (the batch keys against the parallel layout), kept with the other
recipe checks so that the algorithms, the telemetry runs and any later pre-start check share
one rule; they need the data-parallel size, which is known once the workers report their
layout. No torch, no Ray.
"""

from __future__ import annotations

from nemo_rl_offload.config.batching_settings import BatchingSettings
from nemo_rl_offload.errors import UserInputError


def check_split(
    count: int, batching: BatchingSettings, dp_size: int, *, key: str, what: str
) -> None:
    """A step's ``count`` sequences must split evenly into data-parallel shards of whole
    micro-batches (with token budgets, into equal shards: micro-batches are then formed by
    tokens); ``key`` and ``what`` name the setting in the message."""
    micro = 1 if batching.mode != "rows" else batching.train_rows
    if count % (micro * dp_size):
        raise UserInputError(
            f"{key}: {what} do not split into {dp_size} data-parallel rank(s) x micro-batches "
            f"of {micro}; use a multiple of {micro * dp_size}"
        )


def check_batch_sizes(global_batch: int, batching: BatchingSettings, dp_size: int) -> None:
    """The global batch (``policy.train_global_batch_size``) splits into data-parallel
    shards of whole micro-batches."""
    check_split(
        global_batch,
        batching,
        dp_size,
        key="policy.train_global_batch_size",
        what=f"{global_batch} sequences",
    )
