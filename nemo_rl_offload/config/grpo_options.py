"""The recipe rules of GRPO's reward, sampling and validation options (one owner: ``validate``
and a starting run both report them through :func:`check`), and the early stop on a
validation metric.

Values of a wrong type are the schema's to report; the rules here look only at well-typed ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_rl_offload.config import checkpointing

_DAPO_KEYS = ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def resolve_stop_metric(name: str) -> str:
    """The validation metric ``grpo.stop_at_validation_metric`` names (NeMo-RL's names
    ``accuracy`` and ``pass_k`` included, with or without ``val:``); ValueError otherwise."""
    metric = checkpointing.resolve_metric(name, "grpo")
    if metric.phase != "val":
        names = ", ".join(checkpointing.METRICS["grpo"]["val"])
        raise ValueError(f"'{name}' is a training metric; name a validation one: {names}")
    return metric.key


def stop_message(metrics: Mapping[str, float], key: str, threshold: float) -> str | None:
    """NeMo-RL's early stop: training ends once the validation metric reaches the threshold
    (``>=``, higher is better); the line to print then, else None."""
    value = metrics.get(key)
    if value is None or value < threshold:
        return None
    return (
        f"grpo.stop_at_validation_metric: {key} {value:.4f} reached "
        f"grpo.stop_at_validation_threshold {threshold:g}; training stops here"
    )


def check(grpo: Mapping[str, Any]) -> list[str]:
    """Errors for the ``grpo`` section's reward, sampling and validation options."""
    return [
        *_check_advantage_clip(grpo),
        *_check_reward_scaling(grpo.get("reward_scaling")),
        *_check_reward_shaping(grpo.get("reward_shaping")),
        *_check_dynamic_sampling(grpo),
        *_check_validation(grpo),
    ]


# The samplers of NeMo-RL's single controller that run here, each with the key of its window:
# how many steps ahead of training a batch may be sampled (NeMo-RL's default for each is one).
SAMPLER_WINDOWS = {
    "in_order": "max_lookahead_versions",
    "ready_first": "max_staleness_versions",
    "weight_fifo": "max_staleness_versions",
    "windowed": "max_staleness_versions",
}


def _sampler(recipe: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``async_rl.sampler`` as written (empty for NeMo-RL's default, the in-order sampler), or
    None when ``async_rl`` is not set: the single controller runs only with that section."""
    single_controller = recipe.get("async_rl")
    if not isinstance(single_controller, Mapping):
        return None
    sampler = single_controller.get("sampler")
    return sampler if isinstance(sampler, Mapping) else {}


def _sampler_name(sampler: Mapping[str, Any]) -> Any:
    """The sampler's name, in-order when unnamed (the section's default)."""
    name = sampler.get("name")
    return "in_order" if name is None else name


def _window(sampler: Mapping[str, Any]) -> tuple[str, Any] | None:
    """The sampler's window key and its value as written (NeMo-RL's default when absent), or
    None for a sampler that does not run here (config/ignored_keys.py refuses its name)."""
    key = SAMPLER_WINDOWS.get(_sampler_name(sampler))
    return None if key is None else (key, sampler.get(key, 1))


def _freshest_first(sampler: Mapping[str, Any]) -> bool:
    return _sampler_name(sampler) == "windowed" and sampler.get("sample_freshest_first") is True


def async_lead(recipe: Mapping[str, Any]) -> int:
    """How many steps ahead of the step that trains on them GRPO samples rollouts
    (algorithms/async_rollouts.py; zero: the synchronous loop).

    ``grpo.async_grpo``, when enabled, gives its ``max_trajectory_age_steps``. ``async_rl``
    gives its sampler's window W (``max_lookahead_versions`` of ``in_order``,
    ``max_staleness_versions`` of the others). Generation here runs on the training GPUs
    between steps, so every rollout that has been dispatched is ready when a step selects,
    and each sampler's choice becomes a fixed schedule:

    - ``in_order`` takes the batch stamped with the step, dispatched W steps before it;
    - ``ready_first`` and ``weight_fifo`` admit one batch per trainer version, at most W
      ahead; the oldest admitted batch is the step's own, first in the buffer and of the
      oldest start weight, so the ready-order pick and the oldest-weight pick both take it,
      as ``in_order`` does;
    - ``windowed`` taking the oldest first, with a buffer that holds the step's batch and W
      more, finds the step's batch first, sampled W steps earlier: one schedule it produces
      (it is ungated: a larger buffer gives the same ages but drops some batches unused);
    - ``windowed`` taking the freshest first picks, at every step, rollouts that the current
      weights sampled: the synchronous loop.

    Otherwise the lead is zero. ``tests/unit/algorithms/test_async_samplers.py`` checks these
    schedules against a model of NeMo-RL's selection rules."""
    legacy = (recipe.get("grpo") or {}).get("async_grpo") or {}
    if legacy.get("enabled") is True:
        return int(legacy.get("max_trajectory_age_steps", 1))
    sampler = _sampler(recipe)
    if sampler is None or _freshest_first(sampler):
        return 0
    window = _window(sampler)
    if window is None:
        name = _sampler_name(sampler)
        raise ValueError(f"async_rl.sampler.name: {name!r} does not run here (validate says so)")
    return int(window[1])


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def async_problems(recipe: Mapping[str, Any]) -> list[str]:
    """Errors for asynchronous GRPO (algorithms/async_rollouts.py): the two ways to ask for it
    at once, windows and ages that are not whole steps, and NeMo-RL's conditions on the loss
    and on the streaming batch. Its engine switches are config/ignored_keys.py's."""
    errors = _single_controller_problems(recipe)
    cfg = (recipe.get("grpo") or {}).get("async_grpo")
    if not isinstance(cfg, Mapping) or cfg.get("enabled") is not True:
        return errors
    if recipe.get("async_rl") is not None:
        errors.append(
            "async_rl: NeMo-RL's single-controller trainer reads its asynchrony from async_rl "
            "and its other entrypoint from grpo.async_grpo; set one of them (grpo.async_grpo."
            "enabled: false, or async_rl: null)"
        )
    age = cfg.get("max_trajectory_age_steps", 1)
    if not _whole(age) or age < 1:
        errors.append(
            f"grpo.async_grpo.max_trajectory_age_steps: {age!r} must be an integer >= 1 (how "
            "many steps older than the step that trains on them rollouts may be)"
        )
    loss = recipe.get("loss_fn") or {}
    if isinstance(loss, Mapping) and loss.get("use_importance_sampling_correction") is not True:
        errors.append(
            "grpo.async_grpo.enabled: asynchronous GRPO trains on rollouts of older weights "
            "and needs loss_fn.use_importance_sampling_correction: true (NeMo-RL requires it "
            "too); set it, or grpo.async_grpo.enabled: false"
        )
    return errors


def _single_controller_problems(recipe: Mapping[str, Any]) -> list[str]:
    """``async_rl``'s rules: the ones NeMo-RL's config and samplers enforce, one line each."""
    sampler = _sampler(recipe)
    if sampler is None:
        return []
    return [
        *_window_problems(sampler),
        *_streaming_problems(recipe["async_rl"]),
        *_ready_first_problems(sampler, recipe.get("loss_fn") or {}),
    ]


def _window_problems(sampler: Mapping[str, Any]) -> list[str]:
    """A negative window (NeMo-RL's schema refuses it too); a value that is not an integer is
    the schema's to report."""
    window = _window(sampler)
    if window is None or not _whole(window[1]) or window[1] >= 0:
        return []
    key, value = window
    return [
        f"async_rl.sampler.{key}: {value} must be an integer >= 0 (how many steps ahead of "
        "training rollouts are sampled; 0: synchronous)"
    ]


def _streaming_problems(single_controller: Mapping[str, Any]) -> list[str]:
    """NeMo-RL's samplers refuse a chunk of fewer than one group when its first step selects;
    refused here before the run instead."""
    fewest = single_controller.get("min_groups_for_streaming_train")
    if not _whole(fewest) or fewest >= 1:
        return []
    return [
        f"async_rl.min_groups_for_streaming_train: {fewest} must be an integer >= 1 (the "
        "fewest ready prompt groups a step takes at once; NeMo-RL's samplers refuse fewer); "
        "set it to grpo.num_prompts_per_step"
    ]


def _ready_first_problems(sampler: Mapping[str, Any], loss: Any) -> list[str]:
    """NeMo-RL's conditions on the loss for the ready-first sampler, which may mix weight
    versions in a step: importance-sampling correction on, and the old log-probabilities read
    (the ratio not forced to one)."""
    if _sampler_name(sampler) != "ready_first" or not isinstance(loss, Mapping):
        return []
    errors = []
    if loss.get("use_importance_sampling_correction") is not True:
        errors.append(
            "loss_fn.use_importance_sampling_correction: the ready_first sampler trains on "
            "rollouts of older weights and needs it true (NeMo-RL requires it too); set it, or "
            "another async_rl.sampler.name"
        )
    if loss.get("force_on_policy_ratio") is True:
        errors.append(
            "loss_fn.force_on_policy_ratio: the ready_first sampler needs the old "
            "log-probabilities in the ratio (NeMo-RL requires it false too); set it to false, "
            "or another async_rl.sampler.name"
        )
    return errors


def sampling_warnings(policy: Mapping[str, Any]) -> list[str]:
    """GRPO's log-probabilities are of the tempered distribution on both sides (sampler and
    training), but neither side applies top-k / top-p, where NeMo-RL filters the policy's
    training-time log-probabilities: say so where the recipe sets them."""
    generation = policy.get("generation")
    if not isinstance(generation, Mapping):
        return []
    top_k, top_p = generation.get("top_k"), generation.get("top_p")
    filtered = [
        name
        for name, value, off in (("top_k", top_k, (None, 0, -1)), ("top_p", top_p, (None, 1.0)))
        if value not in off
    ]
    return [
        f"warning: policy.generation.{name}: sampling uses it, but GRPO's importance ratios and "
        "KL here are of the tempered distribution without it (NeMo-RL also filters the "
        "policy's training log-probabilities); leave it unset for NeMo-RL's exact ratios"
        for name in filtered
    ]


def _check_advantage_clip(grpo: Mapping[str, Any]) -> list[str]:
    low, high = grpo.get("advantage_clip_low"), grpo.get("advantage_clip_high")
    if _number(low) and _number(high) and low > high:
        return [
            f"grpo.advantage_clip_low: {low} is above grpo.advantage_clip_high {high}; "
            "advantages are clamped to [low, high], so set low <= high (e.g. -5 and 5)"
        ]
    return []


def _check_reward_scaling(cfg: Any) -> list[str]:
    if not isinstance(cfg, Mapping) or cfg.get("enabled") is not True:
        return []
    low, high = cfg.get("source_min", 0.0), cfg.get("source_max", 1.0)
    if _number(low) and _number(high) and high <= low:
        return [
            f"grpo.reward_scaling.source_max: {high} must be above source_min {low}; rewards "
            "are mapped from [source_min, source_max] onto [target_min, target_max]"
        ]
    return []


def _check_reward_shaping(cfg: Any) -> list[str]:
    if not isinstance(cfg, Mapping) or cfg.get("enabled") is not True:
        return []
    where = "grpo.reward_shaping"
    coef = cfg.get("stop_properly_penalty_coef")
    if coef is not None:
        if _number(coef) and not 0 <= coef <= 1:
            return [
                f"{where}.stop_properly_penalty_coef: {coef} must be in [0, 1]; it scales a "
                "truncated response's reward (0: no reward, 1: no penalty)"
            ]
        return []
    missing = [key for key in _DAPO_KEYS if cfg.get(key) is None]
    if missing:
        return [
            f"{where}: enabled without {', '.join(missing)}; set overlong_buffer_length, "
            "overlong_buffer_penalty and max_response_length (DAPO's overlong penalty), or "
            "stop_properly_penalty_coef"
        ]
    problems = []
    buffer, penalty = cfg["overlong_buffer_length"], cfg["overlong_buffer_penalty"]
    if _number(buffer) and buffer <= 0:
        problems.append(
            f"{where}.overlong_buffer_length: {buffer} must be at least 1; it is the length "
            "over which the penalty grows to overlong_buffer_penalty"
        )
    if _number(penalty) and penalty < 0:
        problems.append(
            f"{where}.overlong_buffer_penalty: {penalty} must be >= 0; it is subtracted from "
            "over-long responses' rewards"
        )
    return problems


def _check_dynamic_sampling(grpo: Mapping[str, Any]) -> list[str]:
    dynamic = grpo.get("use_dynamic_sampling") is True
    multiplier = grpo.get("batch_multiplier", 1.0)
    problems = []
    if _number(multiplier) and not dynamic and multiplier != 1:
        problems.append(
            f"grpo.batch_multiplier: {multiplier} acts only with grpo.use_dynamic_sampling; "
            "set use_dynamic_sampling to true, or batch_multiplier to 1"
        )
    prompts = grpo.get("num_prompts_per_step")
    if (
        dynamic
        and _number(multiplier)
        and isinstance(prompts, int)
        and int(prompts * multiplier) < 1
    ):
        problems.append(
            f"grpo.batch_multiplier: {multiplier} x num_prompts_per_step {prompts} is "
            "less than one prompt per generation batch; raise it"
        )
    # NeMo-RL keeps a sample whose own reward spread is not 0: with the leave-one-out
    # baseline that is the spread of its group's others, so a group needs 3 samples (2 without).
    generations = grpo.get("num_generations_per_prompt")
    loo = grpo.get("use_leave_one_out_baseline", True) is not False
    fewest = 3 if loo else 2
    if dynamic and isinstance(generations, int) and 0 < generations < fewest:
        why = " and grpo.use_leave_one_out_baseline (each sample's is its others')" if loo else ""
        fix = " or use_leave_one_out_baseline to false" if loo and generations == 2 else ""
        problems.append(
            f"grpo.num_generations_per_prompt: {generations} gives no sample a non-zero reward "
            f"spread with grpo.use_dynamic_sampling{why}, so dynamic sampling would keep "
            f"nothing; set it to at least {fewest}{fix}"
        )
    batches = grpo.get("dynamic_sampling_max_gen_batches")
    if dynamic and isinstance(batches, int) and batches < 1:
        problems.append(
            f"grpo.dynamic_sampling_max_gen_batches: {batches} allows no generation batch "
            "with grpo.use_dynamic_sampling; set it to at least 1 (NeMo-RL's default is 10)"
        )
    return problems


def _check_validation(grpo: Mapping[str, Any]) -> list[str]:
    problems = []
    samples = grpo.get("val_num_generations_per_prompt", 1)
    if isinstance(samples, int) and samples < 1:
        problems.append(
            f"grpo.val_num_generations_per_prompt: {samples} samples no held-out response; "
            "set it to at least 1 (the responses sampled per held-out prompt)"
        )
    name = grpo.get("stop_at_validation_metric")
    if not isinstance(name, str):
        return problems
    try:
        key = resolve_stop_metric(name)
    except ValueError as exc:
        return [*problems, f"grpo.stop_at_validation_metric: {exc}"]
    if grpo.get("stop_at_validation_threshold") is None:
        problems.append(
            "grpo.stop_at_validation_threshold: required with grpo.stop_at_validation_metric; "
            "set the value at which training stops"
        )
    if key == "val_pass_k" and isinstance(samples, int) and samples <= 1:
        problems.append(
            "grpo.stop_at_validation_metric: pass_k is reported only with "
            "grpo.val_num_generations_per_prompt above 1; raise that"
        )
    if not _validates(grpo):
        problems.append(
            "grpo.stop_at_validation_metric: no validation runs (val_period 0, val_at_start "
            "and val_at_end false), so training would never stop on it; enable validation"
        )
    return problems


def _validates(grpo: Mapping[str, Any]) -> bool:
    period = grpo.get("val_period")
    return bool(
        (isinstance(period, int) and period > 0)
        or grpo.get("val_at_start")
        or grpo.get("val_at_end")
    )
