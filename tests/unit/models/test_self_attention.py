"""Keys and values that own their memory (models.self_attention): the local spec's attention
hands the core attention a value that is not a view of the fused QKV output, so what the
attention saves for backward does not keep the query's and key's pre-rotary bytes alive."""

from __future__ import annotations

import torch

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
