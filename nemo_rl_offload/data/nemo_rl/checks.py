"""What a row must hold for its dataset's mapping, said as one line a user can act on."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from nemo_rl_offload.config.data_settings import DatasetEntry
from nemo_rl_offload.config.loader import yaml_type
from nemo_rl_offload.data.nemo_rl.sources import MAX_REPORTED, Table
from nemo_rl_offload.errors import UserInputError

__all__ = ["Column", "RowError", "map_rows", "messages", "require_columns", "text"]


class RowError(Exception):
    """What is wrong with one row (the caller adds where the row is)."""


# A column a mapping reads, and how to fix a file without it: "set data.train.input_key to
# the column your file uses", or the columns a copy of a named dataset has.
Column = tuple[str, str]


def _kind(value: Any) -> str:
    names = {"null": "null", "bool": "a boolean", "int": "a number", "float": "a number",
             "str": "text", "list": "a list", "dict": "an object"}  # fmt: skip
    return names.get(yaml_type(value), type(value).__name__)


def text(row: dict[str, Any], column: str) -> str:
    """``row[column]`` as text, else RowError."""
    value = row.get(column)
    if not isinstance(value, str):
        raise RowError(f"'{column}' is {_kind(value)}, expected text")
    return value


def messages(value: Any, column: str) -> list[dict[str, Any]]:
    """A conversation: a non-empty list of objects, each with a ``role``."""
    if not isinstance(value, list) or not value:
        raise RowError(f"'{column}' is {_kind(value)}, expected a list of messages")
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"'{column}'[{index}] is not a message (an object with a role)")
    return value


def ends_with_assistant(conversation: list[dict[str, Any]], column: str) -> None:
    if conversation[-1].get("role") != "assistant":
        raise RowError(
            f"'{column}' ends with a {conversation[-1].get('role')!r} message; a training "
            "conversation ends with the assistant's"
        )


def same(a: Any, b: Any) -> bool:
    """Equal as NeMo-RL compares conversations (their JSON)."""
    return json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def require_columns(table: Table, columns: Sequence[Column]) -> None:
    """Every column the mapping reads is in the table; all missing ones in one error."""
    missing = [
        f"{table.label}: no column '{name}' ({fix}); its columns: {', '.join(table.columns)}"
        for name, fix in columns
        if name not in table.columns
    ]
    if missing:
        raise UserInputError(missing)


def named_fix(entry: DatasetEntry, columns: Sequence[str]) -> str:
    return (
        f"a copy of {entry.dataset_name} given as {entry.where}.data_path has the hub's "
        f"columns: {', '.join(columns)}"
    )


def key_fix(entry: DatasetEntry, key: str) -> str:
    return f"set {entry.key(key)} to the column your file uses"


def map_rows(
    table: Table, mapping: Callable[[dict[str, Any]], dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Each row mapped, with its location; every bad row (up to a limit) in one error."""
    mapped: list[dict[str, Any]] = []
    where: list[str] = []
    problems: list[str] = []
    for row, location in zip(table.rows, table.where, strict=True):
        try:
            mapped.append(mapping(row))
            where.append(location)
        except RowError as problem:
            problems.append(f"{location}: {problem}")
    if problems:
        more = len(problems) - MAX_REPORTED
        tail = [f"{table.label}: {more} more bad rows"] if more > 0 else []
        raise UserInputError(problems[:MAX_REPORTED] + tail)
    return mapped, where


def first_row_columns(entry: DatasetEntry) -> list[Column]:
    """The columns a row of the entry's local file must have, as the first rows are checked
    before a run (data/file_checks.py); ResponseDataset's rows may hold ``messages`` instead."""
    from nemo_rl_offload.config.nemo_rl_datasets import spec_for

    name = entry.dataset_name
    if name == "ResponseDataset":
        return [(entry.input_key or "input", key_fix(entry, "input_key")),
                (entry.output_key or "output", key_fix(entry, "output_key"))]  # fmt: skip
    if name == "BinaryPreferenceDataset":
        return [(getattr(entry, key) or default, key_fix(entry, key))
                for key, default in (("prompt_key", "prompt"), ("chosen_key", "chosen"),
                                     ("rejected_key", "rejected"))]  # fmt: skip
    if name == "openai_format":
        return [
            (entry.option("chat_key"), f"set {entry.key('chat_key')} to the key your file uses")
        ]
    if name == "arrow_text":
        return [(entry.option("text_key"), f"set {entry.key('text_key')} to the text column")]
    spec = spec_for(name, entry.family)
    columns = list(spec.columns) if spec is not None else []
    if name == "OpenMathInstruct-2":
        columns.append(entry.output_key or "expected_answer")
    fix = (
        named_fix(entry, columns)
        if spec is not None and spec.hub_id
        else "see the dataset's format"
    )
    if name == "PreferenceDataset":
        fix = "a preference file has context and completions per row"
    return [(column, fix) for column in columns]
