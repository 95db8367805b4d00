"""The local spec's attention (models.self_attention): keys and values that own their memory
(what the attention saves for backward does not keep the query's and key's pre-rotary bytes
alive), and a rotary embedding that keeps no cos/sin tables for the backward."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention

from nemo_rl_offload.models.self_attention import CompactKVSelfAttention, compacted, owns_its_memory


def test_a_view_into_a_larger_buffer_is_copied_and_a_whole_tensor_is_not():
    fused = torch.randn(5, 1, 2, 12)  # [s, b, groups, (q heads + 2) * dim]
    query, key, value = torch.split(fused, [8, 2, 2], dim=3)
    assert not owns_its_memory(value)
    compact = compacted(value)
    assert owns_its_memory(compact) and torch.equal(compact, value)
    whole = torch.randn(5, 1, 2, 2)
    assert compacted(whole) is whole


def test_the_local_spec_saves_the_values_own_bytes_only(build_tiny):
    """The tiny model's layers use the subclass; the value the core attention receives owns its
    memory, and one layer's forward-backward gives Megatron's SelfAttention's gradients."""
    model, _ = build_tiny("tiny-dense")
    attention = model.decoder.layers[0].self_attention
    assert type(attention) is CompactKVSelfAttention
    hidden = torch.randn(6, 1, 128, requires_grad=True)
    query, key, value = attention.get_query_key_value_tensors(hidden)
    assert owns_its_memory(value) and owns_its_memory(key)
    plain_query, plain_key, plain_value = super(
        CompactKVSelfAttention, attention
    ).get_query_key_value_tensors(hidden)
    assert not owns_its_memory(plain_value)  # what Megatron hands on: a view of the fused output
    for ours, theirs in ((query, plain_query), (key, plain_key), (value, plain_value)):
        assert torch.equal(ours, theirs)
    (query.sum() + 2 * key.sum() + 3 * value.sum()).backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    (plain_query.sum() + 2 * plain_key.sum() + 3 * plain_value.sum()).backward()
    assert torch.equal(ours, hidden.grad)


def _attention_and_inputs(build_tiny, dtype: torch.dtype, seq: int = 12):
    model, _ = build_tiny("tiny-dense")
    attention = model.decoder.layers[1].self_attention.to(dtype)
    freqs = model.rotary_pos_emb(seq)
    hidden = torch.randn(seq, 1, 128, dtype=dtype, generator=torch.Generator().manual_seed(3))
    return attention, freqs, hidden


def _rotary_kwargs(freqs: torch.Tensor, packed: bool) -> dict:
    """The attention's rotary arguments: padded, or a packed batch of two sequences (5 and 7
    tokens) whose positions restart."""
    from megatron.core.packed_seq_params import PackedSeqParams

    kwargs: dict = {"rotary_pos_emb": freqs}
    if packed:
        cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
        kwargs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=7,
            max_seqlen_kv=7,
        )
    return kwargs


def _forward_backward(forward, attention, hidden):
    """Output, the input's gradient and every parameter's, and the shapes autograd saved."""
    attention.zero_grad(set_to_none=True)
    hidden = hidden.clone().requires_grad_()
    saved: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output, _ = forward(hidden)
    weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
    (output * weights).sum().backward()
    grads = [hidden.grad] + [p.grad for p in attention.parameters()]
    return output.detach(), grads, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_rotary_embedding_trains_bit_for_bit_as_megatrons_and_hides_its_tables(
    build_tiny, dtype, packed
):
    """A training forward-backward of the local spec's attention (padded, or a packed batch of
    two sequences whose positions restart) gives Megatron's own SelfAttention.forward's
    output and gradients bit for bit; the rotary cos/sin tables ([s, 1, 1, head dim]), which
    Megatron's makes and keeps per call, are not handed to an outer saved-tensor hook (an
    offload group's would copy them for every layer)."""

    attention, freqs, hidden = _attention_and_inputs(build_tiny, dtype)
    kwargs = _rotary_kwargs(freqs, packed)
    table = tuple(freqs.shape)

    def ours(h):
        return attention(h, None, **kwargs)

    def megatrons(h):
        return SelfAttention.forward(attention, h, None, **kwargs)

    out, grads, saved = _forward_backward(ours, attention, hidden)
    plain_out, plain_grads, plain_saved = _forward_backward(megatrons, attention, hidden)
    assert table in plain_saved and table not in saved
    assert torch.equal(out, plain_out)
    for grad, plain in zip(grads, plain_grads, strict=True):
        assert torch.equal(grad, plain)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_forward_only_pass_rotates_as_megatrons_without_a_loop_per_sequence(
    build_tiny, packed, monkeypatch
):
    """Without gradients (log-probabilities, the sampler) the shared tables rotate too: the
    output is Megatron's bit for bit, and Megatron's per-sequence path of a packed batch
    (a host loop over the sequences) is not taken."""
    from megatron.core.models.common.embeddings import rope_utils

    attention, freqs, hidden = _attention_and_inputs(build_tiny, torch.bfloat16)
    kwargs = _rotary_kwargs(freqs, packed)
    with torch.no_grad():
        plain, _ = SelfAttention.forward(attention, hidden, None, **kwargs)
        calls: list[int] = []
        original = rope_utils._apply_rotary_pos_emb_thd
        monkeypatch.setattr(
            rope_utils,
            "_apply_rotary_pos_emb_thd",
            lambda *a, **k: calls.append(1) or original(*a, **k),
        )
        ours, _ = attention(hidden, None, **kwargs)
    assert torch.equal(ours, plain)
    assert calls == []


def test_every_layer_rotates_with_one_shared_pair_of_tables(build_tiny):
    """The tables are made once per frequencies tensor and layout and kept by autograd as they
    are: the query's multiplication in any layer saves the shared cosine table itself."""
    from nemo_rl_offload.models.self_attention import rotary_tables

    model, _ = build_tiny("tiny-dense")
    freqs = model.rotary_pos_emb(12)
    cos, sin = rotary_tables(freqs, torch.float32, 1.0, None)
    assert rotary_tables(freqs, torch.float32, 1.0, None) == (cos, sin)
    packed_cos, _ = rotary_tables(freqs, torch.float32, 1.0, (5, 7))
    assert packed_cos is not cos and torch.equal(packed_cos[5:], cos[:7])
    assert rotary_tables(freqs, torch.bfloat16, 1.0, None)[0].dtype == torch.bfloat16
    cos, _ = rotary_tables(freqs, torch.float32, 1.0, None)
    for layer in model.decoder.layers:
        query = torch.randn(12, 1, 2, freqs.shape[-1], requires_grad=True)
        rotated = layer.self_attention._rotate(query, freqs, None, "q")
        add = rotated.grad_fn.next_functions[0][0]  # cat((rotated, rest)) <- head*cos + ...
        multiply = add.next_functions[0][0]
        assert multiply._saved_other.data_ptr() == cos.data_ptr()


def test_forward_only_and_drifted_code_use_megatrons_rotary(build_tiny, monkeypatch):
    """Without autograd (log-probability passes) Megatron's own rotary runs; so it does when
    the megatron-core code the path relies on is not the checked code, with a warning."""
    from nemo_rl_offload.models import self_attention

    attention, freqs, hidden = _attention_and_inputs(build_tiny, torch.float32)
    with torch.no_grad():
        plain, _ = SelfAttention.forward(attention, hidden, None, rotary_pos_emb=freqs)
        ours, _ = attention(hidden, None, rotary_pos_emb=freqs)
    assert torch.equal(ours, plain)
    self_attention.rotary_drift.cache_clear()
    monkeypatch.setitem(
        self_attention.ROTARY_FINGERPRINTS,
        "apply_rotary_pos_emb",
        ("0" * 16, self_attention.rope_utils.apply_rotary_pos_emb),
    )
    try:
        with pytest.warns(UserWarning, match="apply_rotary_pos_emb changed"):
            assert not attention._rotary_is_ours({})
    finally:
        self_attention.rotary_drift.cache_clear()
    _, _, saved = _forward_backward(
        lambda h: attention(h, None, rotary_pos_emb=freqs), attention, hidden
    )
    assert tuple(freqs.shape) in saved  # Megatron's tables, kept


def test_a_packed_layout_is_read_once_per_microbatch():
    """Every layer of a micro-batch asks for the packed lengths; the device is read for the
    first only (each read waits for the GPU), and a new micro-batch's layout is read anew."""
    from nemo_rl_offload.models.self_attention import packed_seqlens

    class Counting(torch.Tensor):
        reads = 0

        def item(self):  # type: ignore[override]
            Counting.reads += 1
            return super().item()

    first = torch.tensor([0, 5, 12], dtype=torch.int32).as_subclass(Counting)
    assert packed_seqlens(first, 16) == (5, 7)
    assert packed_seqlens(first, 16) == (5, 7) and Counting.reads == 1
    assert packed_seqlens(first, 12) is None  # a frequencies row per packed token
    second = torch.tensor([0, 3, 12], dtype=torch.int32).as_subclass(Counting)
    assert packed_seqlens(second, 16) == (3, 9) and Counting.reads == 3
