"""One dataset entry of NeMo-RL's ``data.train`` / ``data.validation`` resolved: the entry with
``data.default`` merged in as NeMo-RL merges it (``update_single_dataset_config``: a key the
entry sets, even to null, stays), checked against the dataset's name and keys
(config/nemo_rl_datasets.py). config/data_settings.py resolves the whole section with it.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.loader import yaml_type
from nemo_rl_offload.config.nemo_rl_datasets import (
    BEHAVIOURAL_KEYS,
    COMMON_KEYS,
    GYM,
    MULTIMODAL,
    PREFERENCE,
    RESPONSE,
    DatasetSpec,
    Family,
    spec_for,
)
from nemo_rl_offload.config.processor_names import processor_problem

__all__ = [
    "DEFAULT_SEED",
    "REWARDED_ALGORITHMS",
    "DatasetEntry",
    "EntryContext",
    "Found",
    "is_hub_id",
    "resolve_data_path",
    "resolve_entries",
]

DEFAULT_SEED = 42
# Algorithms whose NeMo-RL data setup binds each dataset to an environment (env_name).
REWARDED_ALGORITHMS = ("grpo", "distillation", "ppo")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt", ".gz")
# NeMo-RL's media keys of a dataset entry (vision and audio datasets read them).
_MEDIA_KEYS = (
    "num_frames",
    "video_sampling_style",
    "video_target_num_patches",
    "video_temporal_patch_size",
    "video_maintain_aspect_ratio",
    "min_generation_tokens",
)


@dataclass(frozen=True)
class DatasetEntry:
    """One dataset of ``data.train`` / ``data.validation`` with ``data.default`` merged in.

    ``where`` is the entry's recipe key (``data.train``, ``data.train[1]``). Keys the dataset
    does not read are None; the ones it reads hold the value in effect (the recipe's, else the
    dataset's default). ``data_path`` is a local path made absolute from ``base_dir`` when it is
    relative, or a Hugging Face dataset id as written. ``prompt_file`` and
    ``system_prompt_file`` are resolved as NeMo-RL reads them, from the working directory
    (``base_dir``; NeMo-RL's recipes name them from its repository's root), then from each
    directory above the recipe file and the files its ``defaults:`` reach. ``extra`` holds the
    dataset's own keys (``repeat``, ``max_samples`` ...) with their values in effect, sorted;
    ``defaulted`` the keys taken from ``data.default``.
    """

    where: str
    dataset_name: str
    family: Family
    task_name: str
    data_path: str | None = None
    input_key: str | None = None
    output_key: str | None = None
    prompt_key: str | None = None
    chosen_key: str | None = None
    rejected_key: str | None = None
    subset: str | None = None
    split: str | None = None
    split_validation_size: float = 0
    seed: int = DEFAULT_SEED
    download_dir: str | None = None
    prompt_file: str | None = None
    system_prompt_file: str | None = None
    processor: str = "default"
    env_name: str | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    defaulted: tuple[str, ...] = ()

    def key(self, name: str) -> str:
        """The recipe key that set ``name`` for this entry (``data.default.x`` when taken from
        the default), for messages that say what to change."""
        return f"data.default.{name}" if name in self.defaulted else f"{self.where}.{name}"

    def option(self, name: str) -> Any:
        """A dataset-specific key's value in effect (None when the dataset has no such key)."""
        return dict(self.extra).get(name)


@dataclass
class Found:
    """What resolution found: errors, warnings, prompt files not on this machine, and the
    entries that resolved (file checks use them even when others did not)."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    entries: list[DatasetEntry] = field(default_factory=list)


@dataclass(frozen=True)
class EntryContext:
    algorithm: str | None
    family: Family
    gym: bool
    dirs: tuple[Path, ...]
    base_dir: Path


# ------------------------------------------------------------------------------ the entries


def resolve_entries(
    value: Any, where: str, default: Mapping[str, Any], context: EntryContext, found: Found
) -> tuple[DatasetEntry, ...]:
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = [(where, value)]
    elif isinstance(value, list):
        if context.family == "preference":
            found.errors.append(
                f"{where}: DPO reads one dataset here (NeMo-RL's preference data setup loads "
                "one mapping); give one mapping, not a list"
            )
            return ()
        items = [(f"{where}[{index}]", item) for index, item in enumerate(value)]
    else:
        found.errors.append(
            f"{where}: expected a dataset mapping (dataset_name, data_path, ...) or a list of "
            f"them, got {yaml_type(value)}"
        )
        return ()
    entries = []
    for item_where, item in items:
        entry = _entry(item_where, item, default, context, found)
        if entry is not None:
            entries.append(entry)
            found.entries.append(entry)
    return tuple(entries)


def _entry(
    where: str, cfg: Any, default: Mapping[str, Any], context: EntryContext, found: Found
) -> DatasetEntry | None:
    if not isinstance(cfg, Mapping):
        found.errors.append(
            f"{where}: expected a mapping of dataset settings (dataset_name, data_path, ...), "
            f"got {yaml_type(cfg)}"
        )
        return None
    merged = {**default, **cfg}
    defaulted = tuple(sorted(k for k in default if k not in cfg))

    def key(name: str) -> str:
        return f"data.default.{name}" if name in defaulted else f"{where}.{name}"

    errors_before = len(found.errors)
    spec = _spec(merged.get("dataset_name"), key("dataset_name"), where, context, found)
    if spec is None:
        return None
    values = _common_values(spec, merged, key, context, found)
    extra = _extra_values(spec, merged, key, context, found)
    _warn_unread(spec, merged, key, found)
    for need in spec.needs:
        if values.get(need) is None and extra.get(need) is None:
            found.errors.append(f"{key(need)}: required by {spec.name}; {_NEEDS[need]}")
    if (
        spec.family == "response"
        and context.algorithm in REWARDED_ALGORITHMS
        and values.get("env_name") is None
    ):
        found.errors.append(
            f"{where}.env_name: required for {context.algorithm} (the environment that "
            "rewards this dataset's responses, e.g. math); set it here or in "
            "data.default.env_name"
        )
    if len(found.errors) > errors_before:
        return None
    return DatasetEntry(
        where=where,
        dataset_name=spec.name,
        family=spec.family,
        task_name=spec.task_name or _task_name(str(merged.get("data_path") or "")),
        extra=tuple(sorted(extra.items())),
        defaulted=defaulted,
        **values,
    )


_NEEDS = {
    "data_path": (
        "give a local file (JSON lines, JSON, Parquet or CSV), a save_to_disk directory, or "
        "a Hugging Face dataset id in the local cache"
    ),
    "data_files": "give a local file or glob (.arrow, .parquet, .json, .txt) of the raw text",
}


def _spec(
    name: Any, name_key: str, where: str, context: EntryContext, found: Found
) -> DatasetSpec | None:
    if name is None:
        found.errors.append(
            f"{where}.dataset_name: required; name the dataset (e.g. OpenMathInstruct-2, or "
            f"ResponseDataset with {where}.data_path) here or in data.default.dataset_name"
        )
        return None
    if not isinstance(name, str):
        found.errors.append(f"{name_key}: set a dataset's name (got: {name!r})")
        return None
    if name in MULTIMODAL:
        found.errors.append(
            f"{name_key}: {name} is one of NeMo-RL's image, video or audio datasets; this "
            "backend trains language models on text and does not load it"
        )
        return None
    if name == GYM.name:
        if not context.gym:
            found.errors.append(
                f"{name_key}: NemoGymDataset rows are NeMo-Gym's tasks; set "
                "env.should_use_nemo_gym: true (grpo or distillation) with env.nemo_gym, or "
                "name a dataset of prompts"
            )
            return None
        return GYM
    spec = spec_for(name, context.family)
    if spec is not None:
        return spec
    if "." in name:
        found.errors.append(
            f"{name_key}: {name!r} names a dataset class to import; this backend loads "
            "NeMo-RL's named datasets only: write the data as JSON lines and use "
            "ResponseDataset (or openai_format) with data_path"
        )
        return None
    table, other = (
        (PREFERENCE, RESPONSE) if context.family == "preference" else (RESPONSE, PREFERENCE)
    )
    accepted = ", ".join(sorted(table, key=str.lower))
    if name in other:
        kind = "preference pairs (DPO)" if context.family == "response" else "responses"
        found.errors.append(
            f"{name_key}: {name} holds {kind}, not what {context.algorithm or 'this run'} "
            f"trains on; use one of {accepted}"
        )
    else:
        found.errors.append(f"{name_key}: unknown dataset {name!r}; use one of {accepted}")
    return None


def _common_values(
    spec: DatasetSpec, merged: Mapping[str, Any], key: Any, context: EntryContext, found: Found
) -> dict[str, Any]:
    """The common keys in effect: those the dataset reads (recipe, else its default), the
    prompt files resolved, processor and env_name."""
    values: dict[str, Any] = {}
    for name in ("input_key", "output_key", "prompt_key", "chosen_key", "rejected_key",
                 "subset", "split", "download_dir", "processor", "env_name"):  # fmt: skip
        value = merged.get(name)
        if value is not None and not isinstance(value, str):
            found.errors.append(f"{key(name)}: set text (got: {value!r})")
            value = None
        if name == "processor":
            values[name] = "default" if value is None else value  # NeMo-RL's set_processor
            # A preference entry's rows always take preference_preprocessor (NeMo-RL binds no
            # other), so only a response entry's name is checked against its algorithm.
            problem = (
                processor_problem(values[name], key(name), context.algorithm)
                if context.family == "response" and isinstance(values[name], str)
                else None
            )
            if problem is not None:
                found.errors.append(problem)
        elif name == "env_name":
            values[name] = value
        elif name in spec.reads:
            values[name] = value if value is not None else spec.reads[name]
    split = values.get("split")
    if spec.splits is not None and split not in spec.splits:
        found.errors.append(
            f"{key('split')}: {split!r} is not a split of {spec.name}; use "
            + ", ".join(spec.splits)
        )
    if "data_path" in spec.reads:
        path = merged.get("data_path")
        if path is not None and not isinstance(path, str):
            found.errors.append(f"{key('data_path')}: set a path (got: {path!r})")
            path = None
        values["data_path"] = None if path is None else resolve_data_path(path, context.base_dir)
    if "split_validation_size" in spec.reads:
        size = merged.get("split_validation_size")
        size = spec.reads["split_validation_size"] if size is None else size
        if isinstance(size, bool) or not isinstance(size, int | float) or size < 0:
            found.errors.append(
                f"{key('split_validation_size')}: set a fraction below 1, or a number of rows, "
                f"of {spec.name} to hold out for validation (got: {size!r})"
            )
            size = 0
        values["split_validation_size"] = size
    if "seed" in spec.reads:
        seed = merged.get("seed")
        seed = spec.reads["seed"] if seed is None else seed
        if type(seed) is not int:
            found.errors.append(f"{key('seed')}: set an integer (got: {seed!r})")
            seed = DEFAULT_SEED
        values["seed"] = seed
    for name in ("prompt_file", "system_prompt_file"):
        values[name] = _prompt_file(merged.get(name), key(name), context, found)
    return values


def _prompt_file(value: Any, where: str, context: EntryContext, found: Found) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        found.errors.append(f"{where}: set a file path or null (got: {value!r})")
        return None
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [d / path for d in context.dirs]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate.resolve())
    if path.is_absolute():
        read_from = ""
    elif len(context.dirs) > 1:
        read_from = f" (read from {context.base_dir}, then the directories above the recipe)"
    else:
        read_from = f" (a relative path is read from {context.base_dir})"
    found.missing.append(
        f"{where}: {value}: no such file{read_from}; give the prompt file's path, or null for none"
    )
    return str(candidates[0])


# Types of the datasets' own keys: (check, what to set).
_EXTRA_TYPES: dict[str, tuple[Any, str]] = {
    "repeat": (lambda v: type(v) is int and v >= 1, "an integer of at least 1"),
    "max_samples": (lambda v: v is None or type(v) is int, "an integer, or null for all rows"),
    "characters_per_sample": (lambda v: v is None or type(v) is int, "an integer or null"),
    "extract_answer": (lambda v: type(v) is bool, "true or false"),
    "verifiable_only": (lambda v: type(v) is bool, "true or false"),
    "require_valid": (lambda v: type(v) is bool, "true or false"),
    "use_preserving_dataset": (lambda v: type(v) is bool, "true or false"),
    "chat_key": (lambda v: isinstance(v, str), "the messages' key as text"),
    "text_key": (lambda v: isinstance(v, str), "the text column's name"),
    "tool_key": (lambda v: v is None or isinstance(v, str), "the tools' key as text, or null"),
    "system_key": (lambda v: v is None or isinstance(v, str), "the system prompt's key, or null"),
    "system_prompt": (lambda v: v is None or isinstance(v, str), "text, or null"),
    "data_files": (lambda v: v is None or isinstance(v, str), "a path, glob or dataset id"),
}


def _extra_values(
    spec: DatasetSpec, merged: Mapping[str, Any], key: Any, context: EntryContext, found: Found
) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for name, default in spec.extras.items():
        value = merged.get(name, default)
        check, what = _EXTRA_TYPES[name]
        if not check(value):
            found.errors.append(f"{key(name)}: set {what} (got: {value!r})")
            value = default
        if name == "data_files" and isinstance(value, str):
            if value.startswith(("hf://", "http://", "https://")):
                found.errors.append(
                    f"{key(name)}: {value} is on the network; this backend reads local data "
                    "only: download the files and give their local path or glob"
                )
            value = resolve_data_path(value, context.base_dir)
        extra[name] = value
    return extra


def _warn_unread(spec: DatasetSpec, merged: Mapping[str, Any], key: Any, found: Found) -> None:
    """NeMo-RL warns when a dataset does not read a key that changes data (and passes other
    keys on silently); here every key the dataset does not read is named."""
    for name, value in merged.items():
        if name in spec.reads or name in spec.extras or value is None:
            continue
        if name in ("dataset_name", "prompt_file", "system_prompt_file", "processor", "env_name"):
            continue
        if name == "split_validation_size" and not value:
            continue
        if name in BEHAVIOURAL_KEYS or name in _MEDIA_KEYS or name in COMMON_KEYS:
            found.warnings.append(
                f"warning: {key(name)}: {spec.name} does not read {name}; it has no effect "
                "(remove it)"
            )
        else:
            known = ", ".join(sorted({*spec.reads, *spec.extras}))
            found.warnings.append(
                f"warning: {key(name)}: {spec.name} has no key {name!r}; it has no effect "
                f"(remove it; {spec.name} reads {known or 'no dataset keys'})"
            )


# ------------------------------------------------------------------------------ paths


def resolve_data_path(value: str, base_dir: Path) -> str:
    """``data_path`` / ``data_files`` as the loader opens it: an absolute path as it is, a
    relative one that exists (or has a file's suffix, or a glob's characters) from
    ``base_dir``, anything else of the form ``org/name`` kept as a Hugging Face dataset id.
    A value that reads an unset environment variable (``${oc.env:X}``) stays as written."""
    if "${" in value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    local = base_dir / path
    if (
        local.exists()
        or value.endswith(_FILE_SUFFIXES)
        or glob.has_magic(value)
        or value.startswith(".")
        or not _HUB_ID.fullmatch(value)
    ):
        return str(local)
    return value


def is_hub_id(value: str) -> bool:
    """Whether a resolved ``data_path`` names a Hugging Face dataset (not a local path)."""
    return not os.path.isabs(value) and "${" not in value and bool(_HUB_ID.fullmatch(value))


def _task_name(data_path: str) -> str:
    """NeMo-RL's task name of a dataset read from ``data_path``: its last two parts joined by
    ``-``, up to the first dot, without a leading ``-`` (``data/train.jsonl`` -> data-train)."""
    name = "-".join(data_path.split("/")[-2:]).split(".")[0]
    name = name[1:] if name.startswith("-") else name
    return name or Path(data_path).stem or "dataset"
