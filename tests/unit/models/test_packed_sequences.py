"""Packed micro-batches train exactly as padded ones (float32, CPU): attention stays within each
sequence, RoPE positions restart at each one, and the SFT, GRPO and distillation losses and
their gradients equal those of the same sequences as padded rows; dynamic batching's step
equals the fixed-row step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_rl_offload import losses
from nemo_rl_offload.algorithms import packing
from nemo_rl_offload.algorithms.batching import TokenSequence, microbatches
from nemo_rl_offload.config import batching_settings
from nemo_rl_offload.models.attention import SDPACoreAttention
from nemo_rl_offload.offload import runtime
from nemo_rl_offload.policy.train_step import packed_seq_params, run_microbatches

HEADS, GROUPS, HEAD_DIM = 4, 2, 16
PAD = 0
VOCAB = 384  # tiny-dense


def _attention(**config):
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_dropout=0.0,
        **config,
    )
    return SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")


def _params(bounds: list[int]) -> PackedSeqParams:
    return packed_seq_params({"cu_seqlens": torch.tensor(bounds)})


def test_packed_attention_equals_each_sequence_attended_alone(megatron_cpu):
    attention = _attention()
    bounds = [0, 5, 6, 17, 24]  # a one-token sequence too
    g = torch.Generator().manual_seed(0)
    q = torch.randn(24, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k = torch.randn(24, GROUPS, HEAD_DIM, generator=g, requires_grad=True)
    v = torch.randn(24, GROUPS, HEAD_DIM, generator=g, requires_grad=True)
    out = attention(q, k, v, None, packed_seq_params=_params(bounds))
    assert out.shape == (24, HEADS * HEAD_DIM)
    weights = torch.arange(out.numel()).view_as(out).sin()
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected, expected_grads = [], [torch.zeros_like(t) for t in (q, k, v)]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        parts = [t[start:end].detach().unsqueeze(1).requires_grad_() for t in (q, k, v)]
        alone = attention(*parts, None).squeeze(1)  # [s, 1, ...] padded layout, causal
        part_grads = torch.autograd.grad((alone * weights[start:end]).sum(), parts)
        for total, part in zip(expected_grads, part_grads, strict=True):
            total[start:end] = part.squeeze(1)
        expected.append(alone)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=0)
    for grad, ref in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=0)


def test_packed_attention_refuses_offsets_that_miss_tokens(megatron_cpu):
    attention = _attention()
    q = torch.randn(10, HEADS, HEAD_DIM)
    k = v = torch.randn(10, GROUPS, HEAD_DIM)
    with pytest.raises(ValueError, match="cover 8 of 10"):
        attention(q, k, v, None, packed_seq_params=_params([0, 3, 8]))


# ----------------------------------------------------------------- whole model, three losses
LENGTHS = [11, 6, 19, 9]


def _sequences(extras: bool = False) -> list[TokenSequence]:
    rng = np.random.default_rng(3)
    return [
        TokenSequence(
            [int(t) for t in rng.integers(1, VOCAB, n)],
            3,
            {"advantages": float(rng.normal())} if extras else {},
        )
        for n in LENGTHS
    ]


def _tensors(mb: dict) -> dict:
    return {k: torch.tensor(v) for k, v in mb.items()}


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _step(model, mbs: list[dict], spec: dict) -> tuple[float, list[torch.Tensor]]:
    """A training step's summed loss and (per-token normalised) gradients."""
    for p in model.parameters():
        p.grad = None
    reports = run_microbatches(
        model, [_tensors(mb) for mb in mbs], losses.make_loss_fn(spec), forward_only=False
    )
    return sum(float(r["loss"]) for r in reports), _grads(model)


def _position_values(sequences, seed: int, trailing: tuple[int, ...] = ()) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(len(s.ids), *trailing)).astype(np.float32) for s in sequences]


def _teacher(sequences) -> list[np.ndarray]:
    """Full-vocabulary teacher log-probabilities per position."""
    logits = _position_values(sequences, 7, (VOCAB,))
    return [torch.log_softmax(torch.tensor(x), -1).numpy() for x in logits]


SPECS = {
    "nll": {"name": "nll"},
    "grpo": {
        "name": "grpo",
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.2,
        "ratio_clip_c": 3.0,
        "kl_penalty": 0.05,
    },
    "distillation": {"name": "distillation", "kl_type": "mixed", "vocab_size": VOCAB},
    # Every per-sequence reduction of the GRPO loss: GSPO's sequence ratio, per-sequence
    # averaging (the step counts sequences), sequence-masked importance weights, the positive
    # examples' NLL. In a pack they must reduce per packed sequence, not per row.
    "grpo_per_sequence": {
        "name": "grpo",
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.2,
        "kl_penalty": 0.05,
        "loss_fn": {
            "sequence_level_importance_ratios": True,
            "token_level_loss": False,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio": 1.5,
            "truncated_importance_sampling_ratio_min": 0.5,
            "positive_example_nll_weight": 0.3,
        },
    },
}


def _layouts(sequences, spec_name: str):
    """The same sequences as padded rows (two micro-batches of two) and as two packs."""
    rows = packing.BatchingSettings(mode="rows", train_rows=2)
    packed = packing.BatchingSettings(mode="packing", train_tokens=32, round_to=8)
    out = []
    for settings in (rows, packed):
        batches = packing.training_batches(sequences, settings, 1, pad_id=PAD)
        if spec_name.startswith("grpo"):
            # Old and reference log-probabilities near the policy's: ratios inside and outside
            # the clip range.
            batches.attach("old_logprobs", [-3.0 - v for v in _position_values(sequences, 1)])
            batches.attach("reference_logprobs", [-6.0 + v for v in _position_values(sequences, 2)])
        if spec_name == "grpo_per_sequence":
            # sampler log-probabilities: some sequences' weights inside the bounds, some not
            batches.attach(
                "generation_logprobs", [-3.0 - 0.3 * v for v in _position_values(sequences, 3)]
            )
            batches.attach("rewards", np.asarray([1.0, 0.0] * (len(sequences) // 2), np.float32))
            batches.attach("positive_nll_scale", np.full(len(sequences), 2.0, np.float32))
        if spec_name == "distillation":
            for mb in batches.flat:
                del mb["labels"]
            batches.attach("teacher_logprobs", _teacher(sequences))
        out.append(batches.flat)
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_packed_step_equals_the_padded_step(build_tiny, name):
    model, _ = build_tiny()
    sequences = _sequences(extras=name.startswith("grpo"))
    padded, packed = _layouts(sequences, name)
    assert len(packed) < sum(len(mb["input_ids"]) for mb in padded)  # packs do hold several
    assert all("cu_seqlens" in mb and mb["input_ids"].shape == (1, 32) for mb in packed)
    loss, grads = _step(model, padded, SPECS[name])
    packed_loss, packed_grads = _step(model, packed, SPECS[name])
    assert loss != 0
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    for grad, ref in zip(packed_grads, grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-6, rtol=1e-4)


def test_without_segment_offsets_the_pack_would_differ(build_tiny):
    """The check above can fail: the same pack without cu_seqlens (one causal sequence: later
    sequences see earlier ones, positions do not restart) gives another loss."""
    model, _ = build_tiny()
    sequences = _sequences()
    padded, packed = _layouts(sequences, "nll")
    loss, _ = _step(model, padded, SPECS["nll"])
    unsegmented = [{k: v for k, v in mb.items() if k != "cu_seqlens"} for mb in packed]
    assert _step(model, unsegmented, SPECS["nll"])[0] != pytest.approx(loss, rel=1e-5)


def test_a_dynamic_batching_step_equals_the_fixed_row_step(build_tiny):
    model, _ = build_tiny()
    rng = np.random.default_rng(5)
    sequences = [
        TokenSequence([int(t) for t in rng.integers(1, VOCAB, n)], 2) for n in [4, 30, 9, 17, 25, 6]
    ]
    fixed = microbatches(sequences, 2, pad_id=PAD)
    dynamic = packing.training_batches(
        sequences,
        packing.BatchingSettings(mode="dynamic", train_tokens=64, sequence_length_round=8),
        1,
        pad_id=PAD,
    ).flat
    assert [len(mb["input_ids"]) for mb in dynamic] != [2, 2, 2]  # cut by tokens, not rows
    loss, grads = _step(model, fixed, SPECS["nll"])
    dynamic_loss, dynamic_grads = _step(model, dynamic, SPECS["nll"])
    assert dynamic_loss == pytest.approx(loss, rel=1e-5)
    for grad, ref in zip(dynamic_grads, grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------ offload runtime and packs
def test_padding_a_pack_makes_the_padding_a_segment_of_no_sequence():
    mb = packing.pack_microbatch(_sequences()[:2], pad_id=PAD, length=24)
    (grown,) = runtime.pad_microbatches([mb], 32)
    assert grown["cu_seqlens"].tolist() == [0, 11, 17, 24, 32]
    assert grown["input_ids"].shape == (1, 32)
    assert set(grown["segment_ids"][0, 17:].tolist()) == {-1}


def test_packing_gives_the_offload_runtime_one_length_bucket():
    section = {
        "max_total_sequence_length": 3000,
        "train_micro_batch_size": 2,
        "make_sequence_length_divisible_by": 64,
        "sequence_packing": {"enabled": True, "train_mb_tokens": 6000},
    }
    assert batching_settings.step_buckets(section) == ([6016], False)


def test_packed_steps_of_one_count_reuse_one_offload_plan(monkeypatch):
    from types import SimpleNamespace

    from support.fake_offload import fake_plans

    fake_plans(monkeypatch)
    settings = packing.BatchingSettings(mode="packing", train_tokens=64, round_to=8)
    rt = runtime.OffloadRuntime(
        SimpleNamespace(fine_grained_activation_offloading=True),
        sequence_buckets=[settings.pack_length()],
    )
    rng = np.random.default_rng(0)
    shapes = set()
    for _ in range(5):
        lengths = rng.integers(5, 60, 6).tolist()
        sequences = [TokenSequence(list(range(1, n + 1)), 1) for n in lengths]
        mbs = packing.training_batches(sequences, settings, 1, pad_id=PAD).flat
        rt.prepare_step(mbs)
        shapes.add(rt.step_shape)
    assert {length for _, length in shapes} == {64}
    assert rt.plans_recorded == len(shapes)  # one plan per micro-batch count
