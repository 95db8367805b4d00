"""GRPO's rollouts through NeMo-Gym (``env.should_use_nemo_gym``): the rows of a step sent to
their agents, and the results as samples GRPO trains on.

As NeMo-RL prepares them, each row's request gets the recipe's sampling temperature and top-p,
and ``max_output_tokens`` at most ``policy.generation.max_new_tokens`` (the row's own when
smaller). A rollout is a sample whose continuation holds every turn after the first prompt;
the environment's tokens in it (tool results, user turns) never train. A sample is truncated
(``grpo.overlong_filtering``) when it fills ``policy.max_total_sequence_length``, and masked
out of the loss (still counted in its group's advantages) when its result's
``instance_config.mask_sample`` says so, unless ``env.should_mask_flagged_samples`` is false.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.common import token_sequence
from nemo_rl_offload.config.generation_settings import GenerationSettings
from nemo_rl_offload.config.nemo_gym import enabled
from nemo_rl_offload.data.nemo_gym_rows import gym_data_path, load_gym_rows
from nemo_rl_offload.environments.nemo_gym import NemoGymServers, gym_settings
from nemo_rl_offload.environments.nemo_gym_results import (
    GymTurn,
    penalized_advantages,
    rollout_from_result,
)
from nemo_rl_offload.errors import UserInputError

__all__ = [
    "GymSamples",
    "Prompts",
    "load_prompts",
    "start_sampling",
    "advantages_with_penalties",
    "check_group_prompts",
    "enabled",
    "load_rows",
    "request_rows",
    "sampler",
    "samples",
    "start",
    "validate",
]


@dataclasses.dataclass
class GymSamples:
    """A batch of rollouts in the shape GRPO's sampler gives (one entry per sample)."""

    prompts: list[TokenSequence]
    responses: list[list[int]]
    rewards: list[float]
    logprobs: list[list[float]]
    env_spans: list[tuple[tuple[int, int], ...]]
    turns: list[tuple[GymTurn, ...]]
    truncated: list[bool]
    masked: list[bool]
    # The agent that ran each sample (its row's agent_ref.name): on-policy distillation's
    # teacher routing reads it.
    agents: list[str | None] = dataclasses.field(default_factory=list)
    # policy.router_replay: each sample's sampler routes over prompt and response (None each
    # when the model server returned none).
    routes: list[np.ndarray | None] = dataclasses.field(default_factory=list)


def request_rows(
    rows: Sequence[Mapping[str, Any]],
    *,
    max_new_tokens: int | None,
    temperature: float,
    top_p: float,
) -> list[dict[str, Any]]:
    """Copies of ``rows`` with NeMo-RL's sampling settings in their requests
    (``max_new_tokens`` None: each request's own limit)."""
    limit = max_new_tokens
    prepared = []
    for row in rows:
        row = copy.deepcopy(dict(row))
        params = row["responses_create_params"]
        params["temperature"] = float(temperature)
        params["top_p"] = float(top_p)
        own = params.get("max_output_tokens")
        if limit is not None:
            params["max_output_tokens"] = int(limit) if own is None else min(int(own), int(limit))
        prepared.append(row)
    return prepared


def samples(
    gym: NemoGymServers,
    rows: Sequence[Mapping[str, Any]],
    *,
    max_len: int,
    mask_flagged: bool = True,
) -> GymSamples:
    """Run ``rows`` (consecutive rows of one prompt form its group) and convert the results."""
    results = gym.run(rows)
    out = GymSamples([], [], [], [], [], [], [], [])
    for result in results:
        rollout = rollout_from_result(
            result,
            invalid_tool_call_patterns=gym.settings.invalid_tool_call_patterns,
            thinking_tags=gym.settings.thinking_tags,
        )
        out.prompts.append(TokenSequence(rollout.ids[: rollout.prompt_len], rollout.prompt_len))
        out.responses.append(rollout.continuation)
        out.rewards.append(rollout.reward)
        out.logprobs.append(rollout.logprobs)
        out.env_spans.append(rollout.env_spans)
        out.turns.append(rollout.turns)
        out.truncated.append(len(rollout.ids) >= max_len)
        flagged = bool((result.get("instance_config") or {}).get("mask_sample", False))
        out.masked.append(mask_flagged and flagged)
        out.routes.append(rollout.routes)
    out.agents = [(row.get("agent_ref") or {}).get("name") for row in rows]
    return out


def start(run: Any, policy: Any, *, seed: int) -> NemoGymServers:
    """Serve the policy (NeMo-RL turns its server on for NeMo-Gym, without stop tokens) and
    start NeMo-Gym's servers against it, both stopped with the run."""
    import ray

    server = run.serve(policy, seed=seed, force=True, stop_token_ids=())
    settings = gym_settings(run.recipe.get("env") or {})
    workdir = Path(run.recipe["logger"]["log_dir"]) / "nemo_gym"
    gym = NemoGymServers(
        settings,
        policy_base_url=server.base_url,
        policy_api_key=server.api_key,
        model_name=run.policy_settings.model_name,
        workdir=workdir,
        ray_address=ray.get_runtime_context().gcs_address,
    )
    print(f"nemo-gym: starting {', '.join(settings.config_paths)} ...", file=sys.stderr)
    gym.start()
    run.servers.append(gym)
    print(
        f"nemo-gym: agents {sorted(gym.agents)} ready (log: {workdir / 'nemo_gym.log'})",
        file=sys.stderr,
        flush=True,
    )
    return gym


def sampler(
    run: Any, gym: NemoGymServers, rows: Sequence[Mapping[str, Any]], group: int
) -> Callable[[list[int]], GymSamples]:
    """A step's sampling: the picked rows, each ``group`` times, with the recipe's sampling
    settings, as one batch of samples (a row's samples must share their prompt)."""
    generation = run.policy_settings.generation
    env = run.recipe.get("env") or {}
    mask_flagged = env.get("should_mask_flagged_samples") is not False

    def sample(picked: list[int]) -> GymSamples:
        prepared = request_rows(
            [rows[i] for i in picked for _ in range(group)],
            max_new_tokens=generation.max_new_tokens,
            temperature=generation.temperature,
            top_p=generation.top_p,
        )
        batch = samples(gym, prepared, max_len=run.max_len, mask_flagged=mask_flagged)
        check_group_prompts(batch.prompts, group)
        return batch

    return sample


@dataclasses.dataclass
class Prompts:
    """A sampling algorithm's data: the recipe's prompts (token sequences, and the answers
    the environment grades their responses against), or NeMo-Gym's rows (``*_rows``; the
    agents render the prompts)."""

    train_answers: list[str]
    val_answers: list[str]
    train: list[TokenSequence]
    val: list[TokenSequence]
    train_rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]

    @property
    def count(self) -> int:
        """How many training examples the epoch sampler draws from."""
        return len(self.train_rows) if self.train_rows else len(self.train)


def load_prompts(run: Any, section: Mapping[str, Any]) -> Prompts:
    """GRPO's and distillation's data, cut to ``section.max_val_samples`` validation
    examples (null: all of them)."""
    limit = section.get("max_val_samples", 256)
    limit = None if limit is None else int(limit)
    if enabled(run.recipe):
        train_rows, val_rows = load_rows(run.recipe["data"])
        return Prompts([], [], [], [], train_rows, val_rows[:limit])
    train = run.examples("prompts", "train")
    val = run.examples("prompts", "val")[:limit]
    return Prompts(
        [str(e.ground_truth) for e in train],
        [str(e.ground_truth) for e in val],
        [token_sequence(e) for e in train],
        [token_sequence(e) for e in val],
        [],
        [],
    )


def start_sampling(run: Any, policy: Any, prompts: Prompts, *, seed: int) -> NemoGymServers | None:
    """After the policy's workers start: its weights (``Run.restore``; ``policy.quant_cfg``
    calibrates on the training prompts, NeMo-Gym rows' first requests there), then NeMo-Gym's
    servers against the policy's HTTP server, or the server alone when the recipe exposes it."""
    if not prompts.train_rows:
        run.restore(policy, prompts.train)
        run.serve(policy, seed=seed)
        return None
    run.restore(policy, first_prompts(prompts.train_rows, run.tokenizer))
    return start(run, policy, seed=seed)


def first_prompts(rows: Sequence[Mapping[str, Any]], tokenizer: Any) -> list[TokenSequence]:
    """The rows' first requests as the policy's chat template renders them (what
    ``policy.quant_cfg`` calibrates on when the data are NeMo-Gym rows): their message items
    (role and text content; NeMo-Gym's ``developer`` role as ``system``, as its model server
    sends it), with the rows' tools."""
    prompts = []
    for row in rows:
        params = row["responses_create_params"]
        items = params.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        messages = []
        for item in items or []:
            if not isinstance(item, Mapping) or "role" not in item:
                continue
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(
                    str(part.get("text", "")) for part in content if isinstance(part, Mapping)
                )
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": content or ""})
        if messages:
            ids = tokenizer.apply_chat_template(messages, tools=params.get("tools") or None)
            prompts.append(TokenSequence(list(ids), len(ids)))
    return prompts


def load_rows(data_cfg: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training and validation rows (``data.train.data_path``, ``data.validation.
    data_path``; no validation file: no validation rows)."""
    train = load_gym_rows(gym_data_path(data_cfg, "train"), "data.train.data_path")
    val_path = gym_data_path(data_cfg, "val")
    val = load_gym_rows(val_path, "data.validation.data_path") if val_path else []
    return train, val


def validate(
    gym: NemoGymServers,
    rows: Sequence[Mapping[str, Any]],
    generation: GenerationSettings,
    *,
    max_len: int,
    samples_per_prompt: int = 1,
) -> dict[str, float]:
    """Mean reward of the validation rows' rollouts (``val_reward``: NeMo-RL's
    ``total_reward/mean``), sampled with the validation settings; with several samples per
    row, ``val_pass_k``: the share of rows any of whose samples is rewarded."""
    if not rows:
        return {}
    repeat = samples_per_prompt
    prepared = request_rows(
        [row for row in rows for _ in range(repeat)],
        max_new_tokens=generation.max_new_tokens,
        temperature=generation.val_temperature or generation.temperature,
        top_p=generation.val_top_p or generation.top_p,
    )
    rewards = samples(gym, prepared, max_len=max_len).rewards
    metrics = {"val_reward": float(np.mean(rewards))}
    if repeat > 1:
        per_row = np.asarray(rewards, dtype=float).reshape(-1, repeat)
        metrics["val_pass_k"] = float((per_row > 0).any(axis=1).mean())
    return metrics


def check_group_prompts(prompts: Sequence[TokenSequence], group: int) -> None:
    """Every sample of a row must start from the same prompt tokens (a group's samples share
    one prompt here)."""
    for start in range(0, len(prompts), group):
        first = prompts[start].ids
        if any(p.ids != first for p in prompts[start + 1 : start + group]):
            raise UserInputError(
                "env.nemo_gym: the samples of one row began from different prompt tokens (its "
                "agent varies the first request between samples); GRPO here needs one prompt "
                "per row's group"
            )


def advantages_with_penalties(
    sequences: Sequence[TokenSequence],
    turns: Sequence[tuple[GymTurn, ...]],
    cfg: Mapping[str, Any],
) -> dict[str, float]:
    """``grpo.invalid_tool_call_advantage`` / ``malformed_thinking_advantage``: each flagged
    turn's tokens get the penalty as their advantage (every sequence's advantages become
    per-token then, as a micro-batch holds one kind); the rates NeMo-RL logs."""
    invalid, malformed = (
        cfg.get("invalid_tool_call_advantage"),
        cfg.get("malformed_thinking_advantage"),
    )
    if invalid is None and malformed is None:
        return {}
    per_token: dict[int, np.ndarray] = {}
    counts = {"invalid": 0, "malformed": 0, "turns": 0}
    for index, (sequence, its_turns) in enumerate(zip(sequences, turns, strict=True)):
        counts["turns"] += len(its_turns)
        counts["invalid"] += sum(t.invalid_tool_call for t in its_turns if invalid is not None)
        counts["malformed"] += sum(
            t.malformed_thinking and not (t.invalid_tool_call and invalid is not None)
            for t in its_turns
            if malformed is not None
        )
        values = penalized_advantages(
            len(sequence.ids),
            its_turns,
            float(sequence.extras["advantages"]),
            invalid_tool_call=None if invalid is None else float(invalid),
            malformed_thinking=None if malformed is None else float(malformed),
        )
        if values is not None:
            per_token[index] = values
    if per_token:
        for index, sequence in enumerate(sequences):
            sequence.extras["advantages"] = per_token.get(
                index,
                np.full(
                    len(sequence.ids) - 1, float(sequence.extras["advantages"]), dtype=np.float32
                ),
            )
    turns_total = max(counts["turns"], 1)
    return {
        "invalid_tool_call_rate": counts["invalid"] / turns_total,
        "malformed_thinking_rate": counts["malformed"] / turns_total,
        "num_invalid_tool_calls": float(counts["invalid"]),
        "num_malformed_thinking": float(counts["malformed"]),
        "num_assistant_messages": float(counts["turns"]),
    }
