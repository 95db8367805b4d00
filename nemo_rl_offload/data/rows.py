"""The shapes data takes between NeMo-RL's datasets, its processors and the trainers.

A dataset entry of the recipe (``data.train``, ``data.validation``) yields :class:`DataRow`s:
NeMo-RL's datum dicts after its column mapping, each with the processor and the task (prompt
file, system prompt) that turn it into tokens. A processor makes an :class:`EncodedExample`,
which is what the trainers batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DataRow", "EncodedExample", "TaskSpec"]


@dataclass(frozen=True)
class TaskSpec:
    """A dataset's task as NeMo-RL's ``TaskDataSpec`` holds it: the prompt file's text (with
    ``{}`` where the problem goes) and the system prompt file's text, both already read."""

    task_name: str
    prompt: str | None = None
    system_prompt: str | None = None


@dataclass(frozen=True)
class DataRow:
    """One example as NeMo-RL's dataset classes produce it.

    ``datum`` is NeMo-RL's datum dict: ``messages`` (OpenAI-style role/content dicts) and
    ``task_name`` for response datasets, ``context`` and ``completions`` for preference ones,
    plus whatever else the dataset carries (``tools``...). ``where`` locates it for messages
    (``data.train[0]: row 17`` or ``path:line``).
    """

    datum: Mapping[str, Any]
    processor: str
    task: TaskSpec
    env_name: str | None
    where: str


@dataclass(frozen=True)
class EncodedExample:
    """Token ids of one example and which of them train.

    ``input_ids`` is the whole sequence (prompt and response; for a preference pair the chosen
    one, with ``rejected_ids`` the rejected one sharing the same prompt). Tokens before
    ``prompt_len`` never train, nor those in ``masked_spans`` (``[start, end)`` ranges after the
    prompt: a multi-turn example's user and tool turns). ``loss_multiplier`` 0 keeps a cut
    example in the data order without training on it. ``ground_truth`` is what the
    environment grades a sampled response against (NeMo-RL's ``extra_env_info``).
    """

    input_ids: list[int]
    prompt_len: int
    rejected_ids: list[int] | None = None
    loss_multiplier: float = 1.0
    masked_spans: tuple[tuple[int, int], ...] = ()
    ground_truth: str | None = None
    task_name: str | None = None
    env_name: str | None = None
