"""What a request to the policy's endpoints may ask for: every field's type and bounds, checked
before megatron-core's endpoints parse the body, and the OpenAI-style error body of a refusal.

Why here and not in the endpoints or the sampler: megatron-core's endpoints coerce fields with
``float()`` / ``int()`` and pass the rest through, so NaN, a negative temperature, a ``top_k``
past the vocabulary or a token id past the embedding reached the policy's workers and failed
there (or were served as nonsense). One owner for the bounds keeps the endpoint's refusals, the
docs (docs/serving.md) and the tests in agreement. The sampler client still checks what only it
knows (the prompt's length after chat templating, its token ids after the multi-turn splice).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_N",
    "MAX_PROMPTS",
    "MIN_TEMPERATURE",
    "InvalidRequest",
    "Limits",
    "check_chat",
    "check_completion",
    "error_body",
]

# The most choices one chat request asks for (each is a row of a sampler call).
MAX_N = 128
# The most prompts one completions request sends (one sampler call's worth:
# policy_endpoint.MAX_REQUESTS_PER_CALL).
MAX_PROMPTS = 1024
# Below this a temperature divides the logits into float32 overflow (NaN probabilities); 0 is
# greedy. vLLM treats temperatures under 1e-5 as greedy; here they are refused, naming 0.
MIN_TEMPERATURE = 1e-5
# A seed is a 64-bit integer (what torch's generators take).
_SEED_RANGE = (-(2**63), 2**64 - 1)
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# megatron-core's own request extras, and OpenAI's flags: true or false when given.
_FLAGS = (
    "ignore_eos",
    "parallel_tool_calls",
    "skip_prompt_log_probs",
    "add_BOS",
    "prevent_retokenization",
    "return_tokenized_data",
    "return_raw_text",
)


class InvalidRequest(ValueError):
    """A request refused before it reaches the sampler: HTTP ``status`` with ``message``,
    naming the field ``param`` (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(frozen=True)
class Limits:
    """The served policy's sizes: ``max_len`` is ``policy.max_total_sequence_length`` (prompt
    and new tokens together), ``vocab_size`` the tokenizer's vocabulary (token ids and
    ``top_k`` stay below it)."""

    max_len: int
    vocab_size: int


def error_body(
    message: str, *, param: str | None = None, kind: str = "invalid_request_error", code: Any = None
) -> dict[str, Any]:
    """OpenAI's error object (what its clients and vLLM's parse)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------------- value checks
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """A value as a message names it, cut short (a client may send megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(body: Mapping[str, Any], key: str) -> float | None:
    """The finite number under ``key`` (None when absent or null)."""
    value = body.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise InvalidRequest(f"{key}: {_show(value)} is not a number", key)
    if isinstance(value, int):
        if abs(value) > 2**53:
            raise InvalidRequest(f"{key}: {_show(value)} is out of range", key)
        return float(value)
    if not math.isfinite(value):
        raise InvalidRequest(f"{key}: {_show(value)} is not a finite number", key)
    return value


def _integer(body: Mapping[str, Any], key: str, low: int, high: int, hint: str = "") -> int | None:
    """The integer under ``key`` within ``[low, high]`` (None when absent or null)."""
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise InvalidRequest(f"{key}: {_show(value)} is not an integer", key)
    if not low <= value <= high:
        raise InvalidRequest(
            f"{key}: {_show(value)} is out of range; send an integer from {low} to {high}{hint}",
            key,
        )
    return value


def _flag(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{key}: {_show(value)} must be true or false", key)
    return value


def _token_ids(value: Any, key: str, limits: Limits) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise InvalidRequest(f"{key}: must be a list of integer token ids", key)
    for token in value:
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequest(
                f"{key}: token id {_show(token)} is outside the vocabulary [0, "
                f"{limits.vocab_size})",
                key,
            )
    return value


# ---------------------------------------------------------------------------- field groups
def _sampling(body: Mapping[str, Any], limits: Limits) -> None:
    """The sampling fields both endpoints share."""
    temperature = _number(body, "temperature")
    if temperature is not None and not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise InvalidRequest(
            f"temperature: {_show(body['temperature'])} must be 0 (greedy) or at least "
            f"{MIN_TEMPERATURE:g}",
            "temperature",
        )
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise InvalidRequest(
            f"top_p: {_show(body['top_p'])} must be in (0, 1] (1: no nucleus cut)", "top_p"
        )
    _integer(body, "top_k", -1, limits.vocab_size, " (0 or -1: no top-k cut)")
    _integer(body, "seed", *_SEED_RANGE)
    for key in _FLAGS:
        _flag(body, key)
    if _flag(body, "stream"):
        raise InvalidRequest("stream: streaming is not served; send stream false", "stream")
    for key in ("max_tokens", "max_completion_tokens"):
        wanted = body.get(key)
        if wanted is None:
            continue
        if not _is_int(wanted):
            raise InvalidRequest(f"{key}: {_show(wanted)} is not an integer", key)
        if wanted < 1:
            raise InvalidRequest(
                f"{key}: {_show(wanted)} must be at least 1 (or left out: the rest of the context)",
                key,
            )
        if wanted > limits.max_len - 1:
            # megatron-core's wording, which NeMo-Gym's model server reads as a finish by length
            raise InvalidRequest(
                f"This model's maximum context length is {limits.max_len} tokens "
                f"(policy.max_total_sequence_length): {key} {_show(wanted)} leaves no room "
                "for a prompt; send fewer",
                key,
            )
    stop = body.get("stop")
    if stop is not None:
        if not (
            isinstance(stop, str)
            or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise InvalidRequest("stop: must be a string or a list of strings", "stop")
        if stop:
            raise InvalidRequest(
                "stop: stop strings are not served: this sampler stops at token ids only (the "
                "end-of-sequence token and policy.generation.stop_token_ids); remove stop",
                "stop",
            )
    for key in ("model", "user"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidRequest(f"{key}: must be a string", key)


def _not_served_top(key: str, value: int) -> InvalidRequest:
    return InvalidRequest(
        f"{key}: {value} is not served: this sampler returns the log-probability of each "
        f"sampled token only; send {key} 0",
        key,
    )


def _message(index: int, message: Any, limits: Limits) -> None:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where}: must be an object with a role and content", "messages")
    role = message.get("role")
    if role not in _ROLES:
        raise InvalidRequest(
            f"{where}.role: {_show(role)} is not one of {', '.join(_ROLES)}", "messages"
        )
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise InvalidRequest(f"{where}.content: must be a string or a list of parts", "messages")
    if isinstance(content, list) and not all(isinstance(p, str | Mapping) for p in content):
        raise InvalidRequest(
            f"{where}.content: each part must be a string or an object", "messages"
        )
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not (
        isinstance(tool_calls, list) and all(isinstance(c, Mapping) for c in tool_calls)
    ):
        raise InvalidRequest(f"{where}.tool_calls: must be a list of objects", "messages")
    for key in ("prompt_token_ids", "generation_token_ids"):
        if message.get(key) is not None:  # NeMo-Gym's earlier turns, spliced into the prompt
            _token_ids(message[key], "messages", limits)


# ---------------------------------------------------------------------------- the endpoints
def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def check_chat(body: Any, limits: Limits) -> None:
    """Raise :class:`InvalidRequest` for a ``/v1/chat/completions`` body the policy cannot
    serve as asked."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: must be a non-empty list of messages", "messages")
    for index, message in enumerate(messages):
        _message(index, message, limits)
    _sampling(body, limits)
    _integer(body, "n", 1, MAX_N)
    if _flag(body, "logprobs"):
        top = _integer(body, "top_logprobs", 0, 20)
        if top:
            raise _not_served_top("top_logprobs", top)
    else:
        _integer(body, "top_logprobs", 0, 20)
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
    ):
        raise InvalidRequest("tools: must be a list of tool objects", "tools")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, str | Mapping):
        raise InvalidRequest("tool_choice: must be a string or an object", "tool_choice")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InvalidRequest("chat_template_kwargs: must be an object", "chat_template_kwargs")


def check_completion(body: Any, limits: Limits) -> None:
    """Raise :class:`InvalidRequest` for a ``/v1/completions`` body the policy cannot serve as
    asked."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt: is empty", "prompt")
    elif isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequest(
                f"prompt: {len(prompt)} prompts in one request; send at most {MAX_PROMPTS}",
                "prompt",
            )
        if all(isinstance(p, str) for p in prompt):
            if not all(prompt):
                raise InvalidRequest("prompt: a prompt is empty", "prompt")
        elif all(_is_int(p) for p in prompt):
            _token_ids(prompt, "prompt", limits)
        elif all(isinstance(p, list) and p for p in prompt):
            for ids in prompt:
                _token_ids(ids, "prompt", limits)
        else:
            raise InvalidRequest(
                "prompt: must be a string, a list of strings, a list of token ids or a list "
                "of lists of token ids (none empty)",
                "prompt",
            )
    else:
        raise InvalidRequest(
            "prompt: must be a non-empty string or list (of strings or token ids)", "prompt"
        )
    _sampling(body, limits)
    _integer(body, "n", 1, 1, " (one completion per prompt here)")
    echo = _flag(body, "echo")
    top = _integer(body, "logprobs", 0, 5)
    if top:
        raise _not_served_top("logprobs", top)
    if echo and top is not None:
        raise InvalidRequest(
            "echo: prompt log-probabilities (echo with logprobs) are not served: this sampler "
            "returns the log-probabilities of the new tokens only; send echo false",
            "echo",
        )
