"""The losses of SFT, DPO, GRPO and on-policy distillation, as plain tensor functions.

Every loss takes token log-probabilities aligned with a ``mask`` of the tokens that count
(response tokens), both shaped [batch, seq]: position t holds log p(token t+1 | tokens <= t).
Token-level losses return a *sum* and a token count, so that gradient accumulation over
micro-batches and data-parallel workers can divide once by the global count and stay exact.
Sequence-level losses (DPO, and GRPO with ``token_level_loss`` false, which averages each
sequence's tokens first) return a sum over sequences and a sequence count for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_rl_offload.config.schema import KL_TYPES, TRUNCATED_IS_TYPES


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SFT: negative log-likelihood of the response tokens (sum, token count)."""
    return -masked_sum(logprobs, mask), mask.sum()


def sequence_logprobs(
    logprobs: torch.Tensor, mask: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Per-sequence log-probability of the masked tokens (their mean when ``average``)."""
    if average:
        return per_sequence_mean(logprobs, mask)
    return per_sequence_sum(logprobs, mask)


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


def sequence_index(mask: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, seq]: the index of each position's sequence within the micro-batch, -1 for a
    position of no sequence. Without ``segments`` a row is one sequence; a packed row holds
    several (``segment_ids``, per row from 0, -1 on padding) and its sequences are numbered
    after the previous rows'."""
    if segments is None:
        rows = torch.arange(mask.shape[0], device=mask.device)
        return rows.unsqueeze(-1).expand(mask.shape)
    segments = segments.to(device=mask.device, dtype=torch.long)
    per_row = segments.max(dim=-1).values.clamp(min=-1) + 1
    offsets = torch.cumsum(per_row, 0) - per_row
    return torch.where(segments >= 0, segments + offsets.unsqueeze(-1), -1)


def per_sequence_sum(
    values: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum of each sequence's masked token values, [sequences].

    Every reduction of token values to one value per sequence goes through here (GSPO's
    sequence ratio, per-sequence loss averaging, the sequence log-probability error), together
    with :func:`per_token` for the way back, so that packed rows (``segments``, see
    :func:`sequence_index`) reduce per sequence, not per row."""
    if segments is None:
        return (values * mask).sum(dim=-1)
    index = sequence_index(mask, segments)
    live = index >= 0
    count = int(index.max().item()) + 1 if bool(live.any()) else 0
    out = torch.zeros(count, dtype=values.dtype, device=values.device)
    return out.index_add(0, index[live], (values * mask)[live])


def per_token(
    per_sequence: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """Each sequence's value on every position of that sequence, [rows, seq] (0 on positions of
    no sequence): the way back from :func:`per_sequence_sum`. A value already per token (a
    packed micro-batch's advantages) is returned as it is."""
    if per_sequence.dim() == mask.dim():
        return per_sequence
    if segments is None:
        return per_sequence.unsqueeze(-1).expand(mask.shape)
    index = sequence_index(mask, segments)
    spread = per_sequence[index.clamp(min=0)]
    return torch.where(index >= 0, spread, torch.zeros_like(spread))


def per_sequence_mean(
    values: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of each sequence's masked token values, [sequences] (0 for one without any)."""
    tokens = per_sequence_sum(torch.ones_like(values), mask, segments)
    return per_sequence_sum(values, mask, segments) / tokens.clamp(min=1)


def kl_estimate(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    *,
    kl_type: str = "k3",
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's
    k1, k2 or k3 of the log-ratio r = reference - policy), with NeMo-RL's two clamps.

    ``input_clamp`` bounds r (exp(r) of a token the reference finds far likelier would
    otherwise dominate the step), ``output_clamp`` the weighted estimate; both are active at
    NeMo-RL's defaults. ``weights`` multiply the estimate before the output clamp; where the
    input clamp cut r, the weight's gradient is cut too, so a clamped token adds no gradient."""
    log_ratio = reference_logprobs - logprobs
    if input_clamp is not None:
        clamped = log_ratio.clamp(min=-input_clamp, max=input_clamp)
        if weights is not None:
            weights = torch.where(log_ratio == clamped, weights, weights.detach())
        log_ratio = clamped
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(log_ratio) - 1 - log_ratio
    else:
        raise ValueError(f"unknown kl_type {kl_type!r}; one of {KL_TYPES}")
    if weights is not None:
        kl = weights * kl
    if output_clamp is not None:
        kl = kl.clamp(min=-output_clamp, max=output_clamp)
    return kl


def _finite(values: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class PolicyLossOptions:
    """NeMo-RL's ``loss_fn`` options of the clipped policy-gradient loss, at its defaults.

    ``token_level_loss`` false averages each sequence's tokens first, then the sequences (the
    step then counts sequences, not tokens). ``sequence_level_importance_ratios`` is GSPO: one
    ratio per sequence, the exponential of its mean token log-ratio. ``disable_ppo_ratio`` is
    REINFORCE (the surrogate is the log-probability itself), ``force_on_policy_ratio`` a
    ratio of exactly 1 that keeps its gradient (one update per rollout), ``use_cispo`` CISPO
    (the clipped ratio as a detached weight of the log-probability). The importance-sampling
    options weigh each token (or sequence) by how much likelier the training-time policy finds
    it than the sampler did, and truncate those weights. ``positive_example_nll_weight`` adds
    VAPO's NLL of the responses with a positive reward."""

    kl_type: str = "k3"
    kl_input_clamp: float | None = 20.0
    kl_output_clamp: float | None = 10.0
    on_policy_kl_approximation: bool = False
    importance_sampling_correction: bool = False
    truncated_is_type: str | None = None
    truncated_is_ratio: float | None = None
    truncated_is_ratio_min: float | None = None
    sequence_level_ratios: bool = False
    token_level_loss: bool = True
    disable_ppo_ratio: bool = False
    force_on_policy_ratio: bool = False
    cispo: bool = False
    positive_example_nll_weight: float = 0.0

    @classmethod
    def from_recipe(cls, loss_cfg: dict) -> PolicyLossOptions:
        """The options a recipe's ``loss_fn`` section sets (absent keys: NeMo-RL's defaults)."""

        def number(key: str, default: float | None) -> float | None:
            value = loss_cfg.get(key, default)
            return None if value is None else float(value)

        return cls(
            kl_type=str(loss_cfg.get("reference_policy_kl_type") or "k3"),
            kl_input_clamp=number("kl_input_clamp_value", 20.0),
            kl_output_clamp=number("kl_output_clamp_value", 10.0),
            on_policy_kl_approximation=bool(loss_cfg.get("use_on_policy_kl_approximation")),
            importance_sampling_correction=bool(loss_cfg.get("use_importance_sampling_correction")),
            truncated_is_type=loss_cfg.get("truncated_importance_sampling_type"),
            truncated_is_ratio=number("truncated_importance_sampling_ratio", None),
            truncated_is_ratio_min=number("truncated_importance_sampling_ratio_min", None),
            sequence_level_ratios=bool(loss_cfg.get("sequence_level_importance_ratios")),
            token_level_loss=bool(loss_cfg.get("token_level_loss", True)),
            disable_ppo_ratio=bool(loss_cfg.get("disable_ppo_ratio")),
            force_on_policy_ratio=bool(loss_cfg.get("force_on_policy_ratio")),
            cispo=bool(loss_cfg.get("use_cispo")),
            positive_example_nll_weight=float(loss_cfg.get("positive_example_nll_weight") or 0.0),
        )

    @property
    def needs_old_logprobs(self) -> bool:
        """A forced ratio of 1 reads no training-time log-probabilities (NeMo-RL skips them)."""
        return not self.force_on_policy_ratio


def effective_kl_penalty(loss_cfg: dict) -> float:
    """The KL coefficient of GRPO's loss: NeMo-RL drops it from the loss with
    ``use_kl_in_reward``, and GRPO's advantage estimator (the only one here) does not put it
    into the reward either, so that switch turns the KL penalty off."""
    if loss_cfg.get("use_kl_in_reward"):
        return 0.0
    return float(loss_cfg.get("reference_policy_kl_penalty", 0.0))


def _importance_weights(
    old: torch.Tensor,
    generation: torch.Tensor,
    mask: torch.Tensor,
    o: PolicyLossOptions,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights exp(old - generation) (per sequence under GSPO: the exponential of
    the sequence's summed log-ratio), truncated as ``o`` says, and their metric sums."""
    log_ratio = old - generation
    if o.sequence_level_ratios:
        weights = per_token(torch.exp(per_sequence_sum(log_ratio, mask, segments)), mask, segments)
    else:
        weights = torch.exp(log_ratio)
    weights = _finite(weights).detach()
    metrics: dict[str, torch.Tensor] = {}
    if o.truncated_is_ratio is None:
        return weights, metrics
    high = o.truncated_is_ratio
    if o.truncated_is_type == "tis":
        low = o.truncated_is_ratio_min if o.truncated_is_ratio_min is not None else 0.0
        out = (weights > high) | (weights < low)
        metrics["is_oob_sum"] = masked_sum(out.float(), mask)
        weights = weights.clamp(min=low, max=high)
    elif o.truncated_is_type == "icepop":
        kept = (weights >= o.truncated_is_ratio_min) & (weights <= high)
        metrics["is_oob_sum"] = masked_sum((~kept).float(), mask)
        weights = torch.where(kept, weights, torch.zeros_like(weights))
    elif o.truncated_is_type == "seq-mask-tis":
        geometric = torch.exp(per_sequence_mean(_finite(log_ratio), mask, segments))
        kept = ((geometric >= o.truncated_is_ratio_min) & (geometric <= high)).float()
        live = (per_sequence_sum(torch.ones_like(mask), mask, segments) > 0).float()
        metrics["is_oob_seqsum"] = ((1 - kept) * live).sum()
        weights = weights * per_token(kept, mask, segments)
    else:
        raise ValueError(
            f"unknown truncated_importance_sampling_type {o.truncated_is_type!r}; "
            f"one of {TRUNCATED_IS_TYPES}"
        )
    return weights, metrics


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_clip_min: float,
    ratio_clip_max: float,
    ratio_clip_c: float | None = None,
    reference_logprobs: torch.Tensor | None = None,
    kl_penalty: float = 0.0,
    options: PolicyLossOptions | None = None,
    generation_logprobs: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    nll_scale: float = 1.0,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped-ratio policy-gradient loss plus an optional KL penalty to the reference
    (NeMo-RL's ClippedPGLoss with ``options``).

    ``advantages`` is per sequence ([batch]) and broadcast over its tokens, or already per
    token (a packed micro-batch, whose rows hold the sequences that ``segments`` mark: see
    :func:`sequence_index`; every per-sequence value is then per packed sequence). Returns the loss
    summed over masked tokens (over sequences of per-sequence means when
    ``options.token_level_loss`` is false) and metrics (sums, see :func:`grpo_metric_means`).
    Padded positions hold arbitrary old, generation and reference log-probabilities; they are
    replaced by the policy's own there, so their ratios are 1 and their KL 0: an overflowing
    exp would turn the masked sum and its gradient into NaN (inf * 0).

    ``generation_logprobs`` are the sampler's log-probabilities of the tokens (importance
    sampling, the on-policy KL approximation, and their error metrics); ``rewards`` ([batch])
    pick the positive examples of ``options.positive_example_nll_weight``, whose NLL sum is
    multiplied by ``nll_scale`` (the step's count over its positive tokens, so that the term is
    a mean over the step's positive tokens after the step divides by its count)."""
    o = options or PolicyLossOptions()
    keep = mask > 0
    own = logprobs.detach()
    if o.force_on_policy_ratio or old_logprobs is None:
        if not o.force_on_policy_ratio:
            raise ValueError("grpo_loss needs old_logprobs unless force_on_policy_ratio")
        old = own
    else:
        old = torch.where(keep, old_logprobs, own)
    generation = None
    if generation_logprobs is not None:
        generation = torch.where(keep, generation_logprobs, old)
    adv = per_token(advantages, mask, segments)

    if o.force_on_policy_ratio:
        ratio = torch.exp(logprobs - own)  # 1, with the policy gradient's derivative
        clipped_ratio = ratio
    elif o.disable_ppo_ratio:
        ratio = clipped_ratio = logprobs  # REINFORCE: -advantage * log-probability
    else:
        log_ratio = logprobs - old
        if o.sequence_level_ratios:
            ratio = per_token(
                torch.exp(per_sequence_mean(log_ratio, mask, segments)), mask, segments
            )
        else:
            ratio = torch.exp(log_ratio)
        clipped_ratio = ratio.clamp(1 - ratio_clip_min, 1 + ratio_clip_max)
    if o.cispo:
        per_tok = -adv * clipped_ratio.detach() * logprobs
    else:
        per_tok = torch.maximum(-adv * ratio, -adv * clipped_ratio)
    if ratio_clip_c is not None:
        # Dual clip: bound the loss of negative advantages when the ratio explodes.
        per_tok = torch.where(adv < 0, torch.minimum(per_tok, -ratio_clip_c * adv), per_tok)

    ones = torch.ones_like(own)
    metrics: dict[str, torch.Tensor] = {
        "clip_fraction_sum": masked_sum((ratio != clipped_ratio).float(), mask).detach(),
        "response_tokens_sum": mask.sum().detach(),
        "sequences_seqsum": (per_sequence_sum(ones, mask, segments) > 0).float().sum(),
    }
    if generation is not None:
        weights, is_metrics = _importance_weights(old, generation, mask, o, segments)
        metrics.update(is_metrics)
        error = torch.exp((generation - old).abs() * mask)
        metrics["token_mult_prob_error_sum"] = masked_sum(error, mask)
        if o.sequence_level_ratios:
            per_sequence = per_sequence_mean(weights, mask, segments)  # one value per sequence
            metrics["sampling_importance_ratio_seqsum"] = per_sequence.sum()
        else:
            metrics["sampling_importance_ratio_sum"] = masked_sum(weights, mask)
        if o.importance_sampling_correction:
            per_tok = weights * per_tok
    elif o.importance_sampling_correction or o.on_policy_kl_approximation:
        raise ValueError("grpo_loss needs generation_logprobs for these options")

    def reduce(values: torch.Tensor) -> torch.Tensor:
        if o.token_level_loss:
            return masked_sum(values, mask)
        return per_sequence_mean(values, mask, segments).sum()

    loss = reduce(per_tok)
    if reference_logprobs is not None and kl_penalty:
        reference = torch.where(keep, reference_logprobs, own)
        if o.on_policy_kl_approximation:
            # The tokens were drawn by the sampler: weigh the estimate by policy / sampler.
            kl_weights = torch.exp(logprobs - generation)
        else:
            # 1, but with the score-function derivative of sampling from the policy.
            kl_weights = torch.exp(logprobs - own)
        kl = kl_estimate(
            logprobs,
            reference,
            kl_type=o.kl_type,
            input_clamp=o.kl_input_clamp,
            output_clamp=o.kl_output_clamp,
            weights=_finite(kl_weights),
        )
        loss = loss + kl_penalty * reduce(kl)
        metrics["kl_sum"] = masked_sum(kl, mask).detach()
    if o.positive_example_nll_weight > 0 and rewards is not None:
        positive = mask * per_token((rewards > 0).to(mask.dtype), mask, segments)
        nll = -masked_sum(logprobs, positive)
        loss = loss + o.positive_example_nll_weight * nll_scale * nll
        metrics["positive_nll_sum"] = nll.detach()
    metrics = {name: value.detach() for name, value in metrics.items()}
    return loss, metrics


def grpo_metric_means(metrics: dict[str, float]) -> dict[str, float]:
    """Pop GRPO's metric sums from a step's summed metrics and return their means: ``*_sum``
    per response token, ``*_seqsum`` per sequence (whatever count the loss was divided by)."""
    tokens = max(metrics.pop("response_tokens_sum", 0.0), 1.0)
    sequences = max(metrics.pop("sequences_seqsum", 0.0), 1.0)
    means: dict[str, float] = {}
    for key in [k for k in metrics if k.endswith(("_sum", "_seqsum"))]:
        if key == "positive_nll_sum":
            continue  # per positive token: the caller knows that count
        if key.endswith("_seqsum"):
            means[key.removesuffix("_seqsum")] = metrics.pop(key) / sequences
        else:
            means[key.removesuffix("_sum")] = metrics.pop(key) / tokens
    return means


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
# (policy.train_step: loss_fn(batch, output) -> (summed loss, count, metric sums)). ``output``
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
    options = PolicyLossOptions.from_recipe(spec.get("loss_fn") or {})
    scale = batch.get("positive_nll_scale")
    loss, metrics = grpo_loss(
        -output.float(),
        batch.get("old_logprobs"),
        batch["advantages"],
        mask,
        ratio_clip_min=float(spec["ratio_clip_min"]),
        ratio_clip_max=float(spec["ratio_clip_max"]),
        ratio_clip_c=spec.get("ratio_clip_c"),
        reference_logprobs=batch.get("reference_logprobs"),
        kl_penalty=float(spec.get("kl_penalty", 0.0)),
        options=options,
        generation_logprobs=batch.get("generation_logprobs"),
        rewards=batch.get("rewards"),
        # one value for the whole step, repeated on every row (or sequence position of a pack)
        nll_scale=1.0 if scale is None else float(scale.max()),
        segments=batch.get("segment_ids"),
    )
    # The step divides by this count: tokens, or sequences for per-sequence averaging.
    count = mask.sum() if options.token_level_loss else metrics["sequences_seqsum"]
    return loss, count, metrics


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
