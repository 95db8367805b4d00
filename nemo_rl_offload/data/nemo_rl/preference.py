"""NeMo-RL's preference datasets (DPO) as datum dicts: ``context`` (the conversation before
the answers), ``completions`` (rank 0 the chosen answer, rank 1 the rejected one, each a list of
messages) and ``task_name``. Mappings follow nemo_rl/data/datasets/preference_datasets/.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_rl_offload.config.data_settings import DatasetEntry
from nemo_rl_offload.config.nemo_rl_datasets import DatasetSpec
from nemo_rl_offload.data.nemo_rl.chat import helpsteer3_context, preferred
from nemo_rl_offload.data.nemo_rl.checks import (
    RowError,
    key_fix,
    map_rows,
    messages,
    named_fix,
    require_columns,
    same,
    text,
)
from nemo_rl_offload.data.nemo_rl.math_problems import Rows
from nemo_rl_offload.data.nemo_rl.sources import open_entry

__all__ = ["READERS", "pair_of"]


def pair_of(task: str, context: list[dict[str, Any]], chosen: Any, rejected: Any) -> dict[str, Any]:
    return {
        "context": context,
        "completions": [
            {"rank": 0, "completion": [{"role": "assistant", "content": chosen}]},
            {"rank": 1, "completion": [{"role": "assistant", "content": rejected}]},
        ],
        "task_name": task,
    }


def _helpsteer3(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    table = open_entry(entry, spec)
    require_columns(table, [(c, named_fix(entry, spec.columns)) for c in spec.columns])

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        chosen, rejected = preferred(row)
        return pair_of(entry.task_name, helpsteer3_context(row), chosen, rejected)

    return map_rows(table, mapping)


def _tulu3(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """Two conversations that differ only in the last, assistant, message."""
    table = open_entry(entry, spec)
    require_columns(table, [(c, named_fix(entry, spec.columns)) for c in spec.columns])

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        chosen = messages(row.get("chosen"), "chosen")
        rejected = messages(row.get("rejected"), "rejected")
        if not same(chosen[:-1], rejected[:-1]):
            raise RowError("'chosen' and 'rejected' differ before their last message")
        for name, conversation in (("chosen", chosen), ("rejected", rejected)):
            if conversation[-1].get("role") != "assistant":
                raise RowError(f"'{name}' does not end with the assistant's message")
        return pair_of(
            entry.task_name, chosen[:-1], chosen[-1].get("content"), rejected[-1].get("content")
        )

    return map_rows(table, mapping)


def _binary(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """Prompt, chosen and rejected columns; a prompt that is a list is the conversation."""
    table = open_entry(entry, spec)
    keys = {"prompt_key": entry.prompt_key, "chosen_key": entry.chosen_key,
            "rejected_key": entry.rejected_key}  # fmt: skip
    require_columns(table, [(column, key_fix(entry, key)) for key, column in keys.items()])
    prompt, chosen, rejected = keys.values()

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        value = row.get(prompt)
        context = (
            messages(value, prompt)
            if isinstance(value, list)
            else [{"role": "user", "content": text(row, prompt)}]
        )
        return pair_of(entry.task_name, context, text(row, chosen), text(row, rejected))

    return map_rows(table, mapping)


def _preference(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """Rows already in the datum's shape, kept as they are with the task name."""
    table = open_entry(entry, spec)
    fix = "a preference file has context (messages) and completions (rank, completion) per row"
    require_columns(table, [(c, fix) for c in spec.columns])

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        messages(row.get("context"), "context")
        completions = row.get("completions")
        if not isinstance(completions, list) or len(completions) < 2:
            raise RowError("'completions' is not a list of at least two ranked completions")
        for index, completion in enumerate(completions):
            if not isinstance(completion, dict) or "rank" not in completion:
                raise RowError(f"'completions'[{index}] has no rank")
            messages(completion.get("completion"), f"completions[{index}].completion")
        return {**row, "task_name": entry.task_name}

    return map_rows(table, mapping)


READERS: dict[str, Callable[[DatasetEntry, DatasetSpec], Rows]] = {
    "HelpSteer3": _helpsteer3,
    "Tulu3Preference": _tulu3,
    "BinaryPreferenceDataset": _binary,
    "PreferenceDataset": _preference,
}
