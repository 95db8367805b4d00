"""Load a recipe's NeMo-RL datasets as :class:`~nemo_rl_offload.data.rows.DataRow`s.

:func:`load_rows` reads each entry of ``data.train`` and ``data.validation`` (resolved by
config/data_settings.py), maps its rows into NeMo-RL's datum dicts (data/nemo_rl/), holds out
``split_validation_size`` of a training entry as NeMo-RL does, and binds each row to its
entry's processor, task (prompt files read) and environment. The order is NeMo-RL's: training
entries one after the other; validation rows held out of training entries first, then the
validation entries. Every problem of an entry is reported at once; the entries' problems
together.
"""

from __future__ import annotations

from pathlib import Path

from nemo_rl_offload.config.data_settings import DatasetEntry, DataSettings
from nemo_rl_offload.data.nemo_rl.registry import reader
from nemo_rl_offload.data.nemo_rl.split import holdout
from nemo_rl_offload.data.rows import DataRow, TaskSpec
from nemo_rl_offload.errors import UserInputError

__all__ = ["PREFERENCE_PROCESSOR", "entry_rows", "load_rows"]

# NeMo-RL's processor of every preference row (setup_preference_data binds no other).
PREFERENCE_PROCESSOR = "preference_preprocessor"


def load_rows(settings: DataSettings) -> tuple[list[DataRow], list[DataRow]]:
    """(train, validation) rows of a ``nemo_rl`` or ``nemo_gym`` source."""
    if settings.source not in ("nemo_rl", "nemo_gym"):
        raise ValueError(
            f"load_rows reads NeMo-RL's dataset entries; a {settings.source!r} source is "
            "loaded by data/datasets.py's load_split"
        )
    train: list[DataRow] = []
    held_out: list[DataRow] = []
    validation: list[DataRow] = []
    problems: list[str] = []
    for entry in settings.train:
        try:
            rows = entry_rows(entry)
            kept, held = holdout(
                len(rows),
                entry.split_validation_size,
                entry.seed,
                where=entry.key("split_validation_size"),
            )
        except UserInputError as error:
            problems += error.problems
            continue
        train += [rows[i] for i in kept]
        held_out += [rows[i] for i in held]
    for entry in settings.validation:
        try:
            validation += entry_rows(entry)
        except UserInputError as error:
            problems += error.problems
    if problems:
        raise UserInputError(problems)
    return train, held_out + validation


def entry_rows(entry: DatasetEntry) -> list[DataRow]:
    """One entry's rows, in its dataset's order."""
    spec, read = reader(entry)
    datums, where = read(entry, spec)
    if not datums:
        raise UserInputError(f"{entry.where}: {entry.dataset_name} gave no rows; check its source")
    task = _task(entry)
    processor = PREFERENCE_PROCESSOR if entry.family == "preference" else entry.processor
    return [
        DataRow(datum=datum, processor=processor, task=task, env_name=entry.env_name, where=w)
        for datum, w in zip(datums, where, strict=True)
    ]


def _task(entry: DatasetEntry) -> TaskSpec:
    """NeMo-RL's TaskDataSpec of the entry: the prompt files' text, read once."""
    texts: dict[str, str | None] = {}
    for name in ("prompt_file", "system_prompt_file"):
        path = getattr(entry, name)
        if path is None:
            texts[name] = None
            continue
        try:
            texts[name] = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise UserInputError(
                f"{entry.key(name)}: {path}: cannot be read ({reason}); give a readable text "
                "file, or null for none"
            ) from None
    return TaskSpec(entry.task_name, texts["prompt_file"], texts["system_prompt_file"])
