"""NeMo-RL's conversation datasets as datum dicts (``messages`` and ``task_name``, and what
else each keeps): squad, HelpSteer3 for GRPO, the Tulu 3 SFT mixture, Nemotron-Cascade-2's
math SFT, OpenAssistant's trees, OpenAI-format files, ResponseDataset, and raw text
(arrow_text). Mappings follow nemo_rl/data/datasets/response_datasets/.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from typing import Any

from nemo_rl_offload.config.data_settings import DatasetEntry, is_hub_id
from nemo_rl_offload.config.nemo_rl_datasets import DatasetSpec
from nemo_rl_offload.data.nemo_rl.checks import (
    RowError,
    ends_with_assistant,
    key_fix,
    map_rows,
    messages,
    named_fix,
    require_columns,
    text,
)
from nemo_rl_offload.data.nemo_rl.math_problems import Rows, pair
from nemo_rl_offload.data.nemo_rl.sources import (
    Table,
    check_json,
    hub_file,
    open_entry,
    open_hub,
    open_path,
)
from nemo_rl_offload.data.nemo_rl.split import shuffled
from nemo_rl_offload.errors import UserInputError

__all__ = ["OASST_SYSTEM_PROMPT", "READERS"]

# oasst.py: the system turn NeMo-RL puts before every OpenAssistant conversation.
OASST_SYSTEM_PROMPT = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the user's questions.\n\n"
)


def _named_columns(entry: DatasetEntry, spec: DatasetSpec) -> Table:
    table = open_entry(entry, spec)
    require_columns(table, [(c, named_fix(entry, spec.columns)) for c in spec.columns])
    return table


def _squad(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    table = _named_columns(entry, spec)

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        answers = row.get("answers")
        found = answers.get("text") if isinstance(answers, dict) else None
        if not isinstance(found, list) or not found or not isinstance(found[0], str):
            raise RowError("'answers' has no text answer (answers.text[0])")
        return {
            "messages": [
                {"role": "system", "content": text(row, "context")},
                {"role": "user", "content": text(row, "question")},
                {"role": "assistant", "content": found[0]},
            ],
            "task_name": entry.task_name,
        }

    return map_rows(table, mapping)


def preferred(row: dict[str, Any]) -> tuple[str, str]:
    """HelpSteer3's (chosen, rejected): overall_preference below 0 prefers response1, above 0
    response2; at 0 both are response1 (NeMo-RL's rule: no better one is known)."""
    first, second = text(row, "response1"), text(row, "response2")
    preference = row.get("overall_preference")
    if isinstance(preference, bool) or not isinstance(preference, int | float):
        raise RowError("'overall_preference' is not a number")
    if preference < 0:
        return first, second
    if preference == 0:
        return first, first
    return second, first


def helpsteer3_context(row: dict[str, Any]) -> list[dict[str, Any]]:
    context = row.get("context")
    if isinstance(context, str):
        return [{"role": "user", "content": context}]
    return messages(context, "context")


def _helpsteer3(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    table = _named_columns(entry, spec)

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        chosen, _ = preferred(row)
        return {
            "context": helpsteer3_context(row),
            "response": [{"role": "assistant", "content": chosen}],
            "task_name": entry.task_name,
        }

    return map_rows(table, mapping)


def _sample(table: Table, entry: DatasetEntry) -> Table:
    """``max_samples`` rows drawn as NeMo-RL draws them (shuffle with the seed, first n)."""
    limit = entry.option("max_samples")
    if limit is None or limit <= 0:
        return table
    order = shuffled(len(table.rows), entry.seed)[: min(limit, len(table.rows))]
    return Table(
        [table.rows[i] for i in order], [table.where[i] for i in order], table.columns, table.label
    )


def _tulu3(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """The row as it is (less ``id`` and ``source``), with the task name."""
    table = _sample(_named_columns(entry, spec), entry)

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        ends_with_assistant(messages(row.get("messages"), "messages"), "messages")
        kept = {k: v for k, v in row.items() if k not in ("id", "source")}
        return {**kept, "task_name": entry.task_name}

    return map_rows(table, mapping)


def _cascade(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    table = _sample(_named_columns(entry, spec), entry)

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        conversation = messages(row.get("messages"), "messages")
        ends_with_assistant(conversation, "messages")
        return {"messages": conversation, "task_name": entry.task_name}

    return map_rows(table, mapping)


def _response_dataset(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """A file of input/output columns, or of ``messages`` kept as they are."""
    table = open_entry(entry, spec)
    if "messages" in table.columns:

        def keep(row: dict[str, Any]) -> dict[str, Any]:
            messages(row.get("messages"), "messages")
            return {**row, "task_name": entry.task_name}

        return map_rows(table, keep)
    inp, out = entry.input_key or "input", entry.output_key or "output"
    require_columns(
        table, [(inp, key_fix(entry, "input_key")), (out, key_fix(entry, "output_key"))]
    )

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        return pair(entry.task_name, text(row, inp), text(row, out))

    return map_rows(table, mapping)


def _openai_format(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """OpenAI-style conversations from a JSON-lines file. By default through ``datasets``,
    keeping every column (missing keys become null); with ``use_preserving_dataset`` each line
    as written, keeping only messages, task name and tools."""
    path = entry.data_path
    assert path is not None
    chat, tools = entry.option("chat_key"), entry.option("tool_key")
    system_key, system_prompt = entry.option("system_key"), entry.option("system_prompt")

    def conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
        turns = list(messages(row.get(chat), chat))
        if system_key is not None and system_key in row:
            turns = [{"role": "system", "content": row[system_key]}, *turns]
        elif system_prompt:
            turns = [{"role": "system", "content": system_prompt}, *turns]
        ends_with_assistant(turns, chat)
        return turns

    if entry.option("use_preserving_dataset"):
        table = _json_lines(path, entry)

        def preserve(row: dict[str, Any]) -> dict[str, Any]:
            result = {"messages": conversation(row), "task_name": entry.task_name}
            if tools and tools in row:
                result["tools"] = row[tools]
            return result

        return map_rows(table, preserve)
    table = open_path(path, entry)
    require_columns(table, [(chat, f"set {entry.key('chat_key')} to the key your file uses")])

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "messages": conversation(row), "task_name": entry.task_name}

    return map_rows(table, mapping)


def _json_lines(path: str, entry: DatasetEntry) -> Table:
    """A JSON-lines file read line by line, each row exactly as written."""
    where = check_json(path)
    if where is None:
        raise UserInputError(
            f"{entry.key('data_path')}: {path} is a JSON array; use_preserving_dataset reads "
            "JSON lines (one object per line)"
        )
    with open(path, encoding="utf-8-sig") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return Table(rows, where, tuple(dict.fromkeys(k for row in rows for k in row)), path)


def conversations(tree: dict[str, Any], first: bool = False) -> list[list[dict[str, Any]]]:
    """Every path from ``tree``'s root message to a leaf as a conversation (oasst.py's
    ``parse_conversations``): prompter turns as user, assistant turns as assistant."""
    turns = [{"content": OASST_SYSTEM_PROMPT, "role": "system"}] if first else []
    if "prompt" in tree:
        node = tree["prompt"]
    elif "text" in tree and "role" in tree:
        node = tree
    else:
        return [[]]
    roles = {"prompter": "user", "assistant": "assistant"}
    if node["role"] not in roles:
        raise RowError(f"unknown role {node['role']!r} in a message tree")
    turns.append({"content": node["text"], "role": roles[node["role"]]})
    below = [path for reply in node.get("replies", []) for path in conversations(reply)]
    return [turns + path for path in below] if below else [turns]


def _oasst(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """OpenAssistant's message trees (gzipped JSON lines), each cut into its conversations of
    more than the system turn and one message."""
    path = entry.data_path
    if path is None:
        assert spec.hub_id is not None and spec.hub_file is not None
        path = hub_file(spec.hub_id, spec.hub_file, entry)
    elif is_hub_id(path):
        assert spec.hub_file is not None
        path = hub_file(path, spec.hub_file, entry)
    opener: Callable[..., Any] = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            lines = handle.read().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(f"{entry.key('data_path')}: {path}: cannot be read ({exc})") from None
    rows: list[dict[str, Any]] = []
    where: list[str] = []
    problems: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            for turns in conversations(json.loads(line), first=True):
                if len(turns) > 2:
                    rows.append({"messages": turns, "task_name": entry.task_name})
                    where.append(f"{path}:{number}")
        except (ValueError, KeyError, TypeError, RowError) as exc:
            problems.append(f"{path}:{number}: not a message tree ({exc})")
    if problems:
        raise UserInputError(problems[:20])
    return rows, where


def _arrow_text(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """Raw text, one sample per row or rows packed until ``characters_per_sample``, as an
    assistant message (the cross-tokenizer distillation's data)."""
    files = entry.option("data_files")
    key = entry.option("text_key")
    if is_hub_id(files):
        table = open_hub(files, entry.subset, entry.split, entry)
    else:
        table = open_path(files, entry, configs=(entry.subset,), split=entry.split)
    require_columns(table, [(key, f"set {entry.key('text_key')} to the text column")])
    kept = [(row[key], w) for row, w in zip(table.rows, table.where, strict=True)]
    kept = [(value, w) for value, w in kept if isinstance(value, str) and value]
    limit = entry.option("characters_per_sample")

    def sample(content: str) -> dict[str, Any]:
        return {
            "messages": [{"role": "assistant", "content": content}],
            "task_name": entry.task_name,
        }

    if not limit or limit <= 0:
        return [sample(value) for value, _ in kept], [w for _, w in kept]
    rows: list[dict[str, Any]] = []
    where: list[str] = []
    buffer: list[str] = []
    size = 0
    for value, location in kept:
        if not buffer:
            start = location
        buffer.append(value)
        size += len(value)
        if size >= limit:
            rows.append(sample("\n".join(buffer)))
            where.append(start)
            buffer, size = [], 0
    if buffer:
        rows.append(sample("\n".join(buffer)))
        where.append(start)
    return rows, where


READERS: dict[str, Callable[[DatasetEntry, DatasetSpec], Rows]] = {
    "squad": _squad,
    "HelpSteer3": _helpsteer3,
    "tulu3_sft_mixture": _tulu3,
    "Nemotron-Cascade-2-SFT-Math": _cascade,
    "ResponseDataset": _response_dataset,
    "openai_format": _openai_format,
    "open_assistant": _oasst,
    "arrow_text": _arrow_text,
}
