"""On-policy distillation: the student samples responses, the teacher scores every position of
them (its top-k next-token log-probabilities), and the student moves towards the teacher's
distribution on its own samples (forward, reverse or mixed KL).

The teacher is a second, forward-only group of workers (``teacher`` section; its weights from
``teacher.init_checkpoint``). On GPU both groups share the GPUs (half a GPU each).

Run: ``nemo-rl-offload distill --config examples/configs/tiny/distillation.yaml``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from nemo_rl_offload.algorithms import gym_rollouts, loop, throughput
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.common import Run, prepare
from nemo_rl_offload.algorithms.grpo import rollout, validate
from nemo_rl_offload.config import batch_checks
from nemo_rl_offload.config.model_presets import Architecture
from nemo_rl_offload.environments.math import MathEnvironment
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy.checkpoint_dirs import resolve_checkpoint
from nemo_rl_offload.preflight import Report

# Held-out prompts are sampled this many times each for val_reward (distillation has no
# recipe key for it; GRPO's is grpo.val_num_generations_per_prompt).
VAL_SAMPLES_PER_PROMPT = 4


def shared_vocab_size(student: Architecture, teacher: Architecture) -> int:
    """Student and teacher must score the same vocabulary for a KL between them."""
    if student.vocab_size != teacher.vocab_size:
        raise UserInputError(
            f"teacher.model_name: its vocabulary ({teacher.vocab_size}) differs from the "
            f"student's ({student.vocab_size}); distillation needs one shared tokenizer"
        )
    return student.vocab_size


def run_distillation(report: Report, *, started: float | None = None) -> int:
    """Run distillation on a recipe checked for it
    (:func:`nemo_rl_offload.planning.plan_at_start.checked`); ``started``: when the command
    started, for checkpointing.checkpoint_must_save_by."""
    run = prepare(report, "distillation", started=started)
    return loop.drive(run, start)


def start(run: Run) -> loop.Steps:
    """Load the prompts, start the student's and the teacher's workers, and give the loop
    distillation's step body."""
    cfg, loss_cfg = run.recipe["distillation"], run.recipe["loss_fn"]
    teacher_init = run.report.policies["teacher"].init_checkpoint
    seed = run.settings.schedule.seed
    prompts = gym_rollouts.load_prompts(run, cfg)
    train, train_answers, val = prompts.train, prompts.train_answers, prompts.val
    on_gpu = run.report.cluster.on_gpu
    share = 0.5 if on_gpu else 1.0
    run.connect()
    policy = run.start_group("policy", seed=seed, trainable=True, gpu_fraction=share)
    teacher = run.start_group("teacher", seed=seed + 1, trainable=False, gpu_fraction=share)
    if teacher_init:
        path = resolve_checkpoint(teacher_init, "teacher.init_checkpoint")
        teacher.load(str(Path(path) / "policy"), weights_only=True)
    else:
        print(
            "warning: teacher.init_checkpoint is not set: the teacher has random weights",
            file=sys.stderr,
        )
    gym = gym_rollouts.start_sampling(run, policy, prompts, seed=seed)
    env = MathEnvironment(run.settings.math_env)
    num_prompts = int(cfg["num_prompts_per_step"])
    group = int(cfg.get("num_generations_per_prompt", 1))
    batch_checks.check_split(
        num_prompts * group,
        run.batching(),
        policy.dp_size,
        key="distillation.num_prompts_per_step",
        what=f"{num_prompts} x {group} responses",
    )
    top_k = cfg.get("topk_logits_k")
    spec = {
        "name": "distillation",
        "kl_type": loss_cfg["kl_type"],
        "mixed_kl_weight": float(loss_cfg.get("mixed_kl_weight", 0.5)),
        "vocab_size": shared_vocab_size(
            run.policy_settings.architecture, run.report.policies["teacher"].architecture
        ),
    }
    sampler = run.sampler(prompts.count, seed)
    meter = throughput.StepMeter.for_policy(run.policy_settings, policy.workers)
    val_answers = prompts.val_answers
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
                samples_per_prompt=VAL_SAMPLES_PER_PROMPT,
            )
        return validate(
            run,
            policy,
            env,
            val,
            val_answers,
            seed,
            step=step,
            samples_per_prompt=VAL_SAMPLES_PER_PROMPT,
        )

    def train_step(step: int) -> loop.TrainResult:
        start = time.perf_counter()
        policy.phase_peak_gib()  # a new count: the sampling phase's peak is read after it
        run.progress.start("generation", num_prompts * group, unit="rows")
        if gym_batch is not None:  # NeMo-Gym's rollouts: the environment's tokens never train
            batch = gym_batch(sampler.take(num_prompts))
            prompts, responses, rewards = batch.prompts, batch.responses, batch.rewards
            spans = batch.env_spans
            multipliers = [0.0 if masked else 1.0 for masked in batch.masked]
        else:
            prompts, responses, rewards, _, _ = rollout(
                run,
                policy,
                env,
                train,
                train_answers,
                sampler.take(num_prompts),
                group,
                seed=seed * 1000003 + step,
            )
            spans = [()] * len(prompts)
            multipliers = [p.loss_multiplier for p in prompts]
        sampled = time.perf_counter()
        sampling_peak = policy.phase_peak_gib()
        sequences = [
            TokenSequence(p.ids + r, len(p.ids), loss_multiplier=m, env_spans=e)
            for p, r, m, e in zip(prompts, responses, multipliers, spans, strict=True)
        ]
        batches = run.training_batches(sequences, policy.dp_size)
        for mb in batches.flat:
            del mb["labels"]  # the loss reads the student's logits, not label logprobs
        run.progress.start("teacher log-probabilities", len(sequences), unit="sequences")
        scores = run.forward_only(
            sequences,
            lambda forward: teacher.topk_logprobs(forward, None if top_k is None else int(top_k)),
            where="teacher",
            keep_labels=False,
        )
        batches.attach("teacher_logprobs", [values for values, _ in scores])
        if top_k is not None:
            batches.attach("teacher_indices", [indices for _, indices in scores])
        training_began = time.perf_counter()
        run.progress.start("training", len(sequences), unit="sequences")
        metrics = policy.train(batches.shards, spec)
        elapsed = time.perf_counter() - start
        # NeMo-RL's distillation timer names; its throughputs as GRPO's.
        seconds = {
            "generation": sampled - start,
            "teacher_logprob_inference": training_began - sampled,
            "policy_training": time.perf_counter() - training_began,
        }
        lengths = [len(s.ids) for s in sequences]
        values = meter.metrics(lengths, elapsed_s=elapsed, phases_s=seconds, train_metrics=metrics)
        if seconds["generation"] > 0:
            values["generation_tokens_per_sec_per_gpu"] = (
                sum(lengths) / seconds["generation"] / max(1, policy.workers)
            )
        if sampling_peak > 0:  # GPU workers
            values["generation_peak_gpu_memory_gib"] = sampling_peak
        return loop.TrainResult(
            metrics,
            elapsed=elapsed,
            tokens=sum(lengths),
            per_count={"kl": "kl_sum"},
            values={
                "reward": float(np.mean(rewards)),
                **values,
                **run.truncated(prompts[::group]),
            },
        )

    return loop.Steps(
        policy,
        sampler,
        train_step,
        validate=validate_at,
        schedule=run.settings.schedule,
    )
