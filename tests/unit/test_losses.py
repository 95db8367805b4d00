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


# --------------------------------------------------------------- GRPO's NeMo-RL loss options

CLIP = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2}


def _options(**loss_cfg) -> losses.PolicyLossOptions:
    return losses.PolicyLossOptions.from_recipe(loss_cfg)


def test_per_sequence_sum_and_mean_reduce_rows_over_their_mask():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert losses.per_sequence_sum(values, mask).tolist() == [5.0, 0.0]
    assert losses.per_sequence_mean(values, mask).tolist() == [2.5, 0.0]
    assert losses.per_token(torch.tensor([7.0, 8.0]), mask).tolist() == [[7.0] * 3, [8.0] * 3]


@pytest.mark.parametrize(
    ("kl_type", "expected"),
    [("k1", 0.5), ("k2", 0.125), ("k3", math.exp(-0.5) - 1 + 0.5)],
)
def test_kl_estimators_follow_schulman(kl_type, expected):
    policy, reference = torch.tensor([-1.0]), torch.tensor([-1.5])  # log-ratio r = -0.5
    kl = losses.kl_estimate(policy, reference, kl_type=kl_type)
    assert kl.item() == pytest.approx(expected, rel=1e-6)


def test_kl_clamps_are_active_at_nemo_rl_defaults():
    policy, reference = torch.tensor([-30.0]), torch.tensor([0.0])  # r = 30
    unclamped = losses.kl_estimate(policy, reference, input_clamp=None, output_clamp=None)
    assert unclamped.item() == pytest.approx(math.exp(30) - 31, rel=1e-5)
    input_only = losses.kl_estimate(policy, reference, input_clamp=20.0, output_clamp=None)
    assert input_only.item() == pytest.approx(math.exp(20) - 21, rel=1e-5)
    assert losses.kl_estimate(policy, reference).item() == 10.0  # both defaults
    k1 = losses.kl_estimate(torch.tensor([0.0]), torch.tensor([-15.0]), kl_type="k1")
    assert k1.item() == 10.0  # k1 = 15 cut at the output clamp
    # A recipe's values reach the loss: a far reference costs the output clamp per token.
    logprobs = torch.tensor([[-30.0, -30.0]])
    kwargs = dict(reference_logprobs=torch.zeros(1, 2), kl_penalty=0.1, **CLIP)
    _, at_default = losses.grpo_loss(logprobs, logprobs, torch.zeros(1), torch.ones(1, 2), **kwargs)
    assert at_default["kl_sum"].item() == 20.0
    options = _options(kl_input_clamp_value=None, kl_output_clamp_value=5.0)
    _, lowered = losses.grpo_loss(
        logprobs, logprobs, torch.zeros(1), torch.ones(1, 2), options=options, **kwargs
    )
    assert lowered["kl_sum"].item() == 10.0


def test_kl_type_option_reaches_the_loss():
    logprobs, reference = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    kwargs = dict(reference_logprobs=reference, kl_penalty=1.0, **CLIP)
    sums = {
        kl_type: losses.grpo_loss(
            logprobs,
            logprobs,
            torch.zeros(1),
            torch.ones(1, 1),
            options=_options(reference_policy_kl_type=kl_type),
            **kwargs,
        )[1]["kl_sum"].item()
        for kl_type in ("k1", "k2", "k3")
    }
    assert sums == pytest.approx({"k1": 0.5, "k2": 0.125, "k3": math.exp(-0.5) - 0.5})


def test_kl_gradient_has_the_score_function_term_and_the_on_policy_weight():
    """NeMo-RL weighs the KL by exp(logp - sg(logp)): 1, whose derivative adds the estimate
    itself (samples come from the policy). With use_on_policy_kl_approximation the weight is
    policy / sampler."""
    reference, advantage, mask = torch.tensor([[-1.5]]), torch.zeros(1), torch.ones(1, 1)
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    loss, _ = losses.grpo_loss(
        logprobs,
        logprobs.detach(),
        advantage,
        mask,
        reference_logprobs=reference,
        kl_penalty=1.0,
        **CLIP,
    )
    loss.backward()
    r = -0.5
    k3, dk3 = math.exp(r) - 1 - r, 1 - math.exp(r)  # dk3/dlogp
    assert loss.item() == pytest.approx(k3, rel=1e-6)
    assert logprobs.grad.item() == pytest.approx(k3 + dk3, rel=1e-5)

    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    generation = torch.tensor([[-1.2]])
    loss, metrics = losses.grpo_loss(
        logprobs,
        logprobs.detach(),
        advantage,
        mask,
        reference_logprobs=reference,
        kl_penalty=1.0,
        options=_options(use_on_policy_kl_approximation=True),
        generation_logprobs=generation,
        **CLIP,
    )
    weight = math.exp(0.2)
    assert metrics["kl_sum"].item() == pytest.approx(weight * k3, rel=1e-5)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(weight * (k3 + dk3), rel=1e-5)


def test_importance_sampling_correction_weighs_tokens_by_training_over_sampler():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]])
    generation = torch.tensor([[-1.5, -2.0]])  # weights exp(0.5), 1
    args = (logprobs, old, torch.tensor([1.0]), torch.ones(1, 2))
    plain, metrics = losses.grpo_loss(*args, generation_logprobs=generation, **CLIP)
    assert plain.item() == pytest.approx(-2.0)
    assert metrics["sampling_importance_ratio_sum"].item() == pytest.approx(math.exp(0.5) + 1)
    assert metrics["token_mult_prob_error_sum"].item() == pytest.approx(math.exp(0.5) + 1)
    corrected, _ = losses.grpo_loss(
        *args,
        generation_logprobs=generation,
        options=_options(use_importance_sampling_correction=True),
        **CLIP,
    )
    assert corrected.item() == pytest.approx(-(math.exp(0.5) + 1), rel=1e-6)


@pytest.mark.parametrize(
    ("tis", "expected_weights", "oob"),
    [
        (
            {
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 1.5,
            },
            [1.5, 1.0, math.exp(-1.0)],
            1,
        ),
        (
            {
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 1.5,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            [1.5, 1.0, 0.5],
            2,
        ),
        (
            {
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 1.5,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            [0.0, 1.0, 0.0],
            2,
        ),
    ],
)
def test_truncated_importance_sampling_types(tis, expected_weights, oob):
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    generation = torch.tensor([[-2.0, -1.0, 0.0]])  # raw weights e, 1, 1/e
    options = _options(use_importance_sampling_correction=True, **tis)
    loss, metrics = losses.grpo_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([1.0]),
        torch.ones(1, 3),
        generation_logprobs=generation,
        options=options,
        **CLIP,
    )
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-w for w in expected_weights], rel=1e-5)
    assert metrics["is_oob_sum"].item() == oob


def test_seq_mask_tis_drops_whole_sequences_by_their_geometric_mean_ratio():
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    generation = torch.tensor([[-1.1, -0.9], [-2.0, -2.0]])  # geometric means 1 and e
    options = _options(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.5,
    )
    loss, metrics = losses.grpo_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([1.0, 1.0]),
        torch.ones(2, 2),
        generation_logprobs=generation,
        options=options,
        **CLIP,
    )
    loss.backward()
    kept = [-math.exp(0.1), -math.exp(-0.1)]  # untruncated token weights of the kept row
    assert logprobs.grad[0].tolist() == pytest.approx(kept, rel=1e-5)
    assert logprobs.grad[1].tolist() == [0.0, 0.0]
    assert metrics["is_oob_seqsum"].item() == 1.0


def test_gspo_clips_one_ratio_per_sequence_and_averages_sequences():
    """A sequence whose tokens' log-ratios are +0.5 and -0.5 has GSPO ratio 1 (nothing
    clipped), where token ratios would clip one token; the loss is a sum of per-sequence
    means and the step counts sequences."""
    spec = {
        "name": "grpo",
        **CLIP,
        "loss_fn": {"sequence_level_importance_ratios": True, "token_level_loss": False},
    }
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    logprobs = torch.tensor([[-0.5, -1.5, -1.0], [-1.0, -1.0, 0.0]], requires_grad=True)
    batch = {
        "loss_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        "old_logprobs": old,
        "advantages": torch.tensor([1.0, 2.0]),
    }
    loss, count, metrics = losses.make_loss_fn(spec)(batch, -logprobs)
    assert count.item() == 2  # sequences
    assert loss.item() == pytest.approx(-1.0 - 2.0)  # per-sequence means of -ratio * adv
    assert metrics["clip_fraction_sum"].item() == 0.0
    loss.backward()
    # d/dlogp of -adv * exp(mean log-ratio): -adv / (tokens of the sequence), on every token.
    expected = torch.tensor([[-0.5, -0.5, 0.0], [-2 / 3] * 3])
    torch.testing.assert_close(logprobs.grad, expected)
    token_spec = {"name": "grpo", **CLIP}
    _, _, token_metrics = losses.make_loss_fn(token_spec)(batch, -logprobs.detach())
    assert token_metrics["clip_fraction_sum"].item() == 2.0


def test_token_level_loss_false_averages_each_sequence_first():
    spec = {"name": "grpo", **CLIP, "loss_fn": {"token_level_loss": False}}
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])
    batch = {
        "loss_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
        "old_logprobs": logprobs,
        "advantages": torch.tensor([1.0, 3.0]),
    }
    loss, count, _ = losses.make_loss_fn(spec)(batch, -logprobs)
    assert (loss.item(), int(count)) == (pytest.approx(-4.0), 2)  # (-1 - 3) over 2 sequences
    token_loss, token_count, _ = losses.make_loss_fn({"name": "grpo", **CLIP})(batch, -logprobs)
    assert (token_loss.item(), int(token_count)) == (pytest.approx(-6.0), 4)


def test_disable_ppo_ratio_is_reinforce():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    far_old = torch.tensor([[-9.0, 3.0]])  # no ratio is formed, so no clipping either
    loss, metrics = losses.grpo_loss(
        logprobs,
        far_old,
        torch.tensor([2.0]),
        torch.ones(1, 2),
        options=_options(disable_ppo_ratio=True),
        **CLIP,
    )
    loss.backward()
    assert loss.item() == pytest.approx(6.0)  # -2 * (-1 - 2)
    assert logprobs.grad.tolist() == [[-2.0, -2.0]]
    assert metrics["clip_fraction_sum"].item() == 0.0


def test_force_on_policy_ratio_ignores_old_logprobs():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    options = _options(force_on_policy_ratio=True)
    loss, _ = losses.grpo_loss(
        logprobs, None, torch.tensor([2.0]), torch.ones(1, 2), options=options, **CLIP
    )
    loss.backward()
    assert loss.item() == pytest.approx(-4.0)
    assert logprobs.grad.tolist() == [[-2.0, -2.0]]
    with pytest.raises(ValueError):
        losses.grpo_loss(logprobs, None, torch.tensor([2.0]), torch.ones(1, 2), **CLIP)


def test_cispo_weighs_the_logprob_by_the_detached_clipped_ratio():
    logprobs = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    old = torch.zeros(1, 2)  # ratios 2 and 0.5, clipped to 1.2 and 0.8
    loss, _ = losses.grpo_loss(
        logprobs,
        old,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        options=_options(use_cispo=True),
        **CLIP,
    )
    loss.backward()
    expected = -(1.2 * math.log(2.0) + 0.8 * math.log(0.5))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # Not 0 where the ratio is clipped, unlike PPO's clipped branch.
    assert logprobs.grad[0].tolist() == pytest.approx([-1.2, -0.8], rel=1e-6)


def test_positive_example_nll_adds_the_nll_of_rewarded_sequences():
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    base = dict(advantages=torch.zeros(2), mask=torch.ones(2, 2), **CLIP)
    off, _ = losses.grpo_loss(logprobs, logprobs, **base)
    on, metrics = losses.grpo_loss(
        logprobs,
        logprobs,
        options=_options(positive_example_nll_weight=0.1),
        rewards=torch.tensor([1.0, 0.0]),
        nll_scale=2.0,
        **base,
    )
    assert metrics["positive_nll_sum"].item() == pytest.approx(3.0)  # the first row only
    assert (on - off).item() == pytest.approx(0.1 * 2.0 * 3.0)


def test_effective_kl_penalty_is_zero_with_kl_in_reward():
    assert losses.effective_kl_penalty({"reference_policy_kl_penalty": 0.05}) == 0.05
    cfg = {"reference_policy_kl_penalty": 0.05, "use_kl_in_reward": True}
    assert losses.effective_kl_penalty(cfg) == 0.0


def test_grpo_metric_means_divide_by_tokens_or_sequences():
    metrics = {
        "loss": 1.0,
        "response_tokens_sum": 4.0,
        "sequences_seqsum": 2.0,
        "kl_sum": 2.0,
        "sampling_importance_ratio_seqsum": 3.0,
        "positive_nll_sum": 1.0,
    }
    means = losses.grpo_metric_means(metrics)
    assert means == {"kl": 0.5, "sampling_importance_ratio": 1.5}
    assert metrics == {"loss": 1.0, "positive_nll_sum": 1.0}


@pytest.mark.parametrize("token_level", [True, False])
def test_grpo_normalisation_is_exact_across_micro_batches(token_level):
    """NeMo-RL divides by the global count of tokens (or of sequences without token_level_loss);
    the sums and counts of two micro-batches give the same step loss as one batch."""
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 6, generator=g)
    batch = {
        "loss_mask": torch.tensor(
            [[1.0] * 6, [1.0] * 2 + [0.0] * 4, [0.0] * 6, [1.0] * 4 + [0.0] * 2]
        ),
        "old_logprobs": logprobs + 0.1 * torch.randn(4, 6, generator=g),
        "advantages": torch.tensor([1.0, -2.0, 0.5, 3.0]),
    }
    spec = {"name": "grpo", **CLIP, "loss_fn": {"token_level_loss": token_level}}
    fn = losses.make_loss_fn(spec)
    whole, count, _ = fn(batch, -logprobs)
    parts = [
        fn({k: v[rows] for k, v in batch.items()}, -logprobs[rows])
        for rows in (slice(0, 1), slice(1, 4))
    ]
    total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert total.item() == pytest.approx((whole / count).item(), rel=1e-6)
    assert int(count) == (3 if not token_level else 12)
