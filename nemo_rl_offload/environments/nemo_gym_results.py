"""A NeMo-Gym rollout's result as a sequence GRPO trains on.

An agent's output items become one token sequence, as NeMo-RL builds it: the environment's
prompt tokens (not trained) and the generated ones (trained, with the sampler's
log-probabilities). Each generated turn is also checked for GRPO's message-level penalties.
The rules: docs/nemo_gym.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nemo_rl_offload.config.router_replay import ROUTES_KEY
from nemo_rl_offload.errors import UserInputError

__all__ = [
    "DEFAULT_INVALID_TOOL_CALL_PATTERNS",
    "DEFAULT_THINKING_TAGS",
    "GymRollout",
    "GymTurn",
    "NonContiguousRollout",
    "penalized_advantages",
    "rollout_from_result",
]

# NeMo-RL's defaults (env.nemo_gym.invalid_tool_call_patterns / thinking_tags).
DEFAULT_INVALID_TOOL_CALL_PATTERNS = (
    "<tool_call>",
    "</tool_call>",
    "<function_call>",
    "</function_call>",
)
DEFAULT_THINKING_TAGS = ("<think>", "</think>")


class NonContiguousRollout(ValueError):
    """A generated turn whose prompt does not begin with the tokens seen before it."""


@dataclass(frozen=True)
class GymTurn:
    """One generated turn: its tokens' range [start, end) in the rollout's ids, and its flags."""

    start: int
    end: int
    invalid_tool_call: bool = False
    malformed_thinking: bool = False


@dataclass(frozen=True)
class GymRollout:
    ids: list[int]
    prompt_len: int
    # After the prompt: the environment's token ranges (not trained) and the policy's turns.
    env_spans: tuple[tuple[int, int], ...]
    turns: tuple[GymTurn, ...]
    # The sampler's log-probability of every token after the prompt (0 over env spans).
    logprobs: list[float]
    reward: float
    # policy.router_replay: the sampler's experts of every position [len(ids), MoE layers, k]
    # (each turn's prompt part from its prefill, its generated part from its decode; -1 where
    # no forward fed a position), None when the model server returned none.
    routes: np.ndarray | None = None

    @property
    def continuation(self) -> list[int]:
        return self.ids[self.prompt_len :]


def _text_of(item: Mapping[str, Any], field: str) -> str | None:
    parts = item.get(field)
    if isinstance(parts, list) and parts and isinstance(parts[0], Mapping):
        text = parts[0].get("text")
        return text if isinstance(text, str) else None
    return None


def turn_flags(
    item: Mapping[str, Any],
    invalid_tool_call_patterns: Sequence[str] = DEFAULT_INVALID_TOOL_CALL_PATTERNS,
    thinking_tags: Sequence[str] = DEFAULT_THINKING_TAGS,
) -> tuple[bool, bool]:
    """(invalid tool call, malformed thinking) of the last output item of a generated turn:
    a content message is malformed with any thinking tag, a reasoning summary with a tag
    twice; a tool-call pattern in either is a call that was never made."""
    content = _text_of(item, "content")
    if content is not None:
        return (
            any(p in content for p in invalid_tool_call_patterns),
            any(t in content for t in thinking_tags),
        )
    summary = _text_of(item, "summary") if item.get("type") == "reasoning" else None
    if summary is not None:
        return (
            any(p in summary for p in invalid_tool_call_patterns),
            any(summary.count(t) > 1 for t in thinking_tags),
        )
    return False, False


def rollout_from_result(
    result: Mapping[str, Any],
    *,
    invalid_tool_call_patterns: Sequence[str] | None = None,
    thinking_tags: Sequence[str] | None = None,
) -> GymRollout:
    """The rollout in one NeMo-Gym result (``response.output`` and ``reward``)."""
    patterns = tuple(invalid_tool_call_patterns or DEFAULT_INVALID_TOOL_CALL_PATTERNS)
    tags = tuple(thinking_tags or DEFAULT_THINKING_TAGS)
    try:
        output = result["response"]["output"]
        reward = float(result["reward"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserInputError(
            f"a NeMo-Gym result without response.output or a numeric reward ({exc!r}): the "
            "agent's /run must return the response and its reward"
        ) from None
    ids: list[int] = []
    prompt_len: int | None = None
    env_spans: list[tuple[int, int]] = []
    turns: list[GymTurn] = []
    logprobs: list[float] = []
    routes: list[np.ndarray] = []
    for item in output:
        generated = item.get("generation_token_ids")
        if not generated:  # not a generated turn (tool calls, tool results, user messages)
            continue
        prompt = [int(t) for t in item["prompt_token_ids"]]
        if prompt[: len(ids)] != ids:
            first = next(
                (i for i, (a, b) in enumerate(zip(prompt, ids, strict=False)) if a != b),
                min(len(prompt), len(ids)),
            )
            raise NonContiguousRollout(
                f"a NeMo-Gym turn's prompt ({len(prompt)} tokens) does not begin with the "
                f"{len(ids)} tokens seen before it (first difference at token {first}): the "
                "chat history was changed between turns (truncated, reasoning stripped) or "
                "retokenized differently; NeMo-RL refuses such rollouts too"
            )
        new, seen = prompt[len(ids) :], len(ids)
        if prompt_len is None:
            prompt_len = len(new)
        elif new:
            env_spans.append((len(ids), len(ids) + len(new)))
            logprobs += [0.0] * len(new)
        ids += new
        values = [float(x) for x in item["generation_log_probs"]]
        if len(values) != len(generated):
            raise UserInputError(
                f"a NeMo-Gym turn has {len(generated)} generated tokens but {len(values)} "
                "log-probabilities: the model server must return one per token"
            )
        routes.append(_turn_routes(item, seen, len(prompt), len(generated), routes))
        invalid, malformed = turn_flags(item, patterns, tags)
        turns.append(GymTurn(len(ids), len(ids) + len(generated), invalid, malformed))
        ids += [int(t) for t in generated]
        logprobs += values
    if prompt_len is None:
        kinds = [item.get("type") for item in output]
        raise UserInputError(
            f"a NeMo-Gym result with no generated turn (output item types {kinds}): the prompt "
            "may already fill policy.max_total_sequence_length, or the model server does not "
            "return token ids (return_token_id_information: true)"
        )
    routed = None
    if routes and all(r is not None and r.size for r in routes):
        routed = np.concatenate(routes)
    return GymRollout(ids, prompt_len, tuple(env_spans), tuple(turns), logprobs, reward, routed)


def _turn_routes(
    item: Mapping[str, Any], seen: int, prompt: int, generated: int, earlier: list[np.ndarray]
) -> np.ndarray | None:
    """One turn's rows of a rollout's routes (NeMo-Gym's ``routed_experts`` of the item: its
    prompt and generated tokens' experts): the rows of the tokens new in this turn. The turn's
    prefill also routed the previous turn's last token, which that turn's decode never fed, so
    its row replaces the previous turn's last (as NeMo-RL stitches them)."""
    raw = item.get(ROUTES_KEY)
    if raw is None:
        return None
    table = np.asarray(raw)
    if table.ndim != 3 or table.shape[0] < prompt + generated:
        raise UserInputError(
            f"a NeMo-Gym turn's {ROUTES_KEY} has shape {tuple(table.shape)}; the model server "
            f"must return [tokens, MoE layers, k] for its {prompt} prompt and {generated} "
            "generated tokens"
        )
    if seen and earlier and earlier[-1] is not None and earlier[-1].size:
        earlier[-1][-1] = table[seen - 1]
    return table[seen : prompt + generated].copy()


def penalized_advantages(
    length: int,
    turns: Sequence[GymTurn],
    advantage: float,
    *,
    invalid_tool_call: float | None,
    malformed_thinking: float | None,
) -> np.ndarray | None:
    """A ``length``-token rollout's advantages on its label positions (position t holds token
    t+1's) with each flagged turn's tokens set to its penalty (an invalid tool call's first, as
    in NeMo-RL), or None when no penalty applies (the sequence keeps its one advantage)."""
    flagged = []
    for turn in turns:
        if turn.invalid_tool_call and invalid_tool_call is not None:
            flagged.append((turn, invalid_tool_call))
        elif turn.malformed_thinking and malformed_thinking is not None:
            flagged.append((turn, malformed_thinking))
    if not flagged:
        return None
    values = np.full(length - 1, advantage, dtype=np.float32)
    for turn, penalty in flagged:
        values[turn.start - 1 : turn.end - 1] = penalty
    return values
