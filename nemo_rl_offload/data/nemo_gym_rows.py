"""NeMo-Gym's data rows (NeMo-RL's ``NemoGymDataset``): JSON lines, each a task for an agent.

A row carries ``responses_create_params`` (the first request: ``input`` messages, ``tools``,
...) and ``agent_ref.name`` (the agent that runs it, a top-level server name of
``env.nemo_gym.config_paths``); anything else in the row is the environment's own (answers,
verifier settings) and goes to the agent as it is. NeMo-RL's recipes name the files as
``data.train.data_path`` and ``data.validation.data_path``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_rl_offload.errors import UserInputError

__all__ = ["gym_data_path", "load_gym_rows", "parse_row"]

_MAX_REPORTED = 20


def gym_data_path(data_cfg: Mapping[str, Any], split: str) -> str | None:
    """``data.train.data_path`` or ``data.validation.data_path`` (None: no validation rows)."""
    key = "train" if split == "train" else "validation"
    section = data_cfg.get(key)
    path = section.get("data_path") if isinstance(section, Mapping) else None
    if path is None and split == "train":
        raise UserInputError(
            "data.train.data_path: required for NeMo-Gym rows; give the JSON-lines file of "
            "the tasks (responses_create_params and agent_ref per line)"
        )
    return path


def parse_row(line: str) -> tuple[dict[str, Any] | None, str | None]:
    """One line of a rows file: (the row, None), or (None, what is wrong with it)."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        return None, f"not JSON ({exc.msg})"
    if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
        return None, "no responses_create_params object (the request)"
    agent = row.get("agent_ref")
    if not isinstance(agent, dict) or not isinstance(agent.get("name"), str):
        return None, (
            "no agent_ref.name (the agent that runs the row: a server name of "
            "env.nemo_gym.config_paths); add it, as NeMo-Gym's data preparation does"
        )
    return row, None


def load_gym_rows(path: str, where: str) -> list[dict[str, Any]]:
    """Every row of ``path``, each checked for what an agent needs; all problems at once."""
    file = Path(path)
    if not file.is_file():
        raise UserInputError(f"{where}: {path} is not a file; give the NeMo-Gym rows' file")
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row, problem = parse_row(line)
        if row is None:
            problems.append(f"{path}:{number}: {problem}")
            continue
        rows.append(row)
    if len(problems) > _MAX_REPORTED:
        problems = [*problems[:_MAX_REPORTED], f"{path}: {len(problems) - _MAX_REPORTED} more"]
    if problems:
        raise UserInputError(problems)
    if not rows:
        raise UserInputError(f"{where}: {path} holds no rows")
    return rows
