"""GRPO: sample a group of responses per prompt, score them, and push the policy towards the
responses that beat their group (clipped-ratio loss, optional KL to the reference policy).

Run: ``nemo-rl-offload grpo --config examples/configs/tiny/grpo.yaml``
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np
import torch

from nemo_rl_offload import losses
from nemo_rl_offload.algorithms import batching
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.common import (
    Run,
    prepare,
)
from nemo_rl_offload.algorithms.policy_group import PolicyGroup, holds_reference
from nemo_rl_offload.data.datasets import load_split
from nemo_rl_offload.environments.math import MathEnvironment
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models.generation import SamplingSettings

# Held-out prompts are sampled this many times each for val_reward: an estimate of the
# sampling policy's accuracy with a quarter of the single-sample noise.
VAL_SAMPLES_PER_PROMPT = 4


def sampling_settings(run: Run, prompts: list[TokenSequence], *, greedy: bool) -> dict[str, Any]:
    """Sampling settings whose new tokens always fit policy.max_total_sequence_length."""
    longest = max(len(p.ids) for p in prompts)
    room = run.max_len - longest
    if room <= 0:
        raise UserInputError(
            f"policy.max_total_sequence_length: {run.max_len} leaves no room to generate after "
            f"a {longest}-token prompt; raise it"
        )
    generation = run.policy_cfg.get("generation") or {}
    settings = SamplingSettings.from_recipe(
        generation,
        eos_id=run.tokenizer.eos_id,
        greedy=greedy,
        max_new_tokens=min(int(generation.get("max_new_tokens", room)), room),
        vocab_limit=run.tokenizer.vocab_size,
    )
    return dataclasses.asdict(settings)


def generate_and_score(
    run: Run,
    policy: PolicyGroup,
    env: MathEnvironment,
    prompts: list[TokenSequence],
    answers: list[str],
    *,
    greedy: bool,
    seed: int,
) -> tuple[list[list[int]], list[float]]:
    settings = sampling_settings(run, prompts, greedy=greedy)
    responses = policy.generate(
        [p.ids for p in prompts], settings, seed=seed, pad_id=run.tokenizer.pad_id
    )
    texts = [run.tokenizer.decode(r) for r in responses]
    return responses, env.score(texts, answers)


def rollout(
    run: Run,
    policy: PolicyGroup,
    env: MathEnvironment,
    train: list[TokenSequence],
    train_raw: list[dict],
    picked: list[int],
    group: int,
    *,
    seed: int,
) -> tuple[list[TokenSequence], list[list[int]], list[float]]:
    """``group`` sampled responses to each picked training prompt, with their rewards."""
    prompts = [train[i] for i in picked for _ in range(group)]
    answers = [str(train_raw[i]["answer"]) for i in picked for _ in range(group)]
    responses, rewards = generate_and_score(
        run, policy, env, prompts, answers, greedy=False, seed=seed
    )
    return prompts, responses, rewards


def attach(microbatches: list[dict], key: str, arrays: list[np.ndarray]) -> None:
    for mb, array in zip(microbatches, arrays, strict=True):
        mb[key] = array


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
) -> dict[str, float]:
    """Mean reward on held-out prompts: sampled with the training settings, several samples
    per prompt (the same seed at every validation, so validations compare like with like),
    and with greedy decoding. With ``logger.num_val_samples_to_print`` the first sample of as
    many prompts goes to stderr."""
    if not val:
        return {}
    repeat = VAL_SAMPLES_PER_PROMPT
    responses, sampled = generate_and_score(
        run,
        policy,
        env,
        [p for p in val for _ in range(repeat)],
        [a for a in answers for _ in range(repeat)],
        greedy=False,
        seed=seed,
    )
    _, greedy = generate_and_score(run, policy, env, val, answers, greedy=True, seed=seed)
    shown = int(run.recipe["logger"].get("num_val_samples_to_print") or 0)
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
    return {"val_reward": float(np.mean(sampled)), "val_reward_greedy": float(np.mean(greedy))}


def run_grpo(config_path: str, overrides: list[str]) -> int:
    run = prepare(config_path, overrides, "grpo", total_steps_key="max_num_steps")
    policy = None
    try:
        cfg, loss_cfg, data_cfg = run.recipe["grpo"], run.recipe["loss_fn"], run.recipe["data"]
        policy_cfg, seed = run.policy_cfg, int(cfg["seed"])
        train_raw = load_split(data_cfg, "prompts", "train")
        val_raw = load_split(data_cfg, "prompts", "val")[: int(cfg.get("max_val_samples", 256))]
        train = run.encode(train_raw, "train")
        val = run.encode(val_raw, "val")
        kl_penalty = float(loss_cfg.get("reference_policy_kl_penalty", 0.0))
        run.connect()
        policy = run.start_group(
            "policy", seed=seed, trainable=True, with_reference=holds_reference(run.recipe, "grpo")
        )
        run.restore(policy)
        env = MathEnvironment.from_config((run.recipe.get("env") or {}).get("math") or {})
        num_prompts, group = (
            int(cfg["num_prompts_per_step"]),
            int(cfg["num_generations_per_prompt"]),
        )
        # With token budgets (packing, dynamic batching) each rank takes an equal share.
        micro = (
            1 if batching.token_budgeted(policy_cfg) else int(policy_cfg["train_micro_batch_size"])
        )
        if (num_prompts * group) % (micro * policy.dp_size):
            raise UserInputError(
                f"grpo.num_prompts_per_step: {num_prompts} prompts x {group} generations do not "
                f"split into {policy.dp_size} data-parallel rank(s) x micro-batches of {micro}"
            )
        sampler = run.sampler(len(train), seed)
        val_answers = [str(v["answer"]) for v in val_raw]
        if cfg.get("val_at_start") and run.start_step == 0:
            run.logger.log(0, validate(run, policy, env, val, val_answers, seed), phase="val")
        loss_spec = {
            "name": "grpo",
            "ratio_clip_min": loss_cfg["ratio_clip_min"],
            "ratio_clip_max": loss_cfg["ratio_clip_max"],
            "ratio_clip_c": loss_cfg.get("ratio_clip_c"),
            "kl_penalty": kl_penalty,
        }
        for step in run.steps():
            if sampler.epoch >= int(cfg.get("max_num_epochs", 1 << 30)):
                break
            start = time.perf_counter()
            prompts, responses, rewards = rollout(
                run,
                policy,
                env,
                train,
                train_raw,
                sampler.take(num_prompts),
                group,
                seed=seed * 1000003 + step,
            )
            advantages = losses.group_advantages(
                torch.tensor(rewards).view(num_prompts, group),
                normalize=bool(cfg.get("normalize_rewards", True)),
                leave_one_out=bool(cfg.get("use_leave_one_out_baseline", True)),
            ).flatten()
            sequences = [
                TokenSequence(p.ids + r, len(p.ids), {"advantages": float(a)}, p.loss_multiplier)
                for p, r, a in zip(prompts, responses, advantages.tolist(), strict=True)
            ]
            batches = run.training_batches(sequences, policy.dp_size)
            batches.attach("old_logprobs", run.forward_only(sequences, policy.token_logprobs))
            if kl_penalty > 0:
                reference = run.forward_only(
                    sequences, lambda forward: policy.token_logprobs(forward, reference=True)
                )
                batches.attach("reference_logprobs", reference)
            metrics = policy.train(batches.shards, loss_spec)
            elapsed = time.perf_counter() - start
            run.log_train_step(
                step,
                metrics,
                elapsed=elapsed,
                tokens=sum(len(s.ids) for s in sequences),
                per_count={"clip_fraction": "clip_fraction_sum", "kl": "kl_sum"},
                reward=float(np.mean(rewards)),
                response_tokens_mean=float(np.mean([len(r) for r in responses])),
                **run.truncated(prompts[::group]),
            )
            run.end_step(
                step,
                policy,
                sampler.position,
                val_period=int(cfg["val_period"]),
                validate=lambda step=step: validate(
                    run, policy, env, val, val_answers, seed, step=step
                ),
            )
        run.finish(policy)
        return 0
    finally:
        if policy is not None:
            policy.shutdown()
        run.close()
