"""The recipe's ``data`` section resolved once: which data a run reads, and how.

Two kinds of recipe name data. NeMo-RL's name datasets under ``data.train`` and
``data.validation`` (one mapping or a list), each entry filled from ``data.default`` where it
does not set a key (NeMo-RL's ``update_single_dataset_config``: a key the entry sets, even to
null, stays). This backend's own name ``data.dataset_name: arithmetic | jsonl``. NeMo-Gym's rows
are NeMo-RL entries named ``NemoGymDataset`` with ``env.should_use_nemo_gym``.

:func:`data_settings` raises one :class:`UserInputError` with every problem; validate calls
:func:`check_data_section` for the same lines (and the warnings). Nothing here imports
``datasets``: the loader is data/nemo_rl_datasets.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nemo_rl_offload.config import nemo_gym
from nemo_rl_offload.config.dataset_entry import (
    DEFAULT_SEED,
    DatasetEntry,
    EntryContext,
    Found,
    is_hub_id,
    resolve_data_path,
    resolve_entries,
)
from nemo_rl_offload.config.loader import yaml_type
from nemo_rl_offload.config.nemo_rl_datasets import GYM, PREFERENCE, RESPONSE, Family
from nemo_rl_offload.config.quantization import search_dirs
from nemo_rl_offload.errors import UserInputError

__all__ = [
    "DataSettings",
    "DatasetEntry",
    "Source",
    "check_data_section",
    "data_settings",
    "dataset_entries",
    "is_hub_id",
    "resolve_data_path",
]

Source = Literal["arithmetic", "jsonl", "nemo_rl", "nemo_gym"]
LEGACY_SOURCES = ("arithmetic", "jsonl")
PREFERENCE_ALGORITHMS = ("dpo", "rm")
_ALGORITHMS = ("sft", "dpo", "grpo", "distillation", "rm", "ppo")

# The legacy sources' defaults (data/datasets.py and data/arithmetic.py use the same values;
# tests/unit/config/test_data_settings.py keeps them equal).
DEFAULT_NUM_TRAIN = 2000
DEFAULT_NUM_VAL = 200
ARITHMETIC_OPS = ("+", "-", "*")
DEFAULT_MAX_OPERAND = 99
DEFAULT_MAX_FACTOR = 12


@dataclass(frozen=True)
class DataSettings:
    """The ``data`` section resolved: the source, its datasets, and the loader's options.

    ``source`` is ``nemo_rl`` (``data.train``), ``nemo_gym`` (NeMo-Gym's rows, with
    ``env.should_use_nemo_gym``), or this backend's ``arithmetic`` / ``jsonl``
    (``data.dataset_name``). ``family`` is ``preference`` for DPO (NeMo-RL's preference
    datasets), else ``response``. The options have NeMo-RL's defaults; the fields after
    ``num_prompts_per_dataloader`` are the legacy sources' and keep their defaults otherwise.
    """

    source: Source
    family: Family = "response"
    train: tuple[DatasetEntry, ...] = ()
    validation: tuple[DatasetEntry, ...] = ()
    shuffle: bool = True
    seed: int = DEFAULT_SEED
    max_input_seq_length: int | None = None
    add_bos: bool = True
    add_eos: bool = True
    add_generation_prompt: bool = False
    add_system_prompt: bool = True
    use_multiple_dataloader: bool = False
    num_prompts_per_dataloader: int | None = None
    arithmetic_ops: tuple[str, ...] = ARITHMETIC_OPS
    max_operand: int = DEFAULT_MAX_OPERAND
    max_factor: int = DEFAULT_MAX_FACTOR
    num_train_samples: int = DEFAULT_NUM_TRAIN
    num_val_samples: int = DEFAULT_NUM_VAL
    train_data_path: str | None = None
    val_data_path: str | None = None
    input_key: str = "input"
    output_key: str = "output"
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    answer_key: str = "answer"


def data_settings(
    recipe: Mapping[str, Any],
    *,
    base_dir: Path | str,
    recipe_path: Path | str | None = None,
    algorithm: str | None = None,
) -> DataSettings:
    """The recipe's ``data`` section resolved; one UserInputError with every problem.

    ``base_dir`` is the working directory relative paths are read from (as NeMo-RL reads
    them); ``recipe_path`` adds the directories above the recipe file for prompt files;
    ``algorithm`` defaults to the recipe's algorithm section.
    """
    settings, found = _resolve(recipe, Path(base_dir), recipe_path, algorithm)
    problems = _unique(found.errors + found.missing)
    if problems or settings is None:
        raise UserInputError(problems or ["data: the recipe has no data section; add one"])
    return settings


def check_data_section(
    recipe: Mapping[str, Any],
    *,
    base_dir: Path | str,
    recipe_path: Path | str | None = None,
    algorithm: str | None = None,
    starting: bool = False,
) -> list[str]:
    """The lines validate reports for ``data``: errors, then ``warning: `` lines (keys a
    dataset does not read). A prompt file not on this machine is a warning for validate (a
    recipe written for a cluster names its files there) and an error when ``starting``.
    A recipe without a data section, and jsonl without ``data.train_data_path``, are left to
    the schema and data/file_checks.py, which report them."""
    if not isinstance(recipe.get("data"), Mapping):
        return []
    _, found = _resolve(recipe, Path(base_dir), recipe_path, algorithm)
    errors = [line for line in found.errors if not line.startswith(_JSONL_NEEDS_TRAIN)]
    if starting:
        return _unique(errors + found.missing + found.warnings)
    absent = [
        f"warning: {line}; not on this machine: a run checks it at start" for line in found.missing
    ]
    return _unique(errors + found.warnings + absent)


def dataset_entries(
    recipe: Mapping[str, Any], *, base_dir: Path | str, algorithm: str | None = None
) -> tuple[DatasetEntry, ...]:
    """The NeMo-RL entries (train, then validation) that resolve, even when others do not:
    what data/file_checks.py opens."""
    return tuple(_resolve(recipe, Path(base_dir), None, algorithm)[1].entries)


# ------------------------------------------------------------------------------ the section


def _unique(lines: list[str]) -> list[str]:
    """Each line once (a default's prompt file shared by entries is one problem)."""
    return list(dict.fromkeys(lines))


_JSONL_NEEDS_TRAIN = "data.train_data_path: required when data.dataset_name is 'jsonl'"


def _algorithm_of(recipe: Mapping[str, Any], algorithm: str | None) -> str | None:
    if algorithm is not None:
        return algorithm
    return next((name for name in _ALGORITHMS if name in recipe), None)


def _resolve(
    recipe: Mapping[str, Any],
    base_dir: Path,
    recipe_path: Path | str | None,
    algorithm: str | None,
) -> tuple[DataSettings | None, Found]:
    found = Found()
    data = recipe.get("data")
    if not isinstance(data, Mapping):
        found.errors.append(
            "data: the recipe has no data section; add one naming the datasets under "
            "data.train (NeMo-RL's), or data.dataset_name: arithmetic or jsonl"
        )
        return None, found
    algorithm = _algorithm_of(recipe, algorithm)
    family: Family = "preference" if algorithm in PREFERENCE_ALGORITHMS else "response"
    options = _options(data, found)
    legacy = data.get("dataset_name")
    train = data.get("train")
    if legacy is not None and train is not None:
        found.errors.append(
            f"data.dataset_name: {legacy!r} and data.train both name the training data; keep "
            "one (remove data.dataset_name to train on data.train's datasets, or remove "
            "data.train: ~data.train on the command line)"
        )
        return None, found
    if legacy is not None:
        return _legacy(data, legacy, family, options, found), found
    if train is None:
        found.errors.append(
            "data.train: required; name the training datasets here (NeMo-RL's, e.g. "
            "dataset_name: OpenMathInstruct-2, or ResponseDataset with data_path), or set "
            "data.dataset_name to arithmetic or jsonl"
        )
        return None, found
    dirs = tuple(search_dirs(base_dir, Path(recipe_path) if recipe_path else None))
    gym = nemo_gym.enabled(recipe) and nemo_gym.uses_gym_rows(data)
    context = EntryContext(algorithm, family, gym, dirs, base_dir)
    default = data.get("default")
    if default is not None and not isinstance(default, Mapping):
        found.errors.append(
            f"data.default: expected a mapping of dataset settings, got {yaml_type(default)}"
        )
        default = None
    entries = {
        key: resolve_entries(data.get(key), f"data.{key}", default or {}, context, found)
        for key in ("train", "validation")
    }
    if isinstance(train, list | Mapping) and not entries["train"] and not found.errors:
        found.errors.append("data.train: names no dataset; name at least one")
    settings = DataSettings(
        source="nemo_gym" if gym else "nemo_rl",
        family=family,
        train=entries["train"],
        validation=entries["validation"],
        **options,
    )
    return (None if found.errors else settings), found


def _options(data: Mapping[str, Any], found: Found) -> dict[str, Any]:
    """The loader's options (NeMo-RL's defaults) and data.seed."""
    options: dict[str, Any] = {}
    for key, default in (
        ("shuffle", True),
        ("add_bos", True),
        ("add_eos", True),
        ("add_generation_prompt", False),
        ("add_system_prompt", True),
        ("use_multiple_dataloader", False),
    ):
        options[key] = _typed(data, key, default, bool, "true or false", found)
    options["seed"] = _typed(data, "seed", DEFAULT_SEED, int, "an integer", found)
    for key in ("max_input_seq_length", "num_prompts_per_dataloader"):
        value = data.get(key)
        if value is not None and (type(value) is not int or value < 1):
            found.errors.append(f"data.{key}: set an integer of at least 1 (got: {value!r})")
            value = None
        options[key] = value
    if options["use_multiple_dataloader"] and options["num_prompts_per_dataloader"] is None:
        found.errors.append(
            "data.num_prompts_per_dataloader: required with data.use_multiple_dataloader: "
            "true; set how many prompts each dataset's loader gives a step"
        )
    return options


def _typed(
    data: Mapping[str, Any], key: str, default: Any, kind: type, what: str, found: Found
) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if type(value) is not kind:
        found.errors.append(f"data.{key}: set {what} (got: {value!r})")
        return default
    return value


def _legacy(
    data: Mapping[str, Any], name: Any, family: Family, options: dict[str, Any], found: Found
) -> DataSettings | None:
    """``data.dataset_name: arithmetic | jsonl``, with the keys data/datasets.py reads."""
    if name not in LEGACY_SOURCES:
        if isinstance(name, str) and (name in RESPONSE or name in PREFERENCE or name == GYM.name):
            found.errors.append(
                f"data.dataset_name: {name!r} is one of NeMo-RL's datasets; name it under "
                f"data.train (data.train.dataset_name: {name}) and remove data.dataset_name"
            )
        else:
            found.errors.append(
                f"data.dataset_name: unknown dataset {name!r}; use arithmetic or jsonl, or "
                "name NeMo-RL's datasets under data.train"
            )
        return None
    values: dict[str, Any] = {}
    for key, default in (("max_operand", DEFAULT_MAX_OPERAND), ("max_factor", DEFAULT_MAX_FACTOR)):
        value = data.get(key)
        if value is not None and (type(value) is not int or value < 1):
            found.errors.append(f"data.{key}: must be an integer >= 1 (got: {value!r})")
            value = None
        values[key] = default if value is None else value
    ops = data.get("arithmetic_ops") or ARITHMETIC_OPS
    if not isinstance(ops, list | tuple) or any(op not in ARITHMETIC_OPS for op in ops):
        found.errors.append(f"data.arithmetic_ops: list some of + - * (got: {ops!r})")
        ops = ARITHMETIC_OPS
    values["arithmetic_ops"] = tuple(ops)
    for key, default in (
        ("num_train_samples", DEFAULT_NUM_TRAIN),
        ("num_val_samples", DEFAULT_NUM_VAL),
    ):
        value = data.get(key, default)
        if type(value) is not int or value < 0:
            found.errors.append(f"data.{key}: set an integer of at least 0 (got: {value!r})")
            value = default
        values[key] = value
    for key in ("train_data_path", "val_data_path"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            found.errors.append(f"data.{key}: set a file path (got: {value!r})")
            value = None
        values[key] = value
    for key in (
        "input_key",
        "output_key",
        "prompt_key",
        "chosen_key",
        "rejected_key",
        "answer_key",
    ):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            found.errors.append(f"data.{key}: set the key's name as text (got: {value!r})")
            value = None
        if value is not None:
            values[key] = value
    if name == "jsonl" and values["train_data_path"] is None:
        found.errors.append(f"{_JSONL_NEEDS_TRAIN}; set it to a JSON-lines file")
    if found.errors:
        return None
    return DataSettings(source=name, family=family, **options, **values)
