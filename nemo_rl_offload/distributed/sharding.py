"""How the driver cuts a step's items into data-parallel shards.

One rule for every caller (the policy group's passes, the training batches), so that a
sequence lands on the same data-parallel rank whichever pass it takes part in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def split(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one."""
    base, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        chunks.append(list(items[start : start + size]))
        start += size
    return chunks
