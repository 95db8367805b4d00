"""The losses against hand-computed values and their defining properties."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_offload import losses


def test_nll_sums_only_masked_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    total, count = losses.nll_loss(logprobs, mask)
    assert total.item() == pytest.approx(5.5) and count.item() == 3


def test_sequence_logprobs_sum_and_average():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert losses.sequence_logprobs(logprobs, mask).item() == -5.0
    assert losses.sequence_logprobs(logprobs, mask, average=True).item() == -2.5


def test_dpo_loss_matches_formula_and_counts_accuracy():
    chosen, rejected = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0])
    ref_c, ref_r = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -4.5])
    loss, metrics = losses.dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1)
    margins = [0.1 * ((-3.0 + 3.5) - (-4.0 + 3.5)), 0.1 * ((-5.0 + 5.0) - (-4.0 + 4.5))]
    expected = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["preference_accuracy_sum"].item() == 1.0
    assert metrics["num_pairs"].item() == 2.0


def test_group_advantages_leave_one_out_and_normalisation():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = losses.group_advantages(rewards, normalize=False, leave_one_out=True)
    assert adv[0].tolist() == pytest.approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3])
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    normed = losses.group_advantages(rewards, normalize=True, leave_one_out=False)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()
    assert normed[0, 0].item() == pytest.approx(0.5 / std, rel=1e-4)
    assert normed[1].abs().sum().item() == 0.0  # no signal in a uniform group


def test_grpo_loss_is_policy_gradient_at_ratio_one():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logprobs.detach().clone()
    mask = torch.ones(1, 2)
    loss, metrics = losses.grpo_loss(
        logprobs, old, torch.tensor([2.0]), mask, ratio_clip_min=0.2, ratio_clip_max=0.2
    )
    loss.backward()
    assert loss.item() == pytest.approx(-4.0)  # -(ratio 1 * advantage 2) per token
    assert logprobs.grad.tolist() == [[-2.0, -2.0]]
    assert metrics["clip_fraction_sum"].item() == 0.0


def test_grpo_loss_clips_large_ratios():
    logprobs = torch.tensor([[math.log(2.0)]], requires_grad=True)
    old = torch.zeros(1, 1)
    loss, metrics = losses.grpo_loss(
        logprobs,
        old,
        torch.tensor([1.0]),
        torch.ones(1, 1),
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)  # clipped at 1 + 0.2
    assert logprobs.grad.item() == 0.0  # no gradient through the clipped branch
    assert metrics["clip_fraction_sum"].item() == 1.0


def test_grpo_loss_ignores_padding_values_that_would_overflow():
    """Padded positions (mask 0) may hold any old/reference log-probability, e.g. the zeros of
    padding next to a policy log-probability of -200: exp(200) overflows float32, and inf * 0
    would make the loss and the gradient NaN."""
    logprobs = torch.tensor([[-1.0, -200.0]], requires_grad=True)
    padded_old = torch.tensor([[-1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, metrics = losses.grpo_loss(
        logprobs,
        padded_old,
        torch.tensor([2.0]),
        mask,
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
        reference_logprobs=torch.tensor([[-1.0, 0.0]]),
        kl_penalty=0.1,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert logprobs.grad.tolist() == [[-2.0, 0.0]]
    assert metrics["kl_sum"].item() == 0.0


def test_grpo_kl_penalty_zero_when_policy_equals_reference():
    logprobs = torch.tensor([[-1.0, -2.0]])
    loss_kl, metrics = losses.grpo_loss(
        logprobs,
        logprobs,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
        reference_logprobs=logprobs,
        kl_penalty=0.1,
    )
    assert metrics["kl_sum"].item() == 0.0
    _, shifted = losses.grpo_loss(
        logprobs,
        logprobs,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
        reference_logprobs=logprobs - 0.5,
        kl_penalty=0.1,
    )
    assert shifted["kl_sum"].item() == pytest.approx(2 * (math.exp(-0.5) + 0.5 - 1))


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_distillation_kl_zero_for_identical_and_positive_otherwise(kl_type):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    teacher = torch.log_softmax(logits, -1)
    mask = torch.ones(2, 3)
    same = losses.distillation_kl(logits, teacher, None, mask, kl_type=kl_type)
    assert same.item() == pytest.approx(0.0, abs=1e-5)
    other = losses.distillation_kl(
        logits + torch.randn(2, 3, 11), teacher, None, mask, kl_type=kl_type
    )
    assert other.item() > 1e-3


def test_distillation_forward_kl_matches_torch_on_full_vocab():
    torch.manual_seed(1)
    s_logits, t_logits = torch.randn(1, 4, 7), torch.randn(1, 4, 7)
    t = torch.log_softmax(t_logits, -1)
    ours = losses.distillation_kl(s_logits, t, None, torch.ones(1, 4), kl_type="forward")
    ref = torch.nn.functional.kl_div(
        torch.log_softmax(s_logits, -1), t, log_target=True, reduction="sum"
    )
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)


def test_distillation_topk_support_and_mask():
    torch.manual_seed(2)
    t_logits = torch.randn(1, 2, 9)
    values, indices = torch.log_softmax(t_logits, -1).topk(3, dim=-1)
    student = t_logits.clone()
    kl = losses.distillation_kl(
        student, values, indices, torch.tensor([[1.0, 0.0]]), kl_type="forward"
    )
    assert kl.item() == pytest.approx(0.0, abs=1e-5)  # same distribution on the support
    masked = losses.distillation_kl(
        torch.randn(1, 2, 9), values, indices, torch.zeros(1, 2), kl_type="reverse"
    )
    assert masked.item() == 0.0


def test_dpo_loss_leaves_masked_pairs_out():
    chosen, rejected = torch.tensor([1.0, 5.0]), torch.tensor([0.0, 9.0])
    reference = torch.zeros(2)
    one, metrics_one = losses.dpo_loss(
        chosen[:1], rejected[:1], reference[:1], reference[:1], beta=0.5
    )
    both, metrics = losses.dpo_loss(
        chosen, rejected, reference, reference, beta=0.5, weights=torch.tensor([1.0, 0.0])
    )
    assert torch.equal(both, one)
    assert metrics["num_pairs"] == 1 and metrics["preference_accuracy_sum"] == 1
    assert metrics["reward_margin_sum"] == metrics_one["reward_margin_sum"]
