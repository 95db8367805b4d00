"""The key/value cache of one generation call, written and read by the project's core attention.

megatron-core's inference contexts either change tensor shapes at every decode step (no CUDA
graph replay) or need flash-attn, so this module owns the smallest piece: one preallocated cache
per layer, each row's write position, and per-row masking. Why, and the seam:
docs/generation.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class KVCache:
    keys: dict[int, Tensor]  # layer number -> [rows, groups, max_len, dim]
    values: dict[int, Tensor]
    # The position each row's current token is written at (decode steps).
    positions: Tensor
    decoding: bool = False
    # How many cache positions a decode step attends over (a fixed shape per CUDA graph).
    window: int = 0
    _rows: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self._rows = torch.arange(self.positions.numel(), device=self.positions.device)

    @classmethod
    def allocate(
        cls,
        layer_numbers: list[int],
        *,
        rows: int,
        max_len: int,
        groups: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (rows, groups, max_len, head_dim)
        keys = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        values = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        positions = torch.zeros(rows, dtype=torch.long, device=device)
        return cls(keys, values, positions, window=max_len)

    @staticmethod
    def nbytes(
        layers: int, *, rows: int, max_len: int, groups: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * rows * groups * max_len * head_dim * element

    @property
    def max_len(self) -> int:
        return next(iter(self.keys.values())).size(2)

    def keep_rows(self, kept: Tensor, rows: int) -> None:
        """Only the rows ``kept`` (ascending) decode on, as rows 0..len(kept)-1 of a cache of
        ``rows`` rows (the rest padding): their keys and values move to the front of the same
        memory, and every layer's cache becomes a view of its first ``rows`` rows, so a decode
        step of the smaller batch reads only them (policy.generation's compaction)."""
        count = kept.numel()
        for cache in (self.keys, self.values):
            for layer, tensor in cache.items():
                tensor[:count] = tensor[kept]
                cache[layer] = tensor[:rows]
        self.positions = torch.zeros(rows, dtype=self.positions.dtype, device=kept.device)
        self._rows = torch.arange(rows, device=kept.device)

    def store_prompt(self, layer: int, key: Tensor, value: Tensor) -> None:
        """Prefill: keys and values [s, rows, groups, dim] of positions 0..s-1 (right padding
        included: a row's decode steps overwrite its padding before any query can see it)."""
        s = key.size(0)
        self.keys[layer][:, :, :s] = key.permute(1, 2, 0, 3)
        self.values[layer][:, :, :s] = value.permute(1, 2, 0, 3)

    def decode_attention(
        self, layer: int, query: Tensor, key: Tensor, value: Tensor, scale: float
    ) -> Tensor:
        """One token per row, laid out [rows, 1, heads, dim] (query) and [rows, 1, groups, dim]
        (key, value): store the new key and value at each row's position, attend over the
        window with the positions past each row's own masked. Returns [rows, 1, heads * dim].

        Query head i reads key/value group i // (heads / groups), Megatron's mapping: the
        queries of one group attend as the query positions of one SDPA head against that
        group's cache, so the cache is read once, without expanding it per head, by torch's
        fused attention kernel with the rows' reach as its mask."""
        keys, values = self.keys[layer], self.values[layer]
        keys[self._rows, :, self.positions] = key[:, 0]
        values[self._rows, :, self.positions] = value[:, 0]
        rows, heads, dim = query.size(0), query.size(2), query.size(3)
        groups = keys.size(1)
        k = keys[:, :, : self.window]  # [rows, groups, window, dim]
        v = values[:, :, : self.window]
        q = query.reshape(rows, groups, heads // groups, dim)
        reached = torch.arange(self.window, device=query.device) <= self.positions[:, None]
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=reached[:, None, None, :], scale=scale
        )  # [rows, groups, heads per group, dim]
        return context.reshape(rows, 1, heads * dim)
