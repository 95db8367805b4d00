"""The losses of SFT, DPO, GRPO and on-policy distillation, as plain tensor functions.

Every loss takes token log-probabilities aligned with a ``mask`` of the tokens that count
(response tokens), both shaped [batch, seq]: position t holds log p(token t+1 | tokens <= t).
Token-level losses return a *sum* and a token count, so that gradient accumulation over
micro-batches and data-parallel workers can divide once by the global count and stay exact.
Sequence-level losses (DPO) return a sum over sequences and a sequence count for the same reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SFT: negative log-likelihood of the response tokens (sum, token count)."""
    return -masked_sum(logprobs, mask), mask.sum()


def sequence_logprobs(
    logprobs: torch.Tensor, mask: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Per-sequence log-probability of the masked tokens (their mean when ``average``)."""
    total = (logprobs * mask).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1) if average else total


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's sigmoid loss on per-sequence log-probabilities; returns (sum over pairs, metrics).

    Preference accuracy counts pairs whose implicit reward margin is positive. ``weights`` (one
    per pair, 0 or 1: NeMo-RL's sample mask) leaves masked pairs out of the loss, the metrics
    and the pair count."""
    chosen_reward = beta * (chosen - reference_chosen)
    rejected_reward = beta * (rejected - reference_rejected)
    margin = chosen_reward - rejected_reward
    if weights is None:
        weights = torch.ones_like(margin)
    loss = -(F.logsigmoid(margin) * weights).sum()
    metrics = {
        "preference_accuracy_sum": ((margin > 0).float() * weights).sum(),
        "reward_margin_sum": (margin.detach() * weights).sum(),
        "num_pairs": weights.sum().detach(),
    }
    return loss, metrics


def group_advantages(
    rewards: torch.Tensor, *, normalize: bool = True, leave_one_out: bool = True
) -> torch.Tensor:
    """GRPO's advantages for rewards shaped [prompts, generations per prompt].

    The baseline is the group mean (excluding the sample itself with ``leave_one_out``); with
    ``normalize`` the advantage is divided by the group's standard deviation. A group whose
    rewards are all equal carries no signal and gets advantage 0."""
    group_size = rewards.shape[-1]
    if leave_one_out and group_size > 1:
        baseline = (rewards.sum(dim=-1, keepdim=True) - rewards) / (group_size - 1)
    else:
        baseline = rewards.mean(dim=-1, keepdim=True)
    advantages = rewards - baseline
    if normalize:
        std = rewards.std(dim=-1, keepdim=True, unbiased=group_size > 1)
        advantages = torch.where(std > 1e-6, advantages / (std + 1e-6), torch.zeros_like(std))
    return advantages


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy: non-negative,
    unbiased, low variance (Schulman's k3)."""
    log_ratio = reference_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_clip_min: float,
    ratio_clip_max: float,
    ratio_clip_c: float | None = None,
    reference_logprobs: torch.Tensor | None = None,
    kl_penalty: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped-ratio policy-gradient loss plus an optional KL penalty to the reference.

    ``advantages`` is per sequence ([batch]) and broadcast over its tokens, or already per token
    ([batch, seq], a packed row holding several sequences). Returns the sum over
    masked tokens and metrics (sums, to be divided by the token count once). Padded positions
    hold arbitrary old and reference log-probabilities; they are replaced by the policy's own
    there, so their ratio is 1 and their KL 0: an overflowing exp would turn the masked sum and
    its gradient into NaN (inf * 0)."""
    keep = mask > 0
    old_logprobs = torch.where(keep, old_logprobs, logprobs.detach())
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages if advantages.dim() == logprobs.dim() else advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - ratio_clip_min, 1 + ratio_clip_max) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if ratio_clip_c is not None:
        # Dual clip: bound the loss of negative advantages when the ratio explodes.
        per_token = torch.where(adv < 0, torch.minimum(per_token, -ratio_clip_c * adv), per_token)
    metrics = {"clip_fraction_sum": masked_sum((unclipped != clipped).float(), mask).detach()}
    if reference_logprobs is not None and kl_penalty:
        reference_logprobs = torch.where(keep, reference_logprobs, logprobs.detach())
        kl = kl_k3(logprobs, reference_logprobs)
        per_token = per_token + kl_penalty * kl
        metrics["kl_sum"] = masked_sum(kl, mask).detach()
    return masked_sum(per_token, mask), metrics


def distillation_kl(
    student_logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_indices: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    kl_type: str,
    mixed_kl_weight: float = 0.5,
) -> torch.Tensor:
    """Sum over masked tokens of KL between teacher and student next-token distributions.

    ``teacher_logprobs`` is [batch, seq, k] over the teacher's top-k tokens ``teacher_indices``
    (or [batch, seq, vocab] with indices None). Both distributions are renormalised on that
    support, so the KL is exact for k = vocab and a proper KL of the truncated distributions
    otherwise. ``forward`` is KL(teacher || student), ``reverse`` KL(student || teacher), and
    ``mixed`` weighs forward by ``mixed_kl_weight``."""
    student = torch.log_softmax(student_logits.float(), dim=-1)
    if teacher_indices is not None:
        student = student.gather(-1, teacher_indices)
    student = student - torch.logsumexp(student, dim=-1, keepdim=True)
    teacher = teacher_logprobs.float()
    teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    forward = (teacher.exp() * (teacher - student)).sum(-1)
    reverse = (student.exp() * (student - teacher)).sum(-1)
    if kl_type == "forward":
        per_token = forward
    elif kl_type == "reverse":
        per_token = reverse
    elif kl_type == "mixed":
        per_token = mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse
    else:
        raise ValueError(f"unknown kl_type {kl_type!r}")
    return masked_sum(per_token, mask)


# ------------------------------------------------------------------ micro-batch loss functions
# Adapters between the losses above and the training step's contract
# (models.train_step: loss_fn(batch, output) -> (summed loss, count, metric sums)). ``output``
# is the model's per-token loss, i.e. minus the log-probability of each label, unless the loss
# needs the whole distribution (distillation), in which case the batch has no labels and
# ``output`` holds the logits.

LOSS_NAMES = ("nll", "dpo", "grpo", "distillation")


def _nll_fn(spec: dict, batch: dict, output: torch.Tensor):
    total, count = nll_loss(-output.float(), batch["loss_mask"])
    return total, count, {"nll_sum": total.detach()}


def _dpo_fn(spec: dict, batch: dict, output: torch.Tensor):
    mask = batch["loss_mask"]
    average = bool(spec.get("preference_average_log_probs", False))
    per_sequence = sequence_logprobs(-output.float(), mask, average=average)
    reference = batch["reference_sequence_logprobs"]
    # A pair cut by data.max_input_seq_length has loss multiplier 0: no token of it counts,
    # and it is no pair of the loss (every real response has at least its end token).
    weights = (mask[0::2].sum(dim=-1) > 0).to(per_sequence.dtype)
    loss, metrics = dpo_loss(
        per_sequence[0::2],
        per_sequence[1::2],
        reference[0::2],
        reference[1::2],
        beta=float(spec["beta"]),
        weights=weights,
    )
    loss = float(spec.get("preference_loss_weight", 1.0)) * loss
    sft_weight = float(spec.get("sft_loss_weight", 0.0))
    if sft_weight:
        chosen = sequence_logprobs(
            -output.float()[0::2], mask[0::2], average=bool(spec.get("sft_average_log_probs"))
        )
        loss = loss - sft_weight * chosen.sum()
    return loss, metrics["num_pairs"], metrics


def _grpo_fn(spec: dict, batch: dict, output: torch.Tensor):
    mask = batch["loss_mask"]
    loss, metrics = grpo_loss(
        -output.float(),
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        ratio_clip_min=float(spec["ratio_clip_min"]),
        ratio_clip_max=float(spec["ratio_clip_max"]),
        ratio_clip_c=spec.get("ratio_clip_c"),
        reference_logprobs=batch.get("reference_logprobs"),
        kl_penalty=float(spec.get("kl_penalty", 0.0)),
    )
    return loss, mask.sum(), metrics


def _distillation_fn(spec: dict, batch: dict, output: torch.Tensor):
    from megatron.core import parallel_state, tensor_parallel

    logits = output
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    logits = logits[..., : int(spec["vocab_size"])]
    mask = batch["loss_mask"]
    loss = distillation_kl(
        logits,
        batch["teacher_logprobs"],
        batch.get("teacher_indices"),
        mask,
        kl_type=str(spec["kl_type"]),
        mixed_kl_weight=float(spec.get("mixed_kl_weight", 0.5)),
    )
    return loss, mask.sum(), {"kl_sum": loss.detach()}


_ADAPTERS = {"nll": _nll_fn, "dpo": _dpo_fn, "grpo": _grpo_fn, "distillation": _distillation_fn}


def make_loss_fn(spec: dict):
    """The micro-batch loss function named by ``spec["name"]`` with the settings in ``spec``."""
    try:
        adapter = _ADAPTERS[spec["name"]]
    except KeyError:
        raise ValueError(f"unknown loss {spec.get('name')!r}; one of {LOSS_NAMES}") from None

    def loss_fn(batch: dict, output: torch.Tensor):
        return adapter(spec, batch, output)

    return loss_fn
