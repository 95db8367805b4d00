"""Each dataset name's reader: an entry in, its datum dicts and their locations out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_rl_offload.config.data_settings import DatasetEntry
from nemo_rl_offload.config.nemo_rl_datasets import GYM, PREFERENCE, RESPONSE, DatasetSpec, Family
from nemo_rl_offload.data.nemo_rl import chat, math_problems, preference
from nemo_rl_offload.data.nemo_rl.math_problems import Rows

__all__ = ["reader", "readers"]


def _gym(entry: DatasetEntry, spec: DatasetSpec) -> Rows:
    """NeMo-Gym's rows, each the environment's info of one task (nemogym_dataset.py keeps the
    raw line for its processor to parse; here it is parsed and checked once)."""
    from nemo_rl_offload.data.nemo_gym_rows import load_gym_rows

    assert entry.data_path is not None
    rows = load_gym_rows(entry.data_path, entry.key("data_path"))
    datums: list[dict[str, Any]] = [
        {"extra_env_info": row, "task_name": entry.task_name} for row in rows
    ]
    where = [f"{entry.data_path}: row {index}" for index in range(1, len(rows) + 1)]
    times = entry.option("repeat") or 1
    return datums * times, where * times


_RESPONSE = {**math_problems.READERS, **chat.READERS}


def readers(family: Family) -> dict[str, Callable[[DatasetEntry, DatasetSpec], Rows]]:
    """The readers of one family, by dataset name."""
    if family == "preference":
        return dict(preference.READERS)
    if family == "nemo_gym":
        return {GYM.name: _gym}
    return dict(_RESPONSE)


def reader(entry: DatasetEntry) -> tuple[DatasetSpec, Callable[[DatasetEntry, DatasetSpec], Rows]]:
    table = {"preference": PREFERENCE, "response": RESPONSE}.get(entry.family, {GYM.name: GYM})
    spec = table[entry.dataset_name]
    return spec, readers(entry.family)[entry.dataset_name]
