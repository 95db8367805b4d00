"""Self-attention whose keys and values own their memory (the local spec's ``self_attention``).

Why: Megatron's ``SelfAttention.get_query_key_value_tensors`` splits the fused QKV projection's
output into views. The query is reshaped (a copy) and rotary embeddings give the key a new
tensor, but the value stays a view of the whole fused output: whoever saves the value for
backward (the attention kernel, a core-attention recompute's checkpoint) keeps the query's
and key's pre-rotary bytes alive as well. With grouped-query attention that view holds
several times the value's own bytes for the whole step: the activation ledger counted it
against ``core_attn``. Here any key or value that is a view into a larger buffer is copied to
its own memory (one small copy per layer) before the attention sees it, so only its own bytes
are saved; the fused buffer is freed as the forward moves on. The result is the same tensor
values: the same training, fewer saved bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention
from torch import Tensor


def owns_its_memory(tensor: Tensor) -> bool:
    """Whether ``tensor`` spans its whole storage (a copy of a view that does not would free
    the rest of the buffer once the view is no longer held)."""
    return tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size()


def compacted(tensor: Tensor) -> Tensor:
    return (
        tensor if owns_its_memory(tensor) else tensor.clone(memory_format=torch.contiguous_format)
    )


class CompactKVSelfAttention(SelfAttention):
    """``SelfAttention`` whose ``get_query_key_value_tensors`` returns keys and values that
    own their memory (the module docstring says why). The unsplit form (``split_qkv=False``,
    Megatron's fused-rotary path) is returned as it is."""

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> Any:
        split = super().get_query_key_value_tensors(*args, **kwargs)
        if not isinstance(split, tuple) or len(split) < 3:
            return split
        query, key, value, *rest = split
        if not all(isinstance(t, Tensor) for t in (query, key, value)):
            return split
        return (query, compacted(key), compacted(value), *rest)
