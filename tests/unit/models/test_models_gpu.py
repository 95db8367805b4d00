"""The GPU path (nccl, CUDA RNG tracker, no CPU patches, fine-grained offloading on): run on
a GPU machine (docs/gpu.md); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _build(model="tiny-dense", seed=0, precision="float32", **cfg):
    from support.policies import make_policy

    from nemo_rl_offload.config.megatron_settings import effective_settings
    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.models.builder import build_gpt_model
    from nemo_rl_offload.models.parallel import initialize_megatron_parallel

    policy = make_policy(model, **cfg)
    policy["precision"] = precision
    effective = effective_settings(policy, architecture_for(model), te_installed=False)
    # Megatron initialises weights on the GPU from its model-parallel RNG tracker, which each
    # build advances: seeding every generator again (as a worker does for its model, joining
    # the fixture's groups) gives every build of a seed the same weights.
    initialize_megatron_parallel({}, seed=seed, on_gpu=True)
    return build_gpt_model(effective, architecture_for(model), on_gpu=True)


def _batches(vocab, n, seq=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (2, seq), generator=g)
        mask = torch.ones(2, seq)
        mask[:, seq - 4 * (i + 1) :] = 0
        out.append(
            {
                "input_ids": ids.cuda(),
                "labels": torch.roll(ids, -1, 1).cuda(),
                "loss_mask": mask.cuda(),
            }
        )
    return out


def _token_loss(batch, output):
    mask = batch["loss_mask"]
    return (output.float() * mask).sum(), mask.sum().to(torch.int), {}


def test_sdpa_equals_local_attention_on_gpu(megatron_gpu):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_rl_offload.models.attention import SDPACoreAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
    )
    args = dict(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(48, 2, 4, 16, generator=g).cuda()
    k = torch.randn(48, 2, 2, 16, generator=g).cuda()
    v = torch.randn(48, 2, 2, 16, generator=g).cuda()
    out = SDPACoreAttention(**args)(q, k, v, None)
    ref = DotProductAttention(**args)(q, k, v, None)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_gradient_accumulation_is_exact_on_gpu(megatron_gpu):
    from nemo_rl_offload.policy.train_step import run_microbatches

    model, warnings = _build()
    assert warnings == [] and next(model.parameters()).is_cuda
    batches = _batches(model.vocab_size, 3)
    run_microbatches(model, batches, _token_loss, forward_only=False)
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ids = torch.cat([b["input_ids"] for b in batches])
    mask = torch.cat([b["loss_mask"] for b in batches])
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    per_token = model(ids, pos, None, labels=torch.cat([b["labels"] for b in batches]))
    ((per_token * mask).sum() / mask.sum()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(accumulated[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_fgo_model_trains_and_offloads_on_gpu(megatron_gpu, preset):
    import megatron.core.extensions.transformer_engine as te_extension
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    from nemo_rl_offload.policy.train_step import run_microbatches

    model, warnings = _build(
        preset,
        precision="bfloat16",
        fine_grained_activation_offloading=True,
        offload_modules=["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"],
        min_offloaded_tensor_size=1024,
    )
    assert warnings == []
    assert model.config.fine_grained_activation_offloading is True
    assert te_extension.cpu_offload is not None
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = _batches(model.vocab_size, 4, seed=1)
    losses = []
    for _ in range(6):
        optimizer.zero_grad(set_to_none=True)
        outs = run_microbatches(model, batches, _token_loss, forward_only=False)
        optimizer.step()
        losses.append(sum(float(o["loss"]) for o in outs) / sum(int(o["num_tokens"]) for o in outs))
    assert losses[-1] < losses[0] - 0.5, losses
    offloaded = PipelineOffloadManager.get_instance().offload_summary_bytes
    assert sum(offloaded.values()) > 0, offloaded


def _packed_params(bounds, device="cuda"):
    from nemo_rl_offload.policy.train_step import packed_seq_params

    return packed_seq_params({"cu_seqlens": torch.tensor(bounds, device=device)})


def test_packed_attention_uses_varlen_flash_and_equals_per_segment_attention(megatron_gpu):
    """Sequence packing on GPU: torch's variable-length flash kernel (bf16) against one SDPA
    call per segment, forward and backward."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_rl_offload.models.attention import SDPACoreAttention

    heads, groups, dim = 8, 2, 64
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
    )
    attention = SDPACoreAttention(config, 1, AttnMaskType.causal, "self").cuda()
    params = _packed_params([0, 100, 101, 357, 512])
    g = torch.Generator(device="cuda").manual_seed(0)
    opts = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    q = torch.randn(512, heads, dim, **opts).requires_grad_()
    k = torch.randn(512, groups, dim, **opts).requires_grad_()
    v = torch.randn(512, groups, dim, **opts).requires_grad_()
    assert attention._varlen_usable(q, 0.0)
    out = attention(q, k, v, None, packed_seq_params=params)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    attention._varlen_usable = lambda *args: False  # the per-segment path
    ref = attention(q, k, v, None, packed_seq_params=params)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for grad, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=5e-2, rtol=5e-2)


def test_a_packed_bf16_model_gives_the_padded_token_losses_on_gpu(megatron_gpu):
    """The whole model on GPU in bf16 (varlen attention, RoPE restarting per sequence)."""
    import numpy as np
    from megatron.core.transformer.module import Float16Module

    from nemo_rl_offload.algorithms import packing
    from nemo_rl_offload.algorithms.batching import TokenSequence, make_microbatch
    from nemo_rl_offload.policy.train_step import forward_outputs

    model, _ = _build(precision="bfloat16")
    model = Float16Module(model.config, model)
    rng = np.random.default_rng(0)
    sequences = [TokenSequence([int(t) for t in rng.integers(1, 384, n)], 2) for n in (70, 9, 45)]
    padded = make_microbatch(sequences, pad_id=0)
    packed = packing.pack_microbatch(sequences, pad_id=0, length=128)
    keys = ("input_ids", "labels", "position_ids", "cu_seqlens")
    to_gpu = lambda mb: {k: torch.tensor(mb[k]).cuda() for k in keys if k in mb}  # noqa: E731
    # ("loss" is the schedule's own report key, which forward_outputs leaves out)
    loss = lambda batch, output: {"token_loss": output.float()}  # noqa: E731
    (rows,) = forward_outputs(model, [to_gpu(padded)], loss)
    (pack,) = forward_outputs(model, [to_gpu(packed)], loss)
    start = 0
    for row, seq in enumerate(sequences):
        n = len(seq.ids) - 1
        torch.testing.assert_close(
            pack["token_loss"][0, start : start + n],
            rows["token_loss"][row, :n],
            atol=5e-2,
            rtol=5e-2,
        )
        start += n + 1


def test_chunked_label_loss_equals_megatrons_on_gpu_in_bf16(megatron_gpu):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from nemo_rl_offload.models.chunked_logprobs import chunked_label_loss

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(300, 2, 1000, device="cuda", generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (2, 300), device="cuda", generator=g)
    expected = vocab_parallel_cross_entropy(logits.clone(), labels.t().contiguous()).t()
    torch.testing.assert_close(chunked_label_loss(labels, logits, 64), expected.float())


def _held_and_grads(model, batch):
    """Bytes allocated between forward and backward (after a warm-up step, so that lazily
    allocated workspaces are there already) and the gradients of one step."""
    ids = batch["input_ids"]
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    for _ in range(2):  # a warm-up step, then the measured one
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(ids, pos, None, labels=batch["labels"]).sum()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
    return held, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("modules", [["layernorm"], ["mlp_act"], ["layernorm", "mlp_act"], ["mlp"]])
def test_selective_recompute_without_te_on_gpu(megatron_gpu, modules):
    """layernorm and mlp_act (models.local_recompute) and Megatron's mlp on a GPU: gradients
    within the spread of two plain runs (bitwise where the kernels are deterministic), and the
    bytes held between forward and backward drop by the freed tensors: both norms' outputs for
    layernorm (CUDA's fused RMSNorm keeps only its input and a reciprocal RMS), fc2's input and
    the unfused gated unit's two intermediates for mlp_act."""
    from nemo_rl_offload.config.model_presets import architecture_for

    arch = architecture_for("tiny-dense").transformer
    batch = _batches(architecture_for("tiny-dense").vocab_size, 1)[0]
    first, second = _build()[0], _build()[0]
    model, warnings = _build(
        activation_checkpointing=True, recompute_granularity="selective", recompute_modules=modules
    )
    assert warnings == []
    for other in (second, model):  # else the comparison below compares different models
        weights = zip(first.parameters(), other.parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in weights), "same seed, same weights"
    plain_held, plain = _held_and_grads(first, batch)
    _, again = _held_and_grads(second, batch)
    held, grads = _held_and_grads(model, batch)
    for name, want in plain.items():
        spread = (again[name] - want).abs().max()
        assert (grads[name] - want).abs().max() <= spread, name
    tokens = batch["input_ids"].numel()
    per_layer = 0
    if "layernorm" in modules:
        per_layer += 2 * arch["hidden_size"]
    if "mlp_act" in modules:
        per_layer += 3 * arch["ffn_hidden_size"]
    expected = arch["num_layers"] * tokens * per_layer * 4  # float32
    if expected:
        assert abs(plain_held - held - expected) <= 0.02 * expected, (plain_held, held, expected)
    else:
        assert held < plain_held


def test_microbatches_reach_the_gpu_without_waiting_for_queued_work():
    """The worker's micro-batches go through pinned memory without a synchronisation: the
    host returns while the GPU still runs earlier work (there, the previous step's optimizer),
    and the tensors hold the values and dtypes given."""
    import time
    from types import SimpleNamespace

    import numpy as np

    from nemo_rl_offload.policy.policy_worker import PolicyWorker

    worker = SimpleNamespace(on_gpu=True, device=torch.device("cuda"))
    given = [
        {"input_ids": np.arange(8192, dtype=np.int64).reshape(1, -1), "mask": np.ones((1, 8))},
        {"input_ids": np.zeros((1, 4), dtype=np.int64), "mask": np.zeros((1, 4), dtype=bool)},
        {"input_ids": np.arange(12, dtype=np.int32).reshape(3, 4).T},  # not contiguous
    ]
    for batch in given:  # Ray hands the worker read-only arrays
        for value in batch.values():
            value.flags.writeable = False
    PolicyWorker._tensors(worker, given)  # the pinned pool's first blocks are made here
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued GPU work
    end.record()
    began = time.perf_counter()
    tensors = PolicyWorker._tensors(worker, given)
    host_s = time.perf_counter() - began
    torch.cuda.synchronize()
    queued_s = start.elapsed_time(end) / 1e3
    assert host_s < queued_s / 10, (host_s, queued_s)
    for want, got in zip(given, tensors, strict=True):
        for key, value in want.items():
            assert got[key].is_cuda
            assert np.array_equal(got[key].cpu().numpy(), value)
            assert got[key].cpu().numpy().dtype == value.dtype
