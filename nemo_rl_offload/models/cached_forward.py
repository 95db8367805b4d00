"""The policy's forward for generation: Megatron's GPTModel pieces called in order over this
rank's pipeline stage, with the rotary positions the KV cache needs, outside Megatron's schedule.

It exists because ``GPTModel.forward`` takes rotary positions from the input's length, while a
decode step feeds each row one token at its own position; it also computes logits only where
they are sampled. Why, and the layouts: docs/generation.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class CachedForward:
    def __init__(self, model: torch.nn.Module, vocab_size: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model

        self.gpt = unwrap_model(model)
        self.config = self.gpt.config
        self.vocab_size = vocab_size
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.sp = bool(self.config.sequence_parallel) and self.tp > 1
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.dtype = next(self.gpt.decoder.parameters()).dtype
        if self.gpt.position_embedding_type != "rope":
            raise NotImplementedError(
                f"generation: position embedding {self.gpt.position_embedding_type!r} (only rope)"
            )

    @property
    def multiple(self) -> int:
        """Sequences fed to the model are padded to a multiple of this (sequence parallelism
        splits them over tensor-parallel ranks)."""
        return self.tp if self.sp else 1

    def rotary_table(self, max_len: int) -> Tensor:
        """Rotary frequencies of positions 0..max_len-1, [max_len, 1, 1, dim]: the whole table,
        on every context-parallel rank too (the module's forward would keep this rank's chunks
        of the sequence, and generation does not split sequences over those ranks)."""
        return self.gpt.rotary_pos_emb.get_emb(max_len)

    def logits(self, ids: Tensor, freqs: Tensor, seq_index: Tensor, row_index: Tensor) -> Tensor:
        """Float32 next-token logits [n, vocab] at (sequence position, batch row) pairs of the
        fed tokens ``ids`` [batch, s] (Megatron's input layout), on every rank."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        batch, s = ids.shape
        hidden_size = self.config.hidden_size
        local_s = s // self.multiple
        if self.first:
            positions = torch.arange(s, device=ids.device).unsqueeze(0).expand(batch, s)
            hidden = self.gpt.embedding(input_ids=ids, position_ids=positions)
            if self.sp and not self.gpt.embedding.scatter_to_sequence_parallel:
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
        else:
            hidden = torch.empty((local_s, batch, hidden_size), dtype=self.dtype, device=ids.device)
            torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            self.gpt.set_input_tensor(hidden)
        hidden = self.gpt.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=freqs)
        n = seq_index.numel()
        if not self.last:
            torch.distributed.send(
                hidden.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank()
            )
            logits = torch.empty((n, self.vocab_size), dtype=torch.float, device=ids.device)
        else:
            if self.sp:
                hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden)
            picked = hidden[seq_index, row_index]  # [n, hidden]
            if self.gpt.share_embeddings_and_output_weights:
                weight = self.gpt.shared_embedding_or_output_weight()
            else:
                weight = self.gpt.output_layer.weight
            local = F.linear(picked, weight)
            logits = full_vocab(local)[:, : self.vocab_size].float()
        if self.pp > 1:
            torch.distributed.broadcast(
                logits,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
        return logits


def full_vocab(logits: Tensor) -> Tensor:
    """Logits are split over the vocabulary across tensor-parallel ranks: gather them."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits
