"""Open a dataset entry's rows: a Hugging Face dataset from the local cache, or a local copy.

Everything goes through Hugging Face ``datasets`` as NeMo-RL loads it (the same column types,
the same null-filled keys), imported here only when an entry is loaded. The network is never
reached: the hub is switched offline for each call, so a dataset not in the cache is one line
saying how to provide it. Each row keeps where it came from (``path:line`` for JSON lines) for
messages about it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.data_settings import DatasetEntry, is_hub_id
from nemo_rl_offload.config.nemo_rl_datasets import DatasetSpec
from nemo_rl_offload.errors import UserInputError

__all__ = [
    "MAX_REPORTED",
    "Table",
    "check_json",
    "hub_file",
    "offline",
    "open_entry",
    "open_hub",
    "open_path",
]

MAX_REPORTED = 20
_TYPES = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
}
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@dataclass
class Table:
    """Rows as dicts, each row's location, the columns, and what the rows came from (a path or
    a dataset id, for messages about a missing column)."""

    rows: list[dict[str, Any]]
    where: list[str]
    columns: tuple[str, ...]
    label: str


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Hugging Face's hub switched off for the call: ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``
    set, and the flags ``datasets`` and ``huggingface_hub`` read at import set too (they read
    the variables only once)."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved_env = {name: os.environ.get(name) for name in _OFFLINE_VARIABLES}
    saved = (
        datasets.config.HF_HUB_OFFLINE,
        datasets.config.HF_DATASETS_OFFLINE,
        hub_constants.HF_HUB_OFFLINE,
    )
    os.environ.update(dict.fromkeys(_OFFLINE_VARIABLES, "1"))
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        (
            datasets.config.HF_HUB_OFFLINE,
            datasets.config.HF_DATASETS_OFFLINE,
            hub_constants.HF_HUB_OFFLINE,
        ) = saved


def not_available(entry: DatasetEntry, hub_id: str, filename: str | None = None) -> UserInputError:
    """The one line for a dataset that is neither in the cache nor given as a local copy."""
    key = entry.key("data_path") if entry.data_path else entry.key("dataset_name")
    fetch = (
        f"hf download {hub_id} {filename} --repo-type dataset"
        if filename
        else f"datasets.load_dataset('{hub_id}')"
    )
    return UserInputError(
        f"{key}: {entry.dataset_name} ({hub_id}) is not on this machine and this backend does "
        f"not download; put it in the Hugging Face cache (run {fetch} once where there is "
        f"network, with the same HF_HOME), or give a local copy as {entry.where}.data_path"
    )


def open_entry(entry: DatasetEntry, spec: DatasetSpec) -> Table:
    """The entry's rows before its dataset's mapping: from ``data_path`` (a local copy, or a
    dataset id of the cache), else from the dataset's hub id in the cache."""
    configs = (entry.subset,) if "subset" in spec.reads else spec.hub_configs
    split = entry.split if "split" in spec.reads else spec.hub_split
    named = spec.hub_id is not None
    path = entry.data_path
    if path is not None and not is_hub_id(path):
        return open_path(path, entry, configs=configs, split=split, one_split_is_it=named)
    hub_id = path or spec.hub_id
    assert hub_id is not None
    tables = [open_hub(hub_id, config, split, entry) for config in configs]
    return _concatenate(tables, hub_id)


def _concatenate(tables: list[Table], label: str) -> Table:
    if len(tables) == 1:
        return tables[0]
    columns = tuple(dict.fromkeys(c for table in tables for c in table.columns))
    return Table(
        [row for table in tables for row in table.rows],
        [where for table in tables for where in table.where],
        columns,
        label,
    )


def open_hub(hub_id: str, config: str | None, split: str | None, entry: DatasetEntry) -> Table:
    import datasets

    with offline():
        try:
            loaded = datasets.load_dataset(hub_id, config)
        except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError):
            snapshot = _hub_snapshot(hub_id)
            if snapshot is None:
                raise not_available(entry, hub_id) from None
            loaded = _load(lambda: datasets.load_dataset(snapshot, config), entry, hub_id)
        except ValueError as exc:
            raise _config_problem(exc, entry, hub_id, config) from None
    dataset = _pick_split(loaded, split, entry, hub_id, one_split_is_it=False)
    return _table(dataset, None, hub_id)


def _hub_snapshot(hub_id: str) -> str | None:
    """A snapshot of the dataset's repository in the hub cache (``hf download``), newest first:
    ``datasets`` offline reads only what it prepared itself, so this is tried after it."""
    import huggingface_hub.constants as hub_constants

    repo = Path(hub_constants.HF_HUB_CACHE) / f"datasets--{hub_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip()).is_dir():
        return str(repo / "snapshots" / ref.read_text().strip())
    snapshots = sorted((repo / "snapshots").glob("*"), key=os.path.getmtime, reverse=True)
    return str(snapshots[0]) if snapshots else None


def hub_file(hub_id: str, filename: str, entry: DatasetEntry) -> str:
    """One file of a dataset repository from the hub cache (NeMo-RL's ``hf_hub_download``)."""
    from huggingface_hub import try_to_load_from_cache

    with offline():
        found = try_to_load_from_cache(hub_id, filename, repo_type="dataset")
    if not isinstance(found, str):
        raise not_available(entry, hub_id, filename)
    return found


def _config_problem(
    exc: ValueError, entry: DatasetEntry, label: str, config: str | None
) -> UserInputError:
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    key = entry.key("subset") if config is not None else entry.where
    return UserInputError(f"{key}: {label}: {message}")


def _load(call: Any, entry: DatasetEntry, label: str) -> Any:
    """Run a ``datasets`` load, its failure as one line naming the entry and the source."""
    try:
        return call()
    except UserInputError:
        raise
    except Exception as exc:  # datasets and pyarrow raise many types for a bad file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserInputError(
            f"{entry.where}: {label}: cannot be read as a dataset ({first}); fix the file or "
            "give another"
        ) from None


def _pick_split(
    loaded: Any, split: str | None, entry: DatasetEntry, label: str, *, one_split_is_it: bool
) -> Any:
    """NeMo-RL picks ``split`` (else ``train`` when there is one). A local copy of a named
    dataset with a single split is taken as the split asked for."""
    import datasets

    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    names = list(loaded)
    if one_split_is_it and len(names) == 1:
        return loaded[names[0]]
    wanted = split if split is not None else "train"
    if wanted in loaded:
        return loaded[wanted]
    key = entry.key("split")
    raise UserInputError(
        f"{key}: {wanted!r} is not a split of {label}; its splits are {', '.join(names)}"
    )


def open_path(
    path: str,
    entry: DatasetEntry,
    *,
    configs: tuple[str | None, ...] = (None,),
    split: str | None = None,
    one_split_is_it: bool = False,
) -> Table:
    """A local file (by its suffix), a glob of files, a ``save_to_disk`` directory, or a
    directory of data files (a dataset repository's layout)."""
    import datasets

    suffix = Path(path).suffix.lower()
    key = entry.key("data_path") if entry.data_path == path else entry.key("data_files")
    if os.path.isfile(path) or (glob.has_magic(path) and suffix in _TYPES):
        if suffix not in _TYPES:
            raise UserInputError(
                f"{key}: {path}: a {suffix or 'suffix-less'} file; give a .jsonl, .json, "
                ".parquet, .csv or .arrow file, or a directory"
            )
        if not one_split_is_it and entry.subset is not None:  # NeMo-RL asserts the same
            raise UserInputError(
                f"{entry.key('subset')}: only a Hugging Face dataset has subsets; remove it "
                f"for the local file {path}"
            )
        lines = check_json(path) if suffix in (".json", ".jsonl") and os.path.isfile(path) else None
        with offline():
            loaded = _load(
                lambda: datasets.load_dataset(_TYPES[suffix], data_files=path), entry, path
            )
        dataset = _pick_split(loaded, split, entry, path, one_split_is_it=one_split_is_it)
        return _table(dataset, lines, path)
    if os.path.isdir(path):
        saved = any((Path(path) / name).is_file() for name in ("dataset_dict.json", "state.json"))
        tables = []
        for config in (None,) if saved else configs:
            with offline():
                if saved:
                    loaded = _load(lambda: datasets.load_from_disk(path), entry, path)
                else:
                    loaded = _load(lambda c=config: datasets.load_dataset(path, c), entry, path)
            dataset = _pick_split(loaded, split, entry, path, one_split_is_it=one_split_is_it)
            tables.append(_table(dataset, None, path))
        return _concatenate(tables, path)
    raise UserInputError(
        f"{key}: {path}: no such file or directory; give the local copy's path (a relative "
        "path is read from the directory the command runs in)"
    )


def _table(dataset: Any, lines: list[str] | None, label: str) -> Table:
    rows = dataset.to_list()
    where = lines if lines is not None and len(lines) == len(rows) else None
    if where is None:
        where = [f"{label}: row {index}" for index in range(1, len(rows) + 1)]
    return Table(rows, where, tuple(dataset.column_names), label)


def check_json(path: str) -> list[str] | None:
    """Every JSON problem of ``path`` at once (``path:line``), before ``datasets`` gives one
    opaque error; the location of each row (None for a JSON array: its rows have no line)."""
    with open(path, "rb") as handle:
        data = handle.read()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserInputError(
            f"{path}: not valid UTF-8 (byte {exc.start + 1}); save the file as UTF-8"
        ) from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserInputError(
                f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        bad = [i for i, row in enumerate(rows, start=1) if not isinstance(row, dict)]
        if bad:
            raise UserInputError(
                [f"{path}: row {i}: expected a JSON object" for i in bad[:MAX_REPORTED]]
            )
        return None
    where: list[str] = []
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(row, dict):
            problems.append(f"{path}:{number}: expected a JSON object")
        where.append(f"{path}:{number}")
    if problems:
        more = len(problems) - MAX_REPORTED
        shown = problems[:MAX_REPORTED] + ([f"{path}: {more} more bad lines"] if more > 0 else [])
        raise UserInputError(shown)
    if not where:
        raise UserInputError(f"{path}: holds no rows; give a file with at least one")
    return where
