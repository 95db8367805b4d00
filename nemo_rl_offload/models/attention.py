"""Core attention for Megatron's local layer spec through torch's scaled_dot_product_attention.

Megatron's local ``DotProductAttention`` materialises the S x S attention probabilities (and
offloading ``core_attn`` copies them to the host); SDPA keeps O(S) statistics. A drop-in for the
local spec's ``core_attention`` slot, also for packed sequences, generation's KV cache and
context parallelism: docs/design/local_layer_spec.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from nemo_rl_offload.models.context_parallel import gathered_order
from nemo_rl_offload.models.kv_cache import KVCache
from nemo_rl_offload.offload.shared_copies import keep_on_gpu


class SDPACoreAttention(MegatronModule):
    """Causal (or unmasked) scaled-dot-product attention for the local layer spec.

    Masks follow Megatron's convention: ``attention_mask`` None means "use the layer's mask
    type" (causal for GPT, so right-padded batches need no mask: a real token never attends to
    the padding after it); a boolean mask given explicitly marks with True the positions a query
    may NOT attend to, and replaces the causal mask (as in Megatron's local attention).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"SDPACoreAttention: softmax_type {config.softmax_type!r} is not supported "
                "(only 'vanilla')"
            )
        window = config.window_size, config.window_attn_skip_freq
        if is_layer_window_attention(*window, layer_number):
            raise NotImplementedError("SDPACoreAttention: sliding-window attention is unsupported")

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        # Heads are split across tensor-parallel ranks exactly as in the local DotProductAttention.
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        tp_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        # Query-key layer scaling (an fp16 overflow guard of the unfused kernel) divides the
        # scale by the layer number and multiplies it back inside the fp32 softmax: the net scale
        # is the plain one, which is what SDPA applies.
        head_dim = divide(projection_size, config.num_attention_heads)
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        # Set by KVCache.attached while generation runs; None for training and scoring passes.
        self.kv_cache: KVCache | None = None

    def _kernels(self) -> contextlib.AbstractContextManager[None]:
        """Under Megatron's deterministic_mode, SDPA's math kernel: torch's flash backward
        accumulates with atomics, so two identical passes differ, and cuDNN's occasionally does,
        while the math kernel is bitwise reproducible (measured on an H100; see
        docs/design/local_layer_spec.md). It materialises the
        S x S attention probabilities (O(S^2) memory), the price of reproducibility."""
        if not self.config.deterministic_mode:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn];
        packed (THD): query [t, np, hn], key/value [t, ng, hn] -> context [t, np * hn].

        The kernel saves its output for its backward, and the output projection saves the
        same bytes as its input. When ``core_attn`` is offloaded and ``attn_proj`` is not, the
        projection keeps them on the GPU, so copying them out with the attention's group would
        free nothing: they are marked to stay (:func:`.shared_copies.keep_on_gpu`)."""
        context = self._attend(
            query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
        )
        if self.training and self._projection_keeps_output:
            keep_on_gpu(context)
        return context

    @property
    def _projection_keeps_output(self) -> bool:
        config = self.config
        modules = config.offload_modules or () if config.fine_grained_activation_offloading else ()
        return "core_attn" in modules and "attn_proj" not in modules

    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None,
        attention_bias: Tensor | None,
        packed_seq_params: PackedSeqParams | None,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: attention_bias is not supported")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.kv_cache is not None:
            if self.kv_cache.decoding:
                return self.kv_cache.decode_attention(
                    self.layer_number, query, key, value, self.softmax_scale
                )
            self.kv_cache.store_prompt(self.layer_number, key, value)

        sq = query.size(0)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # A generation call's prompts are whole on every context-parallel rank (the cache is
        # not split over ranks): they attend as at one rank.
        if self.config.context_parallel_size > 1 and self.kv_cache is None:
            if attention_mask is not None or mask_type != AttnMaskType.causal:
                raise NotImplementedError(
                    "SDPACoreAttention: context parallelism needs the causal mask (no explicit "
                    "attention_mask)"
                )
            bounds = torch.tensor([0, sq * self.config.context_parallel_size])
            return self._context_parallel(query, key, value, bounds)
        sdpa_mask: Tensor | None = None
        if attention_mask is not None:
            # Megatron: True = masked out. An additive mask (rather than a boolean one) keeps a
            # fully masked row finite, as Megatron's masked_fill does, instead of NaN.
            sdpa_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            blocked = attention_mask.to(device=query.device, dtype=torch.bool)
            sdpa_mask.masked_fill_(blocked, torch.finfo(query.dtype).min)
        elif mask_type == AttnMaskType.causal and sq > 1:
            # Queries are the last sq positions of sk (bottom-right aligned, as with a KV cache).
            return self._lower_right(query, key, value).reshape(sq, query.size(1), -1)
        # [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = self._sdpa(q, k, v, attn_mask=sdpa_mask)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, query.size(1), -1)

    @property
    def _dropout_p(self) -> float:
        return self.dropout_p if self.training else 0.0

    @property
    def _grouped(self) -> bool:
        return self.num_attention_heads_per_partition != self.num_query_groups_per_partition

    def _sdpa(
        self, q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Any = None, is_causal: bool = False
    ) -> Tensor:
        """torch's SDPA on [b, heads, s, dim] with this layer's scale, grouped query heads,
        dropout (under Megatron's RNG tracker, as its attention) and, in deterministic mode,
        the reproducible kernel (:meth:`_kernels`)."""
        dropout_p = self._dropout_p
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0.0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng, self._kernels():
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=self._grouped,
            )

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams) -> Tensor:
        """Causal attention within each segment of a THD pack (see
        docs/design/local_layer_spec.md)."""
        if params.qkv_format != "thd":
            raise NotImplementedError(
                f"SDPACoreAttention: packed format {params.qkv_format!r} (only 'thd')"
            )
        if params.cu_seqlens_q_padded is not None and not torch.equal(
            params.cu_seqlens_q_padded, params.cu_seqlens_q
        ):
            raise NotImplementedError(
                "SDPACoreAttention: padding between packed sequences (cu_seqlens_q_padded)"
            )
        if query.dim() == 4:  # [t, 1, heads, dim]: a caller that did not squeeze the batch
            query, key, value = (t.squeeze(1) for t in (query, key, value))
        if self.attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError("SDPACoreAttention: packed sequences need causal attention")
        cu_q = params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv if params.cu_seqlens_kv is not None else cu_q
        if not torch.equal(cu_q, cu_kv):
            raise NotImplementedError("SDPACoreAttention: packed queries and keys must align")
        if self.config.context_parallel_size > 1:
            # [t, heads, dim] -> [t, 1, heads, dim]; offsets are the whole pack's (padded).
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            return self._context_parallel(query, key, value, cu_q).squeeze(1)
        grouped = self._grouped
        if self._varlen_usable(query, self._dropout_p):
            from torch.nn.attention.varlen import varlen_attn

            max_len = int(params.max_seqlen_q or query.size(0))
            accepts = _varlen_keywords()
            options: dict[str, object] = {"scale": self.softmax_scale}
            if "window_size" in accepts:
                options["window_size"] = (-1, 0)  # causal
            else:
                options["is_causal"] = True
            if grouped and "enable_gqa" in accepts:
                options["enable_gqa"] = True
            elif grouped:  # Megatron's mapping: query head i reads key/value group i // ratio
                ratio = query.size(1) // key.size(1)
                key, value = (t.repeat_interleave(ratio, dim=1) for t in (key, value))
            context = varlen_attn(
                query.contiguous(),
                key.contiguous(),
                value.contiguous(),
                cu_q.to(torch.int32),
                cu_kv.to(torch.int32),
                max_len,
                max_len,
                **options,
            )
            return context.reshape(query.size(0), -1)
        bounds = cu_q.tolist()
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end <= start:
                continue
            # [len, heads, dim] -> [1, heads, len, dim]
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            out = self._sdpa(q, k, v, is_causal=end - start > 1)
            pieces.append(out.squeeze(0).transpose(0, 1))
        context = torch.cat(pieces, dim=0) if pieces else query.new_zeros(query.shape)
        if context.size(0) != query.size(0):
            raise ValueError(
                f"SDPACoreAttention: cu_seqlens cover {context.size(0)} of {query.size(0)} tokens"
            )
        return context.reshape(query.size(0), -1)

    def _cp_group(self) -> torch.distributed.ProcessGroup:
        group = getattr(self.pg_collection, "cp", None)
        return group if group is not None else parallel_state.get_context_parallel_group()

    def _context_parallel(
        self, query: Tensor, key: Tensor, value: Tensor, bounds: Tensor
    ) -> Tensor:
        """Attention of this CP rank's query chunks over the all-gathered keys and values (see
        docs/design/local_layer_spec.md). ``bounds``: the sequences' offsets in the whole
        (padded) row, each sequence a multiple of 2 * CP long; tensors are [local tokens, b,
        heads, dim]."""
        group = self._cp_group()
        cp, rank = group.size(), group.rank()
        order = gathered_order(bounds.cpu(), cp).to(key.device)
        key, value = (
            tensor_parallel.gather_from_sequence_parallel_region(
                t, tensor_parallel_output_grad=True, group=group
            )[order]
            for t in (key, value)
        )
        pieces = []
        starts = [int(x) for x in bounds.tolist()]
        for start, end in zip(starts[:-1], starts[1:], strict=True):
            chunk = (end - start) // (2 * cp)
            if chunk == 0:
                continue
            local = start // cp
            for half, index in enumerate((rank, 2 * cp - 1 - rank)):
                q = query[local + half * chunk : local + (half + 1) * chunk]
                seen = start + (index + 1) * chunk
                pieces.append(self._lower_right(q, key[start:seen], value[start:seen]))
        context = torch.cat(pieces, dim=0)
        if context.size(0) != query.size(0):
            raise ValueError(
                f"SDPACoreAttention: context-parallel offsets cover {context.size(0)} of "
                f"{query.size(0)} local tokens"
            )
        return context.reshape(query.size(0), query.size(1), -1)

    def _lower_right(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Causal attention of queries that are the last ``sq`` of the ``sk`` keys:
        [sq, b, np, hn] and [sk, b, ng, hn] -> [sq, b, np, hn]."""
        sq, sk = query.size(0), key.size(0)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if sq == sk:
            context = self._sdpa(q, k, v, is_causal=sq > 1)
        else:
            context = self._sdpa(q, k, v, attn_mask=causal_lower_right(sq, sk))
        return context.permute(2, 0, 1, 3)

    def _varlen_usable(self, query: Tensor, dropout_p: float) -> bool:
        """torch's variable-length flash kernel: CUDA, half precision, no dropout (it has
        none), and not under deterministic mode (its backward accumulates with atomics)."""
        if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
            return False
        if dropout_p > 0.0 or self.config.deterministic_mode:
            return False
        try:
            from torch.nn.attention import varlen  # noqa: F401
        except ImportError:
            return False
        accepts = _varlen_keywords()
        return "window_size" in accepts or "is_causal" in accepts


@functools.cache
def _varlen_keywords() -> frozenset[str]:
    """The keyword arguments of the installed torch's ``varlen_attn``: its signature changed
    between torch releases (causality as ``is_causal`` or as a ``window_size``; grouped-query
    attention as ``enable_gqa`` or not at all), so each call passes what this torch takes."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


@contextlib.contextmanager
def kv_cache_attached(model: torch.nn.Module, cache: KVCache) -> Iterator[None]:
    """Every core attention of ``model`` reads and writes ``cache`` until the block ends."""
    modules = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    if {m.layer_number for m in modules} != set(cache.keys):
        raise RuntimeError("KVCache: the cache's layers are not this model's attention layers")
    for module in modules:
        module.kv_cache = cache
    try:
        yield
    finally:
        for module in modules:
            module.kv_cache = None
