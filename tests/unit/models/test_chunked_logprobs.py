"""``policy.logprob_chunk_size``: label log-probabilities and teacher top-k scores taken in
chunks of the sequence equal the unchunked ones (values and gradients, float32 on CPU)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.models import chunked_logprobs
from nemo_rl_offload.models.train_step import run_microbatches


def _logits_and_labels(seq=13, batch=3, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(seq, batch, vocab, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    return logits, labels


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
def test_chunked_label_loss_equals_megatrons_cross_entropy(megatron_cpu, chunk):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, labels = _logits_and_labels()
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    # Megatron's cross entropy shifts float32 logits in place: give it a copy.
    expected = vocab_parallel_cross_entropy(logits.clone(), labels.t().contiguous()).t()
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    loss = chunked_logprobs.chunked_label_loss(labels, logits, chunk)
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
    assert loss.shape == labels.shape and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_half_precision_logits_get_float32_log_probabilities(megatron_cpu):
    logits, labels = _logits_and_labels()
    half = logits.detach().to(torch.bfloat16).requires_grad_()
    loss = chunked_logprobs.chunked_label_loss(labels, half, 5)
    reference = torch.nn.functional.cross_entropy(
        half.float().permute(1, 2, 0), labels, reduction="none"
    )
    torch.testing.assert_close(loss, reference, atol=1e-4, rtol=1e-4)
    (grad,) = torch.autograd.grad(loss.sum(), half)
    assert grad.dtype == torch.bfloat16


def _token_loss(batch, output):
    mask = batch["loss_mask"]
    return (output * mask).sum(), mask.sum(), {}


def test_a_model_with_chunked_log_probabilities_trains_as_without(build_tiny):
    model, _ = build_tiny()
    g = torch.Generator().manual_seed(2)
    batches = [
        {
            "input_ids": torch.randint(1, 384, (2, 24), generator=g),
            "labels": torch.randint(1, 384, (2, 24), generator=g),
            "loss_mask": (torch.rand(2, 24, generator=g) > 0.3).float(),
        }
        for _ in range(2)
    ]

    def step() -> tuple[list[float], list[torch.Tensor]]:
        for p in model.parameters():
            p.grad = None
        reports = run_microbatches(model, batches, _token_loss, forward_only=False)
        return [float(r["loss"]) for r in reports], [p.grad.clone() for p in model.parameters()]

    losses, grads = step()
    chunked_logprobs.install(model, 5)
    assert model.compute_language_model_loss.__func__ is not type(model).compute_language_model_loss
    chunked_losses, chunked_grads = step()
    assert chunked_losses == pytest.approx(losses, rel=1e-5)
    for grad, ref in zip(chunked_grads, grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-6, rtol=1e-4)


def test_install_without_a_chunk_size_leaves_the_model_alone(build_tiny):
    model, _ = build_tiny()
    chunked_logprobs.install(model, None)
    assert "compute_language_model_loss" not in vars(model)


@pytest.mark.parametrize("k", [None, 4])
def test_chunked_top_k_equals_the_whole_log_softmax(k):
    logits = 3 * torch.randn(2, 11, 40, generator=torch.Generator().manual_seed(4))
    full = torch.log_softmax(logits.float(), dim=-1)
    out = chunked_logprobs.topk_logprobs(logits, k, 3)
    if k is None:
        torch.testing.assert_close(out["values"], full)
        assert "indices" not in out
    else:
        values, indices = full.topk(k, dim=-1)
        torch.testing.assert_close(out["values"], values)
        assert torch.equal(out["indices"], indices)
    assert chunked_logprobs.topk_logprobs(logits, k, None)["values"].shape == out["values"].shape


@pytest.mark.parametrize("chunk", [0, -3, 2.5, "big"])
def test_validate_refuses_a_chunk_size_that_is_not_a_positive_integer(chunk):
    from support.policies import make_policy

    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.offload.capabilities import detect
    from nemo_rl_offload.offload.rules import check_policy

    policy = {**make_policy(), "logprob_chunk_size": chunk}
    findings = check_policy(
        policy, where="policy", architecture=architecture_for("tiny-dense"), caps=detect()
    )
    assert [e for e in findings.errors if e.startswith("policy.logprob_chunk_size: must be")]
    policy["logprob_chunk_size"] = 1024
    findings = check_policy(
        policy, where="policy", architecture=architecture_for("tiny-dense"), caps=detect()
    )
    assert not [e for e in findings.errors if "logprob_chunk_size" in e]
