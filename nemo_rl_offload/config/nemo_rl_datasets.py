"""The names NeMo-RL's recipes give datasets (``data.train.dataset_name`` ...), and what each reads.

One table, without importing ``datasets``: settings resolution (config/data_settings.py) checks
names and keys against it, the loader (data/nemo_rl/) maps rows by it. Facts are NeMo-RL's
(nemo_rl/data/datasets/{response,preference}_datasets/ at 7ea279ab): hub id, default split,
the keys each class accepts and their defaults, the task name. One difference: every named
dataset also takes ``data_path``, a local copy of it (NeMo-RL ignores the key there), because
this backend never downloads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = [
    "ALL_SPLITS",
    "BEHAVIOURAL_KEYS",
    "COMMON_KEYS",
    "Family",
    "GYM",
    "MULTIMODAL",
    "PREFERENCE",
    "RESPONSE",
    "DatasetSpec",
    "spec_for",
]

Family = Literal["response", "preference", "nemo_gym"]

# Keys of NeMo-RL's ResponseDatasetConfig / PreferenceDatasetConfig that DatasetEntry holds.
COMMON_KEYS = (
    "dataset_name",
    "data_path",
    "input_key",
    "output_key",
    "prompt_key",
    "chosen_key",
    "rejected_key",
    "subset",
    "split",
    "split_validation_size",
    "seed",
    "download_dir",
    "prompt_file",
    "system_prompt_file",
    "processor",
    "env_name",
)
# The keys that change which data a run sees; NeMo-RL warns when a dataset does not read one
# (datasets/utils.py _BEHAVIORAL_DATASET_CONFIG_KEYS).
BEHAVIOURAL_KEYS = (
    "chosen_key",
    "data_path",
    "download_dir",
    "input_key",
    "output_key",
    "prompt_key",
    "rejected_key",
    "seed",
    "split",
    "split_validation_size",
    "subset",
)
ALL_SPLITS = None  # a dataset whose split is free (a local file or a hub id given as data_path)


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset name: where it comes from and which keys it reads.

    ``reads`` maps each common key the dataset reads to its default (None: no default);
    ``extras`` its own keys (``repeat``, ``max_samples`` ...) to theirs. ``hub_id`` is None for
    the datasets that only read ``data_path``; ``hub_configs`` the Hugging Face configs it loads
    (concatenated; a dataset that reads ``subset`` loads that one instead), ``hub_split`` its
    fixed split (one that reads ``split`` loads that one), ``hub_file`` the one file it reads
    instead of a table. ``task_name`` is None when it comes from ``data_path`` (NeMo-RL: the
    path's last two parts joined by ``-``, up to the first dot). ``columns`` names the hub
    layout's columns a local copy must have.
    """

    name: str
    family: Family
    hub_id: str | None
    task_name: str | None
    reads: Mapping[str, Any] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # keys that must be set (data_path, data_files)
    splits: tuple[str, ...] | None = ALL_SPLITS
    hub_configs: tuple[str | None, ...] = (None,)
    hub_split: str | None = "train"
    hub_file: str | None = None
    columns: tuple[str, ...] = ()


def _named(
    name: str, hub_id: str, columns: tuple[str, ...], *, task: str | None = None, **kw: Any
) -> DatasetSpec:
    reads = {"data_path": None, **kw.pop("reads", {})}
    return DatasetSpec(name, "response", hub_id, task or name, reads, columns=columns, **kw)


_AIME_EXTRAS = {"repeat": 1}
_SPLIT_OFF = {"split_validation_size": 0, "seed": 42}
_SPLIT_5 = {"split_validation_size": 0.05, "seed": 42}

_GSM8K = _named(
    "gsm8k",
    "openai/gsm8k",
    ("question", "answer"),
    reads={"subset": "main", "split": "train"},
    extras={"extract_answer": True},
)

RESPONSE: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        _named("AIME2024", "HuggingFaceH4/aime_2024", ("problem", "answer"), extras=_AIME_EXTRAS),
        _named(
            "AIME2025",
            "opencompass/AIME2025",
            ("question", "answer"),
            extras=_AIME_EXTRAS,
            hub_configs=("AIME2025-I", "AIME2025-II"),
            hub_split="test",
        ),
        _named("AIME2026", "MathArena/aime_2026", ("problem", "answer"), extras=_AIME_EXTRAS),
        _named("DAPOMath17K", "BytedTsinghua-SIA/DAPO-Math-17k", ("prompt", "reward_model")),
        _named("DAPOMathAIME2024", "BytedTsinghua-SIA/AIME-2024", ("prompt", "reward_model")),
        _named("DeepScaler", "agentica-org/DeepScaleR-Preview-Dataset", ("problem", "answer")),
        _GSM8K,
        replace(_GSM8K, name="GSM8K"),
        _named(
            "squad",
            "rajpurkar/squad",
            ("context", "question", "answers"),
            reads={"split": "train"},
        ),
        _named(
            "HelpSteer3",
            "nvidia/HelpSteer3",
            ("context", "response1", "response2", "overall_preference"),
            reads={"split": "train"},
            hub_configs=("preference",),
        ),
        _named(
            "open_assistant",
            "OpenAssistant/oasst1",
            (),
            task="oasst",
            reads=_SPLIT_5,
            hub_file="2023-04-12_oasst_all.trees.jsonl.gz",  # message trees, one per line
        ),
        _named(
            "OpenMathInstruct-2",
            "nvidia/OpenMathInstruct-2",
            ("problem",),
            reads={"output_key": "expected_answer", "split": "train_1M", **_SPLIT_5},
            splits=("train", "train_1M", "train_2M", "train_5M"),
        ),
        _named(
            "NuminaMath-1.5",
            "AI-MO/NuminaMath-1.5",
            ("problem", "answer"),
            reads={"split": "train", **_SPLIT_OFF},
            extras={"verifiable_only": True, "require_valid": True},
        ),
        _named(
            "OpenR1-Math-220k",
            "open-r1/OpenR1-Math-220k",
            ("problem", "answer"),
            reads={"subset": "default", "split": "train", **_SPLIT_OFF},
        ),
        _named(
            "tulu3_sft_mixture",
            "allenai/tulu-3-sft-mixture",
            ("messages",),
            reads=_SPLIT_5,
            extras={"max_samples": None},
        ),
        _named(
            "Nemotron-Cascade-2-SFT-Math",
            "nvidia/Nemotron-Cascade-2-SFT-Data",
            ("messages",),
            reads={"split": "train", **_SPLIT_5},
            extras={"max_samples": None},
            hub_configs=("math",),
        ),
        DatasetSpec(
            "arrow_text",
            "response",
            None,
            "x_token",
            reads={"subset": None, "split": "train", **_SPLIT_OFF},
            extras={"data_files": None, "text_key": "text", "characters_per_sample": None},
            needs=("data_files",),
        ),
        DatasetSpec(
            "openai_format",
            "response",
            None,
            None,
            reads={"data_path": None},
            extras={
                "chat_key": "messages",
                "system_key": None,
                "system_prompt": None,
                "tool_key": "tools",
                "use_preserving_dataset": False,
            },
            needs=("data_path",),
        ),
        DatasetSpec(
            "ResponseDataset",
            "response",
            None,
            None,
            reads={
                "data_path": None,
                "input_key": "input",
                "output_key": "output",
                "subset": None,
                "split": None,
                **_SPLIT_OFF,
            },
            needs=("data_path",),
        ),
    )
}

PREFERENCE: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            "HelpSteer3",
            "preference",
            "nvidia/HelpSteer3",
            "HelpSteer3",
            reads={"data_path": None, "split": "train"},
            hub_configs=("preference",),
            columns=("context", "response1", "response2", "overall_preference"),
        ),
        DatasetSpec(
            "Tulu3Preference",
            "preference",
            "allenai/llama-3.1-tulu-3-8b-preference-mixture",
            "Tulu3Preference",
            reads={"data_path": None},
            columns=("chosen", "rejected"),
        ),
        DatasetSpec(
            "BinaryPreferenceDataset",
            "preference",
            None,
            None,
            reads={
                "data_path": None,
                "prompt_key": "prompt",
                "chosen_key": "chosen",
                "rejected_key": "rejected",
                "subset": None,
                "split": None,
            },
            needs=("data_path",),
        ),
        DatasetSpec(
            "PreferenceDataset",
            "preference",
            None,
            None,
            reads={"data_path": None, "subset": None, "split": None},
            needs=("data_path",),
            columns=("context", "completions"),
        ),
    )
}

# NeMo-Gym's rows (data/nemo_gym_rows.py loads them, with env.should_use_nemo_gym).
GYM = DatasetSpec(
    "NemoGymDataset",
    "nemo_gym",
    None,
    None,
    reads={"data_path": None},
    extras={"repeat": 1},
    needs=("data_path",),
)

# NeMo-RL's names of image, video and audio datasets: not text for a language model.
MULTIMODAL = frozenset(
    {
        "audiomcq",
        "avqa",
        "clevr-cogent",
        "daily-omni",
        "general-conversation-jsonl",
        "geometry3k",
        "intent-bench",
        "intent-train",
        "mmpr-tiny",
        "refcoco",
    }
)


def spec_for(name: str, family: Family) -> DatasetSpec | None:
    """The spec of ``name`` for a run of ``family`` (HelpSteer3 is in both tables, as in
    NeMo-RL: DPO reads its pairs, GRPO its context and chosen response); None if unknown."""
    if name == GYM.name:
        return GYM
    table = PREFERENCE if family == "preference" else RESPONSE
    return table.get(name)
