"""JSON-lines loaders for user data: SFT pairs, preference pairs, prompts with answers.

Each loader maps the file's keys (named in the recipe's ``data`` section) to canonical keys, so
the trainers never see user key names. Every problem in a file is collected and reported at once,
each as ``<path>:<line>: ...``, because a user with a bad export usually has many bad lines and
should not have to fix them one run at a time. Each returned example also carries ``line``, its
1-based line in the file, so later checks (sequence length) can point at the same line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from nemo_rl_offload.errors import UserInputError

__all__ = ["MAX_REPORTED_LINES", "load_preference", "load_prompts", "load_sft"]

MAX_REPORTED_LINES = 20

_JSON_TYPE_NAMES = {
    type(None): "null",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "an array",
    dict: "an object",
}


def _type_name(value: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _read_lines(path: str, where: str) -> list[bytes]:
    if not os.path.exists(path):
        raise UserInputError(f"{path}: no such file ({where})")
    if os.path.isdir(path):
        raise UserInputError(f"{path}: is a directory, expected a JSON-lines file ({where})")
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise UserInputError(f"{path}: cannot be read ({exc.strerror}) ({where})") from None
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some editors write
        data = data[3:]
    return data.splitlines()


def _parse_line(
    raw: bytes, keys: Mapping[str, tuple[str, str]]
) -> tuple[dict[str, str] | None, list[str]]:
    """One line to a canonical example, or the problems with it (messages without location)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, [f"not valid UTF-8 (byte {exc.start + 1}); save the file as UTF-8"]
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [f"not valid JSON ({exc.msg} at column {exc.colno})"]
    if not isinstance(record, dict):
        return None, [f"expected a JSON object, got {_type_name(record)}"]
    problems: list[str] = []
    example: dict[str, str] = {}
    for canonical, (file_key, recipe_key) in keys.items():
        if file_key not in record:
            problems.append(
                f"missing key '{file_key}' (set {recipe_key} to the key your file uses)"
            )
        elif not isinstance(record[file_key], str):
            problems.append(
                f"'{file_key}' is {_type_name(record[file_key])}, expected a string; "
                "quote the value"
            )
        else:
            example[canonical] = record[file_key]
    return (None, problems) if problems else (example, [])


def _load(path: str, where: str, keys: Mapping[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """Read ``path``; ``keys`` maps canonical key -> (key in the file, recipe key that names it)."""
    path = os.fspath(path)
    examples: list[dict[str, Any]] = []
    problems: list[str] = []
    bad_lines = 0
    for number, raw in enumerate(_read_lines(path, where), start=1):
        if not raw.strip():
            continue
        example, line_problems = _parse_line(raw, keys)
        if line_problems:
            bad_lines += 1
            if bad_lines <= MAX_REPORTED_LINES:
                problems.extend(f"{path}:{number}: {p}" for p in line_problems)
        elif example is not None:
            examples.append({**example, "line": number})
    if bad_lines > MAX_REPORTED_LINES:
        hidden = bad_lines - MAX_REPORTED_LINES
        problems.append(f"{path}: {hidden} more bad line{'s' * (hidden != 1)} not shown")
    if problems:
        raise UserInputError(problems)
    if not examples:
        raise UserInputError(f"{path}: no examples ({where} needs at least one JSON line)")
    return examples


def load_sft(
    path: str, *, where: str, input_key: str = "input", output_key: str = "output"
) -> list[dict[str, Any]]:
    """``{"prompt", "response", "line"}`` examples; ``where`` is the recipe key naming ``path``."""
    keys = {
        "prompt": (input_key, "data.input_key"),
        "response": (output_key, "data.output_key"),
    }
    return _load(path, where, keys)


def load_preference(
    path: str,
    *,
    where: str,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
) -> list[dict[str, Any]]:
    """``{"prompt", "chosen", "rejected", "line"}`` examples for DPO."""
    keys = {
        "prompt": (prompt_key, "data.prompt_key"),
        "chosen": (chosen_key, "data.chosen_key"),
        "rejected": (rejected_key, "data.rejected_key"),
    }
    return _load(path, where, keys)


def load_prompts(
    path: str, *, where: str, prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[dict[str, Any]]:
    """``{"prompt", "answer", "line"}`` examples for GRPO and distillation."""
    keys = {
        "prompt": (prompt_key, "data.prompt_key"),
        "answer": (answer_key, "data.answer_key"),
    }
    return _load(path, where, keys)
