"""SDPACoreAttention equals Megatron's local DotProductAttention (float32, CPU): alone on random
grouped-query inputs, and inside a whole tiny model with the same weights."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_rl_offload.models.attention import SDPACoreAttention

HEADS, GROUPS, HEAD_DIM = 4, 2, 16


def _pair(**config_kwargs):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        **{"attention_dropout": 0.0, **config_kwargs},
    )
    args = dict(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    return SDPACoreAttention(**args), DotProductAttention(**args)


def _qkv(sq, sk, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, batch, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k = torch.randn(sk, batch, GROUPS, HEAD_DIM, generator=g, requires_grad=True)
    v = torch.randn(sk, batch, GROUPS, HEAD_DIM, generator=g, requires_grad=True)
    return q, k, v


def _run(module, q, k, v, mask):
    out = module(q, k, v, mask)
    grads = torch.autograd.grad(
        (out * torch.arange(out.numel()).view_as(out).sin()).sum(), (q, k, v)
    )
    return out, grads


@pytest.mark.parametrize("explicit_mask", [False, True], ids=["mask_none", "mask_given"])
def test_sdpa_equals_local_dot_product_attention_with_gqa(megatron_cpu, explicit_mask):
    sdpa, local = _pair()
    q, k, v = _qkv(24, 24)
    # Megatron's convention: True = may not attend. None: the layer's causal mask.
    mask = (
        torch.triu(torch.ones(24, 24, dtype=torch.bool), 1)[None, None] if explicit_mask else None
    )
    out, grads = _run(sdpa, q, k, v, mask)
    ref_out, ref_grads = _run(local, q, k, v, mask)
    assert out.shape == (24, 2, HEADS * HEAD_DIM)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=0)


def test_causal_with_fewer_queries_than_keys_aligns_bottom_right(megatron_cpu):
    sdpa, local = _pair()
    q, k, v = _qkv(5, 12)
    out, _ = _run(sdpa, q, k, v, None)
    allowed = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=12 - 5)
    ref, _ = _run(local, q, k, v, ~allowed[None, None])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_gqa_uses_megatrons_head_to_group_mapping(megatron_cpu):
    """Query head i reads key/value group i // (heads / groups): checked against MHA on the
    groups repeated that way."""
    sdpa, _ = _pair()
    q, k, v = _qkv(8, 8)
    out = sdpa(q, k, v, None)
    mha, _ = _pair()
    mha.num_query_groups_per_partition = HEADS
    rep = HEADS // GROUPS
    ref = mha(q, k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2), None)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_dropout_applies_in_training_only(megatron_cpu):
    """Dropout runs under Megatron's RNG tracker fork (the CPU tracker here) in training mode."""
    q, k, v = _qkv(16, 16)
    plain, _ = _pair()
    noisy, _ = _pair(attention_dropout=0.5)
    expected = plain(q, k, v, None)
    torch.manual_seed(0)
    assert not torch.allclose(noisy.train()(q, k, v, None), expected)
    torch.testing.assert_close(noisy.eval()(q, k, v, None), expected)


def test_packed_layouts_other_than_thd_without_gaps_are_rejected_clearly(megatron_cpu):
    """THD packs are attended per segment (test_packed_sequences.py); other packed formats and
    padding between packed sequences are not supported and say so."""
    sdpa, _ = _pair()
    q, k, v = _qkv(4, 4)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="only 'thd'"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    gaps = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=torch.tensor([0, 3, 4], dtype=torch.int32),
    )
    with pytest.raises(NotImplementedError, match="padding between packed sequences"):
        sdpa(q, k, v, None, packed_seq_params=gaps)


def test_whole_model_equals_local_attention_model(build_tiny):
    """Same weights, SDPA vs DotProductAttention core attention: same logits and token losses."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel

    model, _ = build_tiny("tiny-dense")
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    reference = GPTModel(
        config=model.config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        position_embedding_type="rope",
    )
    reference.load_state_dict(model.state_dict(), strict=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=g)
    pos = torch.arange(32).expand(2, 32)
    labels = torch.roll(ids, -1, dims=1)
    torch.testing.assert_close(model(ids, pos, None), reference(ids, pos, None), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        model(ids, pos, None, labels=labels),
        reference(ids, pos, None, labels=labels),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_mode_runs_the_math_kernel(megatron_cpu, monkeypatch, deterministic):
    """Megatron's deterministic_mode selects SDPA's math kernel (bitwise reproducible on GPU,
    where the flash backward is not); otherwise SDPA picks its kernel freely."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.flash_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    sdpa, local = _pair(deterministic_mode=deterministic)
    q, k, v = _qkv(8, 8)
    out, _ = _run(sdpa, q, k, v, None)
    torch.testing.assert_close(out, local(q, k, v, None), atol=1e-5, rtol=0)
    assert seen == [not deterministic]
    assert torch.backends.cuda.flash_sdp_enabled()  # restored after the call
