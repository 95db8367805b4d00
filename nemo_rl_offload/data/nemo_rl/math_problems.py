"""NeMo-RL's math datasets as datum dicts: a user message with the problem and an assistant
message with the answer (the math environment's ground truth), and the task name.

Columns and mappings are those of nemo_rl/data/datasets/response_datasets/ (aime.py,
dapo_math.py, deepscaler.py, gsm8k.py, openmathinstruct2.py, numinamath.py, openr1_math.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_rl_offload.config.data_settings import DatasetEntry
from nemo_rl_offload.config.nemo_rl_datasets import DatasetSpec
from nemo_rl_offload.data.nemo_rl.checks import (
    RowError,
    key_fix,
    map_rows,
    named_fix,
    require_columns,
    text,
)
from nemo_rl_offload.data.nemo_rl.sources import Table, open_entry

__all__ = ["READERS", "Rows"]

Rows = tuple[list[dict[str, Any]], list[str]]
# numinamath.py: answers that are no answer (proofs, answers not recovered from the solution).
NON_VERIFIABLE_ANSWERS = frozenset({"proof", "notfound"})


def pair(task: str, problem: str, answer: Any) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": problem},
            {"role": "assistant", "content": answer},
        ],
        "task_name": task,
    }


def _problem_answer(
    problem: str, answer: str, *, cast: bool = False
) -> Callable[[DatasetEntry, DatasetSpec], Rows]:
    """A dataset whose rows hold the problem and the answer in two columns. ``cast``: the
    answer may be a number and is written as text (aime.py does, for AIME 2026)."""

    def read(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
        table = open_entry(entry, spec)
        require_columns(table, [(c, named_fix(entry, spec.columns)) for c in (problem, answer)])

        def mapping(row: dict[str, Any]) -> dict[str, Any]:
            value = row.get(answer)
            if cast and isinstance(value, int | float) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, str):
                text(row, answer)
            return pair(entry.task_name, text(row, problem), value)

        return _repeat(map_rows(table, mapping), entry)

    return read


def _repeat(rows: Rows, entry: DatasetEntry) -> Rows:
    """``repeat`` copies of the rows one after the other (``datasets``' ``repeat``)."""
    times = entry.option("repeat") or 1
    return rows[0] * times, rows[1] * times


def _dapo(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    table = open_entry(entry, spec)
    require_columns(table, [(c, named_fix(entry, spec.columns)) for c in spec.columns])

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        prompt = row.get("prompt")
        if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], dict):
            raise RowError("'prompt' is not a list of messages")
        reward = row.get("reward_model")
        truth = reward.get("ground_truth") if isinstance(reward, dict) else None
        if not isinstance(truth, str):
            raise RowError("'reward_model' has no ground_truth text")
        return pair(entry.task_name, text(prompt[0], "content"), truth)

    return map_rows(table, mapping)


def _gsm8k(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    table = open_entry(entry, spec)
    require_columns(table, [(c, named_fix(entry, spec.columns)) for c in spec.columns])
    extract = entry.option("extract_answer")

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        answer = text(row, "answer")
        if extract:
            if "####" not in answer:
                raise RowError(
                    f"'answer' has no '####' before the final answer; fix the row, or set "
                    f"{entry.key('extract_answer')}: false to keep the whole answer"
                )
            answer = answer.split("####")[1].strip()
        return pair(entry.task_name, text(row, "question"), answer)

    return map_rows(table, mapping)


def _openmathinstruct2(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    table = open_entry(entry, spec)
    output = entry.output_key or "expected_answer"
    require_columns(
        table,
        [
            ("problem", named_fix(entry, ("problem", output))),
            (output, key_fix(entry, "output_key")),
        ],
    )

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        return pair(entry.task_name, text(row, "problem"), text(row, output))

    return map_rows(table, mapping)


def _numinamath(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """Rows without a checkable answer or not marked valid are dropped first, by default."""
    table = open_entry(entry, spec)
    filters: list[tuple[str, Callable[[dict[str, Any]], bool]]] = []
    if entry.option("verifiable_only"):
        filters.append(("question_type", _verifiable))
    if entry.option("require_valid"):
        filters.append(("problem_is_valid", _marked_valid))
    columns = [*spec.columns, *(c for c, _ in filters)]
    if entry.option("require_valid"):
        columns.append("solution_is_valid")
    require_columns(table, [(c, named_fix(entry, columns)) for c in columns])
    kept = [i for i, row in enumerate(table.rows) if all(keep(row) for _, keep in filters)]
    table = Table(
        [table.rows[i] for i in kept], [table.where[i] for i in kept], table.columns, table.label
    )

    def mapping(row: dict[str, Any]) -> dict[str, Any]:
        return pair(entry.task_name, text(row, "problem"), text(row, "answer"))

    return map_rows(table, mapping)


def _verifiable(row: dict[str, Any]) -> bool:
    answer = (row.get("answer") or "").strip()
    if not answer or answer.lower() in NON_VERIFIABLE_ANSWERS:
        return False
    return (row.get("question_type") or "").strip().lower() != "proof"


def _marked_valid(row: dict[str, Any]) -> bool:
    return row.get("problem_is_valid") == "Yes" and row.get("solution_is_valid") == "Yes"


READERS: dict[str, Callable[[DatasetEntry, DatasetSpec], Rows]] = {
    "AIME2024": _problem_answer("problem", "answer", cast=True),
    "AIME2025": _problem_answer("question", "answer", cast=True),
    "AIME2026": _problem_answer("problem", "answer", cast=True),
    "DAPOMath17K": _dapo,
    "DAPOMathAIME2024": _dapo,
    "DeepScaler": _problem_answer("problem", "answer"),
    "gsm8k": _gsm8k,
    "GSM8K": _gsm8k,
    "OpenMathInstruct-2": _openmathinstruct2,
    "NuminaMath-1.5": _numinamath,
    "OpenR1-Math-220k": _problem_answer("problem", "answer"),
}
