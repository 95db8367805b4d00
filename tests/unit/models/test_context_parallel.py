"""Context parallelism's pieces: the load-balanced split and its inverse, and the attention of
two CP ranks (all-gathered keys and values, the chunks' causal mask) against full attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import cp_attention_ranks
from support.worker_ranks import run_ranks

from nemo_rl_offload.models.context_parallel import (
    gathered_order,
    local_positions,
    split_layout,
)


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence():
    # One sequence of 8 over CP 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2.
    cu = torch.tensor([0, 8])
    assert local_positions(cu, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(cu, 2, 1).tolist() == [2, 3, 4, 5]
    # A pack of two sequences (4 and 8): per sequence, in order.
    cu = torch.tensor([0, 4, 12])
    assert local_positions(cu, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    held = torch.cat([local_positions(cu, 2, r) for r in range(2)])
    assert held[gathered_order(cu, 2)].tolist() == list(range(12))


def test_split_layout_pads_each_sequence_to_2cp_and_the_row_to_the_multiple():
    plain = split_layout(7, None, 2, multiple=4)
    assert plain.padded_length == 8 and plain.keep.tolist() == list(range(7))
    # Sequences of 3, 5 and 2 tokens -> 4, 8, 4; the row to a multiple of 2 * CP * TP (8).
    pack = split_layout(10, torch.tensor([0, 3, 8, 10]), 2, multiple=8)
    assert pack.padded_cu_seqlens.tolist() == [0, 4, 12, 16]
    assert pack.keep.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12, 13]
    padded = split_layout(10, torch.tensor([0, 3, 8, 10]), 2, multiple=4, at_least=24)
    assert padded.padded_cu_seqlens.tolist() == [0, 4, 12, 16, 24]


def test_two_cp_ranks_attend_as_full_attention_with_gqa(tmp_path):
    """Outputs and the gradients of queries, keys and values (the keys' and values' summed
    over the ranks that read them) at each rank's positions, for a row and a pack."""
    rows = {"row": [0, 24], "pack": [0, 8, 20, 24]}
    results = run_ranks(cp_attention_ranks.attention_against_full, 2, tmp_path, rows=rows)
    for result in results:
        assert set(result) == set(rows)
        for name, errors in result.items():
            assert max(errors.values()) < 1e-5, (name, errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_query_chunk_attends_its_keys_bottom_right_on_cuda(dtype):
    """The CP attention's one SDPA call per query chunk (``causal_lower_right`` with grouped
    query heads, which CPU tests run through the math kernel only) against float32 attention
    with the explicit mask and keys and values repeated per head: outputs and gradients."""
    from torch.nn.attention.bias import causal_lower_right

    torch.manual_seed(0)
    sq, sk, heads, groups, dim = 512, 1536, 8, 2, 128
    q = torch.randn(1, heads, sq, dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, groups, sk, dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, groups, sk, dim, device="cuda", dtype=dtype, requires_grad=True)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(sq, sk), enable_gqa=True
    )
    grad = torch.randn_like(out)
    out.backward(grad)
    reference_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    rq, rk, rv = reference_inputs
    ratio = heads // groups
    mask = torch.ones(sq, sk, device="cuda", dtype=torch.bool).tril(sk - sq)
    expected = F.scaled_dot_product_attention(
        rq, rk.repeat_interleave(ratio, 1), rv.repeat_interleave(ratio, 1), attn_mask=mask
    )
    expected.backward(grad.float())
    # Relative error over the whole tensor: a half-precision kernel is off by about its
    # rounding (~1e-3 to 1e-2); a wrong mask by an order of one.
    bound = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for got, want in [(out, expected)] + [
        (t.grad, r.grad) for t, r in zip((q, k, v), reference_inputs, strict=True)
    ]:
        error = float((got.float() - want).norm() / want.norm())
        assert error < bound, error
