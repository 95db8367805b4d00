"""The data files a recipe names, opened before anything starts: each exists, is readable, and
its first rows parse as the run's loader will read them.

``validate`` and the check before a run call :func:`problems` (through preflight), so a missing
file or a broken first row is one line naming the recipe key, the path and the row, in
seconds rather than after the workers start. Only the first :data:`FIRST_ROWS` rows are read
(a data file may be large); the loaders (:mod:`.jsonl`, :mod:`.nemo_gym_rows`) still check
every row when the run reads the file. The files are the ones this backend reads:
``data.train_data_path`` and ``data.val_data_path`` with ``dataset_name: jsonl``, NeMo-Gym's
rows (``data.train.data_path``, ``data.validation.data_path``) with ``env.should_use_nemo_gym``,
and the local files of NeMo-RL's dataset entries (each entry's ``data_path``, arrow_text's
``data_files``; a Hugging Face dataset id is the loader's to find in the cache). Relative paths
are read from the directory the command runs in, as the loaders read them.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nemo_rl_offload.data import jsonl, nemo_gym_rows

__all__ = ["FIRST_ROWS", "problems"]

FIRST_ROWS = 5
# A row longer than this is not read here (the loader reads it whole when the run starts).
_MAX_ROW_BYTES = 16 * 2**20

# The example keys each algorithm's loader maps (datasets.load_split's kinds): canonical key
# -> (recipe key naming the file's key, its default).
_EXAMPLE_KEYS = {
    "sft": {"prompt": ("input_key", "input"), "response": ("output_key", "output")},
    "dpo": {
        "prompt": ("prompt_key", "prompt"),
        "chosen": ("chosen_key", "chosen"),
        "rejected": ("rejected_key", "rejected"),
    },
    "grpo": {"prompt": ("prompt_key", "prompt"), "answer": ("answer_key", "answer")},
    "distillation": {"prompt": ("prompt_key", "prompt"), "answer": ("answer_key", "answer")},
}

Row = Callable[[bytes], str | None]  # a row's problem, or None


def _first_rows(handle: Any) -> tuple[list[tuple[int, bytes]], bool]:
    """(line number, bytes) of the first non-blank rows, up to :data:`FIRST_ROWS`, and whether
    the file ended before them (an empty file has no rows)."""
    rows: list[tuple[int, bytes]] = []
    for number in itertools.count(1):
        raw = handle.readline(_MAX_ROW_BYTES)
        if not raw:
            return rows, True
        if len(raw) == _MAX_ROW_BYTES and not raw.endswith(b"\n"):
            return rows, False  # a row this long is the loader's to read
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a byte-order mark, as jsonl
            raw = raw[3:]
        if raw.strip():
            rows.append((number, raw.rstrip(b"\r\n")))
            if len(rows) == FIRST_ROWS:
                return rows, False
    raise AssertionError("unreachable")


def _check_file(where: str, path: str, row_problem: Row, what: str) -> str | None:
    """The one line for ``path`` (named by ``where``): the file, or its first bad row."""
    if not os.path.exists(path):
        return (
            f"{where}: {path}: no such file; give the path of {what} (a relative path is read "
            f"from {os.getcwd()})"
        )
    if os.path.isdir(path):
        return f"{where}: {path}: is a directory; give the path of {what}"
    try:
        with open(path, "rb") as handle:
            rows, ended = _first_rows(handle)
    except OSError as exc:
        return f"{where}: {path}: cannot be read ({exc.strerror}); make it readable"
    if not rows and ended:
        return f"{where}: {path}: holds no rows; give {what} with at least one row"
    for number, raw in rows:
        problem = row_problem(raw)
        if problem is not None:
            return f"{where}: {path}:{number}: {problem}"
    return None


def _example_row(keys: Mapping[str, tuple[str, str]]) -> Row:
    def problem(raw: bytes) -> str | None:
        found = jsonl._parse_line(raw, keys)[1]
        return "; ".join(found) if found else None

    return problem


def _gym_row(raw: bytes) -> str | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not valid UTF-8 (byte {exc.start + 1}); save the file as UTF-8"
    return nemo_gym_rows.parse_row(text)[1]


_DATASET_FILE = "the dataset (a JSON-lines, JSON, Parquet or CSV file, or a directory)"


def _dataset_row(columns: list[tuple[str, str]], messages_instead: bool) -> Row:
    """A first row of a NeMo-RL entry's JSON-lines file: an object with the entry's columns
    (ResponseDataset's may hold ``messages`` instead)."""

    def problem(raw: bytes) -> str | None:
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return f"not valid UTF-8 (byte {exc.start + 1}); save the file as UTF-8"
        except json.JSONDecodeError as exc:
            return f"not valid JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(row, dict):
            return "expected a JSON object"
        if messages_instead and "messages" in row:
            return None
        missing = [f"missing key '{name}' ({fix})" for name, fix in columns if name not in row]
        return "; ".join(missing) or None

    return problem


def _no_rows(raw: bytes) -> str | None:
    return None


def _dataset_files(recipe: Mapping[str, Any], algorithm: str) -> list[tuple[str, Any, Row, str]]:
    """(recipe key, path, row check, what) of the local files of NeMo-RL's dataset entries;
    rows are checked for JSON lines only (a JSON array, Parquet or CSV is the loader's)."""
    from nemo_rl_offload.config.data_settings import dataset_entries, is_hub_id
    from nemo_rl_offload.data.nemo_rl.checks import first_row_columns

    files: list[tuple[str, Any, Row, str]] = []
    for entry in dataset_entries(recipe, base_dir=Path.cwd(), algorithm=algorithm or None):
        if entry.family == "nemo_gym":
            continue  # NeMo-Gym's rows: checked with env.should_use_nemo_gym
        for key, path in (
            ("data_path", entry.data_path),
            ("data_files", entry.option("data_files")),
        ):
            if not isinstance(path, str) or is_hub_id(path) or "${" in path or glob.has_magic(path):
                continue
            check = _no_rows
            if path.endswith(".jsonl") or (path.endswith(".json") and not _json_array(path)):
                check = _dataset_row(
                    first_row_columns(entry), entry.dataset_name == "ResponseDataset"
                )
            files.append((entry.key(key), path, check, _DATASET_FILE))
    return files


def _json_array(path: str) -> bool:
    """Whether a .json file holds one JSON array (rows without lines of their own)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
    except OSError:
        return False


def _files(recipe: Mapping[str, Any], algorithm: str, gym: bool) -> list[tuple[str, Any, Row, str]]:
    """(recipe key, path, row check, what the file is) of each data file the run reads."""
    data = recipe["data"]
    if gym:
        sections = (("data.train.data_path", "train"), ("data.validation.data_path", "validation"))
        return [
            (where, section.get("data_path"), _gym_row, "a JSON-lines file of NeMo-Gym rows")
            for where, key in sections
            if isinstance(section := data.get(key), Mapping) and section.get("data_path")
        ]
    if data.get("dataset_name") is None and data.get("train") is not None:
        return _dataset_files(recipe, algorithm)
    if data.get("dataset_name") != "jsonl" or algorithm not in _EXAMPLE_KEYS:
        return []
    keys = {
        canonical: (data.get(key, default), f"data.{key}")
        for canonical, (key, default) in _EXAMPLE_KEYS[algorithm].items()
    }
    if not all(isinstance(name, str) for name, _ in keys.values()):
        return []  # a key name that is not text is the schema's to report
    check = _example_row(keys)
    what = "a JSON-lines file"
    return [
        (f"data.{key}", data.get(key), check, what)
        for key in ("train_data_path", "val_data_path")
        if data.get(key) is not None
    ]


def problems(
    recipe: Mapping[str, Any], algorithm: str, *, starting: bool
) -> tuple[list[str], list[str]]:
    """(errors, warnings): one line per data file the run would fail to read. A file that is
    not on this machine is a warning for ``validate`` (``starting`` False: a recipe written for
    a cluster names its files there) and an error for a run."""
    from nemo_rl_offload.config import nemo_gym

    data = recipe.get("data")
    if not isinstance(data, Mapping):
        return [], []
    gym = nemo_gym.enabled(recipe) and algorithm in ("grpo", "distillation")
    found: list[str] = []
    absent: list[str] = []
    if not gym and data.get("dataset_name") == "jsonl" and data.get("train_data_path") is None:
        found.append(
            "data.train_data_path: required when data.dataset_name is 'jsonl'; set it to a "
            "JSON-lines file"
        )
    train = data.get("train")
    named = isinstance(train, Mapping) and train.get("data_path") is not None
    if gym and nemo_gym.uses_gym_rows(data) and not named:
        found.append(
            "data.train.data_path: required for NeMo-Gym rows; give the JSON-lines file of "
            "the tasks (responses_create_params and agent_ref per line)"
        )
    for where, path, row_problem, what in _files(recipe, algorithm, gym):
        if not isinstance(path, str):
            continue  # the schema reports a path that is not text
        if what == _DATASET_FILE and os.path.isdir(path):
            continue  # a save_to_disk directory or a dataset's files: the loader opens it
        line = _check_file(where, path, row_problem, what)
        if line is None:
            continue
        if os.path.exists(path) or starting:
            found.append(line)
        else:
            absent.append(f"warning: {line}; not on this machine: a run checks it at start")
    return found, absent
