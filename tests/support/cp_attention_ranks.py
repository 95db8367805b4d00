"""Context-parallel attention on gloo ranks against full attention computed on each rank
(spawned by :func:`support.worker_ranks.run_ranks`, hence a module of its own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def attention_against_full(
    rank: int, world: int, port: int, out: Path, rows: dict[str, list[int]]
) -> dict[str, Any]:
    """For each of ``rows`` (name: the sequences' offsets; one sequence is an unpacked row,
    several a pack): the max differences between this CP rank's attention (outputs and the
    gradients of q, k, v at its positions) and full attention over the whole row."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_rl_offload.models.attention import SDPACoreAttention
    from nemo_rl_offload.models.cpu_compat import enable_cpu_execution

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    enable_cpu_execution()

    def module(cp: int) -> SDPACoreAttention:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HEADS * HEAD_DIM,
            num_attention_heads=HEADS,
            num_query_groups=GROUPS,
            attention_dropout=0.0,
            context_parallel_size=cp,
        )
        return SDPACoreAttention(
            config, 1, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )

    return {name: _against_full(module, bounds, rank, world) for name, bounds in rows.items()}


def _against_full(module: Any, bounds: list[int], rank: int, world: int) -> dict[str, float]:
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from nemo_rl_offload.models.context_parallel import local_positions

    cu = torch.tensor(bounds, dtype=torch.int32)
    packed = len(bounds) > 2
    total = bounds[-1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, 1, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(total, 1, GROUPS, HEAD_DIM, generator=g) for _ in range(2))
    weights = torch.randn(total, 1, HEADS * HEAD_DIM, generator=g)
    held = local_positions(cu, world, rank)

    def run(attention: Any, q: Any, k: Any, v: Any, index: Any) -> list:
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        if packed:
            params = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=total
            )
            out = attention(
                q.squeeze(1), k.squeeze(1), v.squeeze(1), None, packed_seq_params=params
            )
            out = out.unsqueeze(1)
        else:
            out = attention(q, k, v, None)
        (out * weights[index]).sum().backward()
        return [out, q.grad, k.grad, v.grad]

    full = run(module(1), q, k, v, slice(None))
    local = run(module(world), q[held], k[held], v[held], held)
    names = ("out", "dq", "dk", "dv")
    return {
        name: float((mine - whole[held]).abs().max())
        for name, mine, whole in zip(names, local, full, strict=True)
    }
