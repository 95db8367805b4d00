"""A conversation turned into token ids turn by turn, as NeMo-RL's ``get_formatted_message_log``
does it, and the helpers every processor shares (rendering, the prompt file, the length rule).

Each turn's text is what the chat template adds for it: the template renders the conversation up
to and including the turn, and the turn's text is that rendering past the point where it first
differs from the rendering of the turns before. Each turn's text is then encoded on its own, so
the ids are exactly NeMo-RL's (a token never spans two turns). The first turn gets the bos token
and the last the eos token when asked and the template did not write them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from string import Formatter
from typing import Any

from nemo_rl_offload.data.rows import DataRow
from nemo_rl_offload.data.tokenizer import ChatTokenizer
from nemo_rl_offload.errors import UserInputError

__all__ = [
    "Turn",
    "checked_messages",
    "cut_turns",
    "format_prompt",
    "formatted_turns",
    "messages_of",
    "render",
    "total_length",
]

# One turn: its role and its ids.
Turn = tuple[str, list[int]]


def checked_messages(value: Any, where: str, what: str, at_least: int = 1) -> list[dict[str, Any]]:
    """``value`` checked: a list of at least ``at_least`` messages, each with a string role
    (``what`` says whose, in the message)."""
    ok = isinstance(value, Sequence) and not isinstance(value, str) and len(value) >= at_least
    if ok and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in value):
        return [dict(m) for m in value]
    raise UserInputError(
        f"{where}: {what} must be a list of at least {at_least} messages each with a 'role' "
        "and a 'content'; fix the row (or the dataset's column mapping)"
    )


def messages_of(row: DataRow, key: str, processor: str, at_least: int = 1) -> list[dict[str, Any]]:
    """``row.datum[key]`` checked as :func:`checked_messages` does."""
    return checked_messages(row.datum.get(key), row.where, f"{processor}'s '{key}'", at_least)


def render(
    tokenizer: ChatTokenizer,
    row: DataRow,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Any = None,
    add_special_tokens: bool = False,
) -> str:
    """``messages`` rendered as text by the tokenizer's chat template, with the arguments
    NeMo-RL's processors pass; a template that refuses the row is one line naming the row."""
    kwargs: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "tokenize": False,
        "add_special_tokens": add_special_tokens,
    }
    if tools is not None:
        kwargs["tools"] = tools
    try:
        import jinja2

        template_errors: tuple[type[Exception], ...] = (jinja2.TemplateError, TypeError, ValueError)
    except ImportError:
        template_errors = (TypeError, ValueError)
    try:
        return str(tokenizer.apply_chat_template(messages, **kwargs))
    except UserInputError:
        raise
    except template_errors as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserInputError(
            f"{row.where}: the chat template cannot render this row ({reason}); fix the row or "
            "set policy.tokenizer.chat_template to a template that takes it"
        ) from None


def format_prompt(prompt: str, problem: Any, row: DataRow) -> str:
    """The prompt file's text with the problem in its ``{}`` (Python's ``str.format``, as
    NeMo-RL does). A prompt without a ``{}`` would drop the problem, so it is refused."""
    try:
        fields = [name for _, name, _, _ in Formatter().parse(prompt) if name is not None]
        if not fields:
            raise ValueError("it has no '{}'")
        return prompt.format(problem)
    except (IndexError, KeyError, ValueError) as exc:
        raise UserInputError(
            f"{row.where}: the task's prompt file cannot take the problem ({exc}); it needs one "
            "'{}' where the problem goes, with literal braces doubled ('{{', '}}')"
        ) from None


def _with_prompt(content: Any, prompt: str, row: DataRow) -> Any:
    if isinstance(content, str):
        return format_prompt(prompt, content, row)
    if isinstance(content, Sequence) and all(isinstance(p, Mapping) for p in content):
        parts = [dict(p) for p in content]
        for part in parts:
            if part.get("type") == "text":
                part["text"] = format_prompt(prompt, part.get("text"), row)
        return parts
    return format_prompt(prompt, content, row)


def _check_text_only(messages: list[dict[str, Any]], row: DataRow) -> None:
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, Sequence) and not isinstance(content, str):
            kinds = {p.get("type") for p in content if isinstance(p, Mapping)} - {"text"}
            if kinds:
                raise UserInputError(
                    f"{row.where}: message {index} has {', '.join(sorted(map(str, kinds)))} "
                    "content; images, audio and video need NeMo-RL's vision-language "
                    "processors, which are not supported (text parts only)"
                )


def formatted_turns(
    tokenizer: ChatTokenizer,
    row: DataRow,
    messages: list[dict[str, Any]],
    *,
    add_bos: bool = True,
    add_eos: bool = True,
    add_generation_prompt: bool = False,
    tools: Any = None,
) -> list[Turn]:
    """``messages`` as NeMo-RL's ``get_formatted_message_log`` tokenizes them: the task's prompt
    file formats the first user message (the first message when none is a user's), the
    generation prompt follows user and tool turns only (when asked), and each turn is the text
    its rendering adds (see the module's docstring). The task's system prompt is not added."""
    _check_text_only(messages, row)
    messages = list(messages)
    prompt = row.task.prompt
    if prompt:
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
        content = _with_prompt(messages[first].get("content"), prompt, row)
        messages[first] = {"role": "user", "content": content}
    turns: list[Turn] = []
    previous = ""
    for index, message in enumerate(messages):
        text = render(
            tokenizer,
            row,
            messages[: index + 1],
            add_generation_prompt=add_generation_prompt and message["role"] in ("user", "tool"),
            tools=tools,
        )
        chunk = text[len(os.path.commonprefix([previous, text])) :]
        bos = tokenizer.bos_token
        if index == 0 and add_bos and bos is not None and not chunk.startswith(bos):
            chunk = bos + chunk
        eos = tokenizer.eos_token
        last = index == len(messages) - 1
        if last and add_eos and eos is not None and not chunk.rstrip("\n").endswith(eos):
            chunk += eos
        turns.append((message["role"], tokenizer.encode(chunk)))
        previous = text
    return turns


def cut_turns(turns: list[Turn], keep: int) -> list[Turn]:
    """Each turn's first ``keep`` ids: NeMo-RL's cut of an example over the length limit, which
    keeps it in the data order with a zero loss multiplier."""
    return [(role, ids[:keep]) for role, ids in turns]


def total_length(turns: list[Turn]) -> int:
    return sum(len(ids) for _, ids in turns)
