"""Self-attention whose keys and values own their memory and whose rotary embedding shares one
pair of tables across layers (the local spec's ``self_attention``).

Megatron's value is a view of the whole fused QKV output, and its rotary tables are computed
and saved in every layer; here neither is. The same tensor values: the same training, fewer
saved bytes. Why, and what was measured: docs/design/local_layer_spec.md.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Any

import torch
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.attention import Attention, SelfAttention
from torch import Tensor

from nemo_rl_offload.offload.owned import fingerprint

# What the rotary path below relies on, hashed (``offload.owned.fingerprint``) in the
# megatron-core this package pins: Attention.forward applies ``apply_rotary_pos_emb`` to the
# query and key (after squeezing a packed batch's dimension 1) only when ``rotary_pos_emb`` is
# given, with the layer's yarn scale and the packed sequences' (padded) boundaries; the unfused
# path's formula (``_apply_rotary_pos_emb_bshd``, ``_rotate_half``) and a packed batch's positions
# (``_apply_rotary_pos_emb_thd``). If any changed, Megatron's own rotary runs (a warning says so).
ROTARY_FINGERPRINTS = {
    "Attention.forward": ("d2144b14a3947ecf", Attention.forward),
    "apply_rotary_pos_emb": ("1336d4ac079eeb63", rope_utils.apply_rotary_pos_emb),
    "_apply_rotary_pos_emb_bshd": ("46c0cdc52df96433", rope_utils._apply_rotary_pos_emb_bshd),
    "_apply_rotary_pos_emb_thd": ("6b2f3ff959184344", rope_utils._apply_rotary_pos_emb_thd),
    "_rotate_half": ("d4c7257eb3fdfb5a", rope_utils._rotate_half),
}


@functools.cache
def rotary_drift() -> str | None:
    """The megatron-core code the rotary path relies on that changed, or None."""
    changed = [n for n, (digest, obj) in ROTARY_FINGERPRINTS.items() if fingerprint(obj) != digest]
    if not changed:
        return None
    message = (
        f"megatron-core's {', '.join(changed)} changed since the version this package checked: "
        "the rotary embedding keeps its tables per layer, as Megatron's does"
    )
    warnings.warn(message, stacklevel=2)
    return message


# The last (cos, sin) pair :func:`rotary_tables` made, with what it was made of: every layer of
# a micro-batch asks for the same one. One pair is kept at a time.
_LAST_TABLES: dict[str, Any] = {}


def rotary_tables(
    freqs: Tensor, dtype: torch.dtype, mscale: float, seqlens: tuple[int, ...] | None
) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of ``freqs`` [max positions, 1, 1, dim] times ``mscale`` in ``dtype``,
    as Megatron's unfused rotary computes them, at each token's position: the first rows for a
    padded batch (``seqlens`` None), each sequence's positions from 0 for a packed one. The pair
    of the previous call is returned again when it was made of the same frequencies tensor and
    settings (not while a CUDA graph is captured: captured tensors live in the graph's pool)."""
    key = (dtype, float(mscale), seqlens)
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    last = _LAST_TABLES.get("entry")
    if not capturing and last is not None and last[0]() is freqs and last[1] == key:
        return last[2], last[3]
    at = freqs
    if seqlens is not None:
        positions = torch.cat([torch.arange(n, device=freqs.device) for n in seqlens])
        at = freqs[positions]
    cos = (torch.cos(at) * mscale).to(dtype)
    sin = (torch.sin(at) * mscale).to(dtype)
    if not capturing:
        _LAST_TABLES["entry"] = (weakref.ref(freqs), key, cos, sin)
    return cos, sin


# The last packed layout :func:`packed_seqlens` read, by its cu_seqlens tensor: every layer of a
# micro-batch asks for the same one, and reading it waits for the GPU.
_LAST_SEQLENS: dict[str, Any] = {}


def packed_seqlens(cu_seqlens: Tensor, positions: int) -> tuple[int, ...] | None:
    """The sequence lengths of a packed batch whose rotary frequencies cover ``positions``
    rows, or None when they have a row per packed token already. Read from the device once per
    micro-batch, not once per layer: each read stops the host until the GPU catches up."""
    last = _LAST_SEQLENS.get("entry")
    if last is not None and last[0]() is cu_seqlens and last[1] == positions:
        return last[2]
    seqlens = None
    if positions != int(cu_seqlens[-1].item()):
        seqlens = tuple((cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
    _LAST_SEQLENS["entry"] = (weakref.ref(cu_seqlens), positions, seqlens)
    return seqlens


def owns_its_memory(tensor: Tensor) -> bool:
    """Whether ``tensor`` spans its whole storage (a copy of a view that does not would free
    the rest of the buffer once the view is no longer held)."""
    return tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size()


def compacted(tensor: Tensor) -> Tensor:
    return (
        tensor if owns_its_memory(tensor) else tensor.clone(memory_format=torch.contiguous_format)
    )


def _same(tensor: Tensor) -> Tensor:
    return tensor


_FORWARD = inspect.signature(SelfAttention.forward)


class CompactKVSelfAttention(SelfAttention):
    """``SelfAttention`` whose ``get_query_key_value_tensors`` returns keys and values that
    own their memory, and the query and key with the rotary embedding
    applied on tables shared by every layer (docs/design/local_layer_spec.md says why). The
    unsplit form (``split_qkv=False``, Megatron's fused-rotary path) is returned as it is."""

    _pending_rotary: tuple[Any, Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = _FORWARD.bind(self, *args, **kwargs)
        rotary = bound.arguments.get("rotary_pos_emb")
        if rotary is None or not self._rotary_is_ours(bound.arguments):
            return super().forward(*args, **kwargs)
        if not isinstance(rotary, tuple):
            rotary = (rotary, rotary)
        bound.arguments["rotary_pos_emb"] = None  # Megatron's own rotary does not run
        self._pending_rotary = (rotary, bound.arguments.get("packed_seq_params"))
        try:
            return super().forward(*bound.args[1:], **bound.kwargs)
        finally:
            self._pending_rotary = None

    def _rotary_is_ours(self, arguments: dict[str, Any]) -> bool:
        """A forward (training, or a forward-only pass: log-probabilities, the sampler's) on
        the unfused rotary path Megatron would take (no inference context, no fused kernels, no
        flash decoding), on the code the path was checked on. In a forward-only pass of a packed
        batch Megatron's path loops over the sequences on the host; these tables do not."""
        config = self.config
        return (
            arguments.get("inference_context") is None
            and arguments.get("inference_params") is None
            and not InferenceMode.is_active()
            and not config.apply_rope_fusion
            and not config.flash_decode
            and not getattr(config, "fused_single_qkv_rope", False)
            and not config.multi_latent_attention
            and rotary_drift() is None
        )

    def _rotate(self, t: Tensor, freqs: Tensor | None, packed: Any, which: str) -> Tensor:
        """Megatron's rotary embedding of ``t`` (the query or key as ``get_query_key_value_tensors``
        returns it) on tables shared by every layer; Megatron's own under context
        parallelism of a packed batch."""
        if freqs is None:
            return t
        seqlens = None
        if packed is not None and packed.qkv_format == "thd":
            padded = getattr(packed, f"cu_seqlens_{which}_padded")
            cu_seqlens = padded if padded is not None else getattr(packed, f"cu_seqlens_{which}")
            if self.pg_collection.cp.size() > 1:
                rotated = rope_utils.apply_rotary_pos_emb(
                    t.squeeze(1),
                    freqs,
                    config=self.config,
                    cu_seqlens=cu_seqlens,
                    mscale=self._yarn_concentration_factor,
                    cp_group=self.pg_collection.cp,
                )
                return rotated.unsqueeze(1)
            seqlens = packed_seqlens(cu_seqlens, freqs.size(0))
        cos, sin = rotary_tables(freqs, t.dtype, self._yarn_concentration_factor, seqlens)
        rot_dim = cos.shape[-1]
        head, rest = t[..., :rot_dim], t[..., rot_dim:]
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            rotated = (head * cos) + (
                rope_utils._rotate_half(head, self.config.rotary_interleaved) * sin
            )
        return torch.cat((rotated, rest), dim=-1)

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> Any:
        split = super().get_query_key_value_tensors(*args, **kwargs)
        if not isinstance(split, tuple) or len(split) < 3:
            return split
        query, key, value, *rest = split
        if not all(isinstance(t, Tensor) for t in (query, key, value)):
            return split
        if self._pending_rotary is not None:
            (q_freqs, k_freqs), packed = self._pending_rotary
            query = self._rotate(query, q_freqs, packed, "q")
            key = self._rotate(key, k_freqs, packed, "kv")
        return (query, compacted(key), compacted(value), *rest)
