"""GRPO: sample a group of responses per prompt, score them, and push the policy towards the
responses that beat their group (clipped-ratio loss, optional KL to the reference policy).

Run: ``nemo-rl-offload grpo --config examples/configs/tiny/grpo.yaml``
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from nemo_rl_offload import losses
from nemo_rl_offload.algorithms import (
    advantages,
    async_rollouts,
    gym_rollouts,
    loop,
    loss_inputs,
    opd,
    rewards,
    throughput,
)
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.common import (
    EpochSampler,
    Run,
    prepare,
)
from nemo_rl_offload.config import (
    batch_checks,
    grpo_options,
    on_policy_distillation,
)
from nemo_rl_offload.config.generation_settings import SamplingSettings
from nemo_rl_offload.config.router_replay import NO_ROUTE
from nemo_rl_offload.environments.math import MathEnvironment
from nemo_rl_offload.environments.nemo_gym_results import GymTurn
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy.policy_group import PolicyGroup, holds_reference
from nemo_rl_offload.preflight import Report

# Generation seeds of a step's later generation batches (dynamic sampling) are this far apart,
# beyond any step number, so that no two batches of a run share a seed.
_BATCH_SEED_STRIDE = 1 << 32


def sampling_settings(run: Run, prompts: list[TokenSequence], *, greedy: bool) -> SamplingSettings:
    """Sampling settings whose new tokens always fit policy.max_total_sequence_length."""
    longest = max(len(p.ids) for p in prompts)
    generation = run.policy_settings.generation
    new_tokens = generation.new_tokens(longest, run.max_len)
    if new_tokens <= 0:
        raise UserInputError(
            f"policy.max_total_sequence_length: {run.max_len} leaves no room to generate after "
            f"a {longest}-token prompt; raise it"
        )
    return generation.sampling(
        max_new_tokens=new_tokens,
        eos_id=run.tokenizer.eos_id,
        greedy=greedy,
        vocab_limit=run.tokenizer.vocab_size,
    )


def generate_and_score(
    run: Run,
    policy: PolicyGroup,
    env: MathEnvironment,
    prompts: list[TokenSequence],
    answers: list[str],
    *,
    greedy: bool,
    seed: int,
    record_routes: bool = False,
) -> tuple[list[list[int]], list[float], list[list[float]], list[Any]]:
    """Responses, their rewards, the sampler's log-probabilities of their tokens and, with
    ``record_routes`` (``policy.router_replay``), the experts of each sequence's positions
    (None each otherwise)."""
    settings = sampling_settings(run, prompts, greedy=greedy)
    generated = policy.generate(
        [p.ids for p in prompts],
        settings,
        seed=seed,
        pad_id=run.tokenizer.pad_id,
        record_routes=record_routes,
    )
    responses = [g.ids for g in generated]
    texts = [run.tokenizer.decode(r) for r in responses]
    routes = [g.routes for g in generated]
    return responses, env.score(texts, answers), [g.logprobs for g in generated], routes


def rollout(
    run: Run,
    policy: PolicyGroup,
    env: MathEnvironment,
    train: list[TokenSequence],
    train_answers: list[str],
    picked: list[int],
    group: int,
    *,
    seed: int,
) -> tuple[list[TokenSequence], list[list[int]], list[float], list[list[float]], list[Any]]:
    """``group`` sampled responses to each picked training prompt, with their rewards, the
    sampler's log-probabilities of their tokens and (``policy.router_replay``) its routes."""
    prompts = [train[i] for i in picked for _ in range(group)]
    answers = [train_answers[i] for i in picked for _ in range(group)]
    responses, rewards, logprobs, routes = generate_and_score(
        run,
        policy,
        env,
        prompts,
        answers,
        greedy=False,
        seed=seed,
        record_routes=run.policy_settings.records_routes,
    )
    return prompts, responses, rewards, logprobs, routes


def format_samples(
    tokenizer: Any,
    prompts: list[TokenSequence],
    responses: list[list[int]],
    rewards: list[float],
    *,
    count: int,
    step: int,
) -> str:
    """``logger.num_val_samples_to_print``: the first ``count`` held-out samples as a block a
    reader can scan (prompt, response, reward), for seeing what the policy actually writes."""
    count = min(count, len(prompts))
    lines = [f"validation samples at step {step} ({count} of {len(prompts)}):"]
    for index in range(count):
        lines += [
            f"--- sample {index + 1} | reward {rewards[index]:g}",
            f"prompt:   {tokenizer.decode(prompts[index].ids)!r}",
            f"response: {tokenizer.decode(responses[index], skip_special=False)!r}",
        ]
    lines.append("---")
    return "\n".join(lines)


def validate(
    run: Run,
    policy: PolicyGroup,
    env: MathEnvironment,
    val: list,
    answers: list,
    seed: int,
    *,
    step: int = 0,
    samples_per_prompt: int = 1,
) -> dict[str, float]:
    """Mean reward on held-out prompts: sampled with the training settings,
    ``samples_per_prompt`` samples per prompt (the same seed at every validation, so
    validations compare like with like), and with greedy decoding. With several samples per
    prompt, ``val_pass_k`` is the share of prompts any of whose samples is rewarded
    (NeMo-RL's pass_k). With ``logger.num_val_samples_to_print`` the first sample of as many
    prompts goes to stderr."""
    if not val:
        return {}
    repeat = samples_per_prompt
    responses, sampled, _, _ = generate_and_score(
        run,
        policy,
        env,
        [p for p in val for _ in range(repeat)],
        [a for a in answers for _ in range(repeat)],
        greedy=False,
        seed=seed,
    )
    _, greedy, _, _ = generate_and_score(run, policy, env, val, answers, greedy=True, seed=seed)
    shown = run.settings.logger.num_val_samples_to_print
    if shown > 0:
        text = format_samples(
            run.tokenizer,
            list(val),
            responses[::repeat],
            sampled[::repeat],
            count=shown,
            step=step,
        )
        print(text, file=sys.stderr, flush=True)
    metrics = {"val_reward": float(np.mean(sampled)), "val_reward_greedy": float(np.mean(greedy))}
    if repeat > 1:
        per_prompt = np.asarray(sampled, dtype=float).reshape(-1, repeat)
        metrics["val_pass_k"] = float((per_prompt > 0).any(axis=1).mean())
    return metrics


@dataclasses.dataclass
class PromptGroup:
    """One prompt's sampled responses with their rewards after scaling and shaping (what the
    advantages come from) and after scaling only (what dynamic sampling looks at, as in
    NeMo-RL, so that length shaping alone does not make a group count as varied), the
    sampler's log-probabilities of each response's tokens, and with ``policy.router_replay``
    the sampler's experts of each sequence's positions (prompt and response; empty without)."""

    prompt: TokenSequence
    responses: list[list[int]]
    rewards: torch.Tensor
    scaled: torch.Tensor
    truncated: list[bool]
    logprobs: list[list[float]]
    routes: list[np.ndarray | None] = dataclasses.field(default_factory=list)
    # NeMo-Gym rollouts, per response (empty otherwise): the environment's token ranges in
    # prompt + response, the generated turns (for the message-level penalties), and whether
    # the environment masked the sample out of the loss.
    env_spans: list[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=list)
    turns: list[tuple[GymTurn, ...]] = dataclasses.field(default_factory=list)
    masked: list[bool] = dataclasses.field(default_factory=list)
    # The NeMo-Gym agent of each response (empty for this backend's own rollouts).
    agents: list[str | None] = dataclasses.field(default_factory=list)

    def select(self, indices: Sequence[int]) -> PromptGroup:
        """The group with only the responses at ``indices``: dynamic sampling keeps samples,
        not whole groups, as NeMo-RL does (per-response lists left empty stay empty)."""
        picked = list(indices)
        if picked == list(range(len(self.responses))):
            return self

        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in picked] if values else values

        return dataclasses.replace(
            self,
            responses=pick(self.responses),
            rewards=self.rewards[picked],
            scaled=self.scaled[picked],
            truncated=pick(self.truncated),
            logprobs=pick(self.logprobs),
            routes=pick(self.routes),
            env_spans=pick(self.env_spans),
            turns=pick(self.turns),
            masked=pick(self.masked),
            agents=pick(self.agents),
        )


def prompt_keys(groups: Sequence[PromptGroup]) -> list[tuple[int, ...]]:
    """Each sample's prompt tokens: what NeMo-RL groups samples by for their baselines."""
    return [tuple(g.prompt.ids) for g in groups for _ in g.responses]


def make_groups(
    prompts: list[TokenSequence],
    responses: list[list[int]],
    scores: list[float],
    logprobs: list[list[float]],
    group: int,
    cfg: Mapping[str, Any],
    stop_ids: tuple[int, ...],
    routes: list[Any] | None = None,
    gym: gym_rollouts.GymSamples | None = None,
) -> list[PromptGroup]:
    """A generation batch's samples as prompt groups, rewards scaled and shaped (``gym``: a
    NeMo-Gym batch, which says which samples are truncated)."""
    truncated = (
        list(gym.truncated)
        if gym is not None
        else [rewards.truncated(r, stop_ids) for r in responses]
    )
    scaled = rewards.scale_rewards(
        torch.tensor(scores, dtype=torch.float32), cfg.get("reward_scaling")
    )
    shaped = rewards.shape_rewards(
        scaled, [len(r) for r in responses], truncated, cfg.get("reward_shaping")
    )
    return [
        PromptGroup(
            prompts[start],
            responses[start : start + group],
            shaped[start : start + group],
            scaled[start : start + group],
            truncated[start : start + group],
            logprobs[start : start + group],
            [] if routes is None or routes[start] is None else routes[start : start + group],
            [] if gym is None else gym.env_spans[start : start + group],
            [] if gym is None else gym.turns[start : start + group],
            [] if gym is None else gym.masked[start : start + group],
            [] if gym is None else gym.agents[start : start + group],
        )
        for start in range(0, len(prompts), group)
    ]


def _gym_routes(batch: gym_rollouts.GymSamples, wanted: bool) -> list[Any] | None:
    """``policy.router_replay`` on NeMo-Gym rollouts: each sample's routes as the policy's
    HTTP server returned them through NeMo-Gym (NeMo-RL's ``require_routed_experts``: a
    sample without them is an error, not a silent unreplayed one)."""
    if not wanted:
        return None
    missing = sum(r is None for r in batch.routes)
    if missing:
        raise UserInputError(
            f"policy.router_replay.enabled: {missing} of {len(batch.routes)} NeMo-Gym samples "
            "came back without routed_experts; the model server must return them (NeMo-Gym's "
            "vllm_model passes the policy server's through: return_token_id_information: true)"
        )
    return list(batch.routes)


def collect_groups(
    run: Run,
    policy: PolicyGroup,
    env: MathEnvironment,
    data: tuple[list[TokenSequence], list[str]],
    sampler: EpochSampler,
    *,
    seed: int,
    gym_batch: Callable[[list[int]], gym_rollouts.GymSamples] | None = None,
) -> tuple[list[PromptGroup], dict[str, float]]:
    """A step's ``num_prompts_per_step`` prompt groups and the metrics of their gathering.

    Without dynamic sampling, one generation batch of that many prompts. With it, batches of
    ``num_prompts_per_step x batch_multiplier`` prompts until prompts x generations samples
    with a non-zero reward spread are gathered (:class:`rewards.DynamicSampling`; a group
    may then hold fewer samples); ``filtered_reward`` is the mean reward of the samples kept
    and ``reward`` NeMo-RL's unfiltered one (:meth:`rewards.DynamicSampling.reward`).
    ``gym_batch``: NeMo-Gym's rollouts of the picked rows (each repeated for its group) instead
    of the sampler and the math environment."""
    cfg = run.recipe["grpo"]
    needed, group = int(cfg["num_prompts_per_step"]), int(cfg["num_generations_per_prompt"])
    dynamic = bool(cfg.get("use_dynamic_sampling", False))
    per_batch = int(needed * float(cfg.get("batch_multiplier", 1.0))) if dynamic else needed
    gathering = rewards.DynamicSampling[PromptGroup](
        needed * group, int(cfg.get("dynamic_sampling_max_gen_batches", 10))
    )
    stop_ids = run.policy_settings.generation.sampling(
        max_new_tokens=1, eos_id=run.tokenizer.eos_id
    ).stop_token_ids
    done = False
    seconds, sequence_tokens, new_tokens = 0.0, 0, 0
    decode = throughput.DecodeWork()
    run.progress.start("generation", needed * group, unit="rows")
    policy.phase_peak_gib()  # a new count: the sampling phase's peak is read after it
    while not done:
        began = time.perf_counter()
        batch = None
        if gym_batch is not None:
            batch = gym_batch(sampler.take(per_batch))
            prompts, responses, scores, logprobs = (
                batch.prompts,
                batch.responses,
                batch.rewards,
                batch.logprobs,
            )
            routes = _gym_routes(batch, run.policy_settings.records_routes)
        else:
            prompts, responses, scores, logprobs, routes = rollout(
                run,
                policy,
                env,
                *data,
                sampler.take(per_batch),
                group,
                seed=seed + gathering.batches * _BATCH_SEED_STRIDE,
            )
        seconds += time.perf_counter() - began
        new_tokens += sum(len(r) for r in responses)
        decode.add(prompts, responses)
        sequence_tokens += sum(len(p.ids) for p in prompts) + sum(len(r) for r in responses)
        groups = make_groups(
            prompts, responses, scores, logprobs, group, cfg, stop_ids, routes, gym=batch
        )
        keep = (
            rewards.dynamic_sampling_keep(
                [g.scaled for g in groups],
                [tuple(g.prompt.ids) for g in groups],
                leave_one_out=bool(cfg.get("use_leave_one_out_baseline", True)),
            )
            if dynamic
            else [[True] * len(g.responses) for g in groups]
        )
        done = gathering.add(groups, keep, torch.cat([g.rewards for g in groups]))
    taken, discarded = gathering.take()
    kept = [g.select(indices) for g, indices in taken]
    metrics = {"reward": gathering.reward()}
    # NeMo-RL's generation throughput counts the sequences' tokens (prompt and response); the
    # new tokens alone are what the sampler's speed is measured in (docs/generation.md).
    gpus = policy.workers
    metrics["timing/train/generation"] = seconds  # NeMo-RL's phase timer names
    if seconds > 0:
        metrics.update(
            generation_tokens_per_sec_per_gpu=sequence_tokens / seconds / gpus,
            generation_new_tokens_per_sec_per_gpu=new_tokens / seconds / gpus,
        )
    metrics.update(decode.metrics())
    peak = policy.phase_peak_gib()
    if peak > 0:  # GPU workers
        metrics["generation_peak_gpu_memory_gib"] = peak
    if dynamic:
        metrics.update(
            filtered_reward=float(torch.cat([g.rewards for g in kept]).mean()),
            dynamic_sampling_num_gen_batches=gathering.batches,
            dynamic_sampling_num_discarded_valid_samples=discarded,
        )
    return kept, metrics


def training_sequences(
    groups: list[PromptGroup], cfg: Mapping[str, Any]
) -> tuple[list[TokenSequence], torch.Tensor]:
    """The step's sequences with their advantages (NeMo-RL's GRPO estimator over the
    samples of each prompt, :mod:`advantages`, then clamped by ``advantage_clip_low`` /
    ``advantage_clip_high``). With ``overlong_filtering`` a truncated response gets loss
    multiplier 0 but still counts in its prompt's baseline and standard deviation (NeMo-RL's
    order: advantages first, the filter only masks the loss); so does a NeMo-Gym sample its
    environment masked."""
    values = advantages.group_advantages(
        torch.cat([g.rewards for g in groups]),
        prompt_keys(groups),
        advantages.AdvantageSettings.from_recipe(cfg),
    )
    values = rewards.clip_advantages(
        values, cfg.get("advantage_clip_low"), cfg.get("advantage_clip_high")
    )
    filtering = bool(cfg.get("overlong_filtering", False))
    sequences = []
    for g in groups:
        count = len(g.responses)
        routes = g.routes or [None] * count
        spans = g.env_spans or [()] * count
        masked = g.masked or [False] * count
        for response, cut, route, env, mask in zip(
            g.responses, g.truncated, routes, spans, masked, strict=True
        ):
            multiplier = 0.0 if (filtering and cut) or mask else g.prompt.loss_multiplier
            sequences.append(
                TokenSequence(
                    g.prompt.ids + response, len(g.prompt.ids), {}, multiplier, route, env
                )
            )
    for sequence, advantage in zip(sequences, values.tolist(), strict=True):
        sequence.extras["advantages"] = float(advantage)
    return sequences, values


def routed_share(sequences: list[TokenSequence]) -> float | None:
    """``policy.router_replay``: the share of positions the policy's forwards replay the
    sampler's experts at (every position the sampler fed: all but each sequence's last token,
    whose route no forward recorded); None when no sequence carries routes. Below 1, routes
    went missing between sampling and training."""
    fed = [s.routes[:-1] for s in sequences if s.routes is not None]
    if not fed:
        return None
    routed = sum(int((r != NO_ROUTE).all(axis=(1, 2)).sum()) for r in fed)
    return routed / max(1, sum(len(r) for r in fed))


def stop_rule(cfg: Mapping[str, Any]) -> Callable[[Mapping[str, float]], str | None] | None:
    """``grpo.stop_at_validation_metric``: a function of the validation metrics giving the
    line to stop on (None to go on), or None without the key."""
    name = cfg.get("stop_at_validation_metric")
    if name is None:
        return None
    key = grpo_options.resolve_stop_metric(name)
    threshold = float(cfg["stop_at_validation_threshold"])
    return lambda metrics: grpo_options.stop_message(metrics, key, threshold)


def run_grpo(report: Report, *, started: float | None = None) -> int:
    """Run grpo on a recipe checked for it (:func:`nemo_rl_offload.planning.plan_at_start.checked`);
    ``started``: when the command started, for checkpointing.checkpoint_must_save_by."""
    run = prepare(report, "grpo", started=started)
    return loop.drive(run, start)


def start(run: Run) -> loop.Steps:
    """Load the prompts, start the workers, and give the loop GRPO's step body."""
    cfg, loss_cfg = run.recipe["grpo"], run.recipe["loss_fn"]
    seed = run.settings.schedule.seed
    prompts = gym_rollouts.load_prompts(run, cfg)
    train, train_answers, val = prompts.train, prompts.train_answers, prompts.val
    kl_penalty = losses.effective_kl_penalty(loss_cfg)
    options = losses.PolicyLossOptions.from_recipe(loss_cfg)
    error_threshold = cfg.get("seq_logprob_error_threshold")
    run.connect()
    distilling = on_policy_distillation.enabled(run.recipe)
    # NeMo-RL's training, old and reference log-probabilities are of the sampling
    # distribution's temperature (top-k / top-p are not applied to them here); so are an
    # on-policy distillation teacher's.
    temperature = run.policy_settings.generation.temperature
    policy = run.start_group(
        "policy",
        seed=seed,
        trainable=True,
        with_reference=holds_reference(run.recipe, "grpo"),
        logits_temperature=temperature,
        gpu_fraction=(
            opd.gpu_share(run.recipe, on_gpu=run.report.cluster.on_gpu) if distilling else 1.0
        ),
    )
    teachers = opd.Teachers.start(run, seed=seed, temperature=temperature) if distilling else None
    gym = gym_rollouts.start_sampling(run, policy, prompts, seed=seed)
    meter = throughput.StepMeter.for_policy(run.policy_settings, policy.workers)
    env = MathEnvironment(run.settings.math_env)
    num_prompts, group = (
        int(cfg["num_prompts_per_step"]),
        int(cfg["num_generations_per_prompt"]),
    )
    batch_checks.check_split(
        num_prompts * group,
        run.batching(),
        policy.dp_size,
        key="grpo.num_prompts_per_step",
        what=f"{num_prompts} prompts x {group} generations",
    )
    sampler = run.sampler(prompts.count, seed)
    val_answers = prompts.val_answers
    val_samples = int(cfg.get("val_num_generations_per_prompt", 1))
    stop_when = stop_rule(cfg)
    gym_batch = (
        gym_rollouts.sampler(run, gym, prompts.train_rows, group) if gym is not None else None
    )

    def validate_at(step: int) -> dict[str, float]:
        if gym is not None:
            return gym_rollouts.validate(
                gym,
                prompts.val_rows,
                run.policy_settings.generation,
                max_len=run.max_len,
                samples_per_prompt=val_samples,
            )
        return validate(
            run, policy, env, val, val_answers, seed, step=step, samples_per_prompt=val_samples
        )

    loss_spec = loss_inputs.loss_spec(loss_cfg)

    def collect(target: int) -> tuple[list[PromptGroup], dict[str, float]]:
        """The groups step ``target`` trains on, sampled by the weights of now."""
        return collect_groups(
            run,
            policy,
            env,
            (train, train_answers),
            sampler,
            seed=seed * 1000003 + target,
            gym_batch=gym_batch,
        )

    # grpo.async_grpo or async_rl: each step's rollouts sampled `lead` steps ahead
    # (algorithms/async_rollouts.py); `steps` (the loop's view of the data) is set below.
    lead = grpo_options.async_lead(run.recipe)
    pipeline = (
        async_rollouts.RolloutPipeline(
            lead,
            collect,
            exhausted=lambda: steps.data_exhausted,
            last_step=run.max_steps,
            pending=async_rollouts.RolloutPipeline.restored(run.driver_state, PromptGroup),
        )
        if lead > 0
        else None
    )

    def train_step(step: int) -> loop.TrainResult:
        start = time.perf_counter()
        if pipeline is None:
            groups, gathered = collect(step)
        else:
            taken = pipeline.take(step)
            groups = taken.groups
            gathered = {**taken.metrics, "avg_trajectory_age": float(async_rollouts.age(taken))}
        sequences, _ = training_sequences(groups, cfg)
        penalties = (
            gym_rollouts.advantages_with_penalties(
                sequences, [t for g in groups for t in g.turns], cfg
            )
            if gym is not None
            else {}
        )
        replayed = routed_share(sequences)
        final_rewards = torch.cat([g.rewards for g in groups]).tolist()
        generation = loss_inputs.generation_rows(
            sequences, [lp for g in groups for lp in g.logprobs]
        )
        loss_metrics: dict[str, float] = dict(penalties)
        old_logprobs = None
        logprobs_began = time.perf_counter()
        run.progress.start("log-probabilities", len(sequences), unit="sequences")
        if options.needs_old_logprobs or error_threshold is not None or teachers is not None:
            old_logprobs = run.forward_only(sequences, policy.token_logprobs)
            loss_metrics, dropped = loss_inputs.seq_logprob_error(
                sequences, generation, old_logprobs, final_rewards, error_threshold
            )
            for index in dropped:
                sequences[index].loss_multiplier = 0.0
        if teachers is not None:  # each token's advantage: teacher minus student log-prob
            agents = [a for g in groups for a in (g.agents or [None] * len(g.responses))]
            clip = (cfg.get("advantage_clip_low"), cfg.get("advantage_clip_high"))
            loss_metrics.update(teachers.advantages(run, sequences, agents, old_logprobs, clip))
        batches = run.training_batches(sequences, policy.dp_size)
        batches.attach("generation_logprobs", generation)
        if old_logprobs is not None:
            batches.attach("old_logprobs", old_logprobs)
        if options.positive_example_nll_weight > 0:
            scale = loss_inputs.positive_nll_scale(
                sequences, final_rewards, token_level=options.token_level_loss
            )
            batches.attach("rewards", np.asarray(final_rewards, dtype=np.float32))
            batches.attach("positive_nll_scale", np.full(len(sequences), scale, np.float32))
        if kl_penalty > 0:
            reference = run.forward_only(
                sequences, lambda forward: policy.token_logprobs(forward, reference=True)
            )
            batches.attach("reference_logprobs", reference)
        # The forward-only passes this step ran (the RL step benchmark's floor counts them).
        loss_metrics["logprob_passes"] = (old_logprobs is not None) + (kl_penalty > 0)
        logprobs_peak = policy.phase_peak_gib()
        if logprobs_peak > 0:  # GPU workers
            loss_metrics["policy_and_reference_logprobs_peak_gpu_memory_gib"] = logprobs_peak
        training_began = time.perf_counter()
        run.progress.start("training", len(sequences), unit="sequences")
        metrics = policy.train(batches.shards, loss_spec)
        seconds = {
            "generation": gathered["timing/train/generation"],
            "policy_and_reference_logprobs": training_began - logprobs_began,
            "policy_training": time.perf_counter() - training_began,
        }
        loss_metrics.update(losses.grpo_metric_means(metrics))
        if replayed is not None:
            loss_metrics["router_replay_routed"] = replayed
        elapsed = time.perf_counter() - start
        lengths = [len(s.ids) for s in sequences]
        loss_metrics.update(
            meter.metrics(lengths, elapsed_s=elapsed, phases_s=seconds, train_metrics=metrics)
        )
        return loop.TrainResult(
            metrics,
            elapsed=elapsed,
            tokens=sum(len(s.ids) for s in sequences),
            values={
                **loss_metrics,
                **gathered,
                "response_tokens_mean": float(
                    np.mean([len(r) for g in groups for r in g.responses])
                ),
                "truncation_rate": float(np.mean([t for g in groups for t in g.truncated])),
                **run.truncated([g.prompt for g in groups]),
            },
        )

    steps = loop.Steps(
        policy,
        sampler,
        train_step,
        validate=validate_at,
        schedule=run.settings.schedule,
        stop_when=stop_when,
        state=pipeline.state if pipeline is not None else None,
        drawn_ahead=(lambda: len(pipeline.pending)) if pipeline is not None else None,
    )
    return steps
