"""The run's own sections resolved once: the algorithm's schedule, checkpointing and the logger.

``check_recipe`` builds one :class:`RunSettings` for a recipe without errors; the training loop
reads it instead of the recipe. Each key here has this one reader and its default here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_rl_offload.config import checkpointing
from nemo_rl_offload.config.data_settings import DataSettings
from nemo_rl_offload.config.env_settings import MathEnvSettings, math_env_settings
from nemo_rl_offload.config.processor_flags import ProcessorFlags

__all__ = [
    "CheckpointSettings",
    "DpoSettings",
    "LoggerSettings",
    "RunSettings",
    "ScheduleSettings",
    "resolve",
]


@dataclass(frozen=True)
class ScheduleSettings:
    """The algorithm section's steps, epochs, seed and validation schedule (NeMo-RL's keys)."""

    max_steps: int
    max_epochs: int | None  # None: no epoch limit
    seed: int
    val_period: int
    val_at_start: bool
    val_at_end: bool
    val_start_at: int  # -1: from the first step
    # SFT's and DPO's validation set: val_batches of val_global_batch_size examples (pairs),
    # forward-only micro-batches of val_micro_batch_size (None: the policy's logprob rows).
    val_batches: int = 8
    val_global_batch_size: int = 32
    val_micro_batch_size: int | None = None

    @property
    def val_examples(self) -> int:
        return self.val_batches * self.val_global_batch_size


@dataclass(frozen=True)
class CheckpointSettings:
    enabled: bool
    checkpoint_dir: str
    save_period: int  # 0: only at the end
    keep_top_k: int | None
    metric: checkpointing.Metric | None  # what keep_top_k ranks by
    higher_is_better: bool
    must_save_by: str | None  # checkpoint_must_save_by as written
    must_save_by_seconds: int | None


@dataclass(frozen=True)
class LoggerSettings:
    log_dir: str
    tensorboard: bool
    monitor_gpus: bool
    num_val_samples_to_print: int


@dataclass(frozen=True)
class DpoSettings:
    """DPO's loss (NeMo-RL's keys and defaults) as the workers' loss spec takes it."""

    beta: float  # reference_policy_kl_penalty
    preference_average_log_probs: bool = False
    sft_average_log_probs: bool = False
    preference_loss_weight: float = 1.0
    sft_loss_weight: float = 0.0

    def loss_spec(self) -> dict[str, Any]:
        return {
            "name": "dpo",
            "beta": self.beta,
            "preference_average_log_probs": self.preference_average_log_probs,
            "sft_average_log_probs": self.sft_average_log_probs,
            "preference_loss_weight": self.preference_loss_weight,
            "sft_loss_weight": self.sft_loss_weight,
        }


@dataclass(frozen=True)
class RunSettings:
    algorithm: str
    schedule: ScheduleSettings
    checkpointing: CheckpointSettings
    logger: LoggerSettings
    dpo: DpoSettings | None = None  # the dpo section's loss, in a DPO run
    # The data section (config/data_settings.py) and what NeMo-RL's processors are told.
    data: DataSettings | None = None
    processor_flags: ProcessorFlags = ProcessorFlags()
    math_env: MathEnvSettings = MathEnvSettings()  # env.math: how responses are graded


# NeMo-RL's default validation batch (examples, or pairs for DPO).
_VAL_GLOBAL_BATCH = {"sft": 32, "dpo": 8}


def _schedule(section: Mapping[str, Any], algorithm: str) -> ScheduleSettings:
    epochs = section.get("max_num_epochs")
    val_micro = section.get("val_micro_batch_size")
    return ScheduleSettings(
        max_steps=int(section["max_num_steps"]),
        max_epochs=None if epochs is None else int(epochs),
        seed=int(section["seed"]),
        val_period=int(section.get("val_period", 0) or 0),
        val_at_start=bool(section.get("val_at_start", False)),
        val_at_end=bool(section.get("val_at_end", False)),
        val_start_at=int(section.get("val_start_at", -1)),
        val_batches=int(section.get("val_batches", 8)),
        val_global_batch_size=int(
            section.get("val_global_batch_size", _VAL_GLOBAL_BATCH.get(algorithm, 32))
        ),
        val_micro_batch_size=int(val_micro) if val_micro else None,
    )


def _dpo(section: Mapping[str, Any]) -> DpoSettings:
    return DpoSettings(
        beta=float(section["reference_policy_kl_penalty"]),
        preference_average_log_probs=bool(section.get("preference_average_log_probs", False)),
        sft_average_log_probs=bool(section.get("sft_average_log_probs", False)),
        preference_loss_weight=float(section.get("preference_loss_weight", 1.0)),
        sft_loss_weight=float(section.get("sft_loss_weight", 0.0)),
    )


def _checkpointing(ckpt: Mapping[str, Any], algorithm: str) -> CheckpointSettings:
    metric_name = ckpt.get("metric_name")
    deadline = ckpt.get("checkpoint_must_save_by") or None
    return CheckpointSettings(
        enabled=bool(ckpt.get("enabled", True)),
        checkpoint_dir=str(ckpt["checkpoint_dir"]),
        save_period=int(ckpt.get("save_period", 0) or 0),
        keep_top_k=ckpt.get("keep_top_k"),
        metric=checkpointing.resolve_metric(metric_name, algorithm) if metric_name else None,
        higher_is_better=bool(ckpt.get("higher_is_better", True)),
        must_save_by=deadline,
        must_save_by_seconds=checkpointing.parse_deadline(deadline) if deadline else None,
    )


def _logger(logger: Mapping[str, Any]) -> LoggerSettings:
    return LoggerSettings(
        log_dir=str(logger["log_dir"]),
        tensorboard=bool(logger.get("tensorboard_enabled", False)),
        monitor_gpus=bool(logger.get("monitor_gpus", False)),
        num_val_samples_to_print=int(logger.get("num_val_samples_to_print") or 0),
    )


def _processor_flags(
    recipe: Mapping[str, Any], algorithm: str, data: DataSettings | None
) -> ProcessorFlags:
    """NeMo-RL's SFT switches: ``data.add_bos``/``add_eos``/``add_generation_prompt`` and
    ``sft.only_unmask_final``."""
    if data is None:
        return ProcessorFlags()
    section = recipe.get(algorithm) or {}
    return ProcessorFlags(
        add_bos=data.add_bos,
        add_eos=data.add_eos,
        add_generation_prompt=data.add_generation_prompt,
        only_unmask_final=bool(algorithm == "sft" and section.get("only_unmask_final", False)),
    )


def resolve(
    recipe: Mapping[str, Any], algorithm: str, data: DataSettings | None = None
) -> RunSettings:
    """The run's settings from a recipe the checks passed (so required keys are there and
    well-typed, and the checkpoint metric and deadline parse); ``data``: the data section as
    ``config.data_settings`` resolved it."""
    return RunSettings(
        algorithm=algorithm,
        schedule=_schedule(recipe[algorithm], algorithm),
        checkpointing=_checkpointing(recipe["checkpointing"], algorithm),
        logger=_logger(recipe["logger"]),
        dpo=_dpo(recipe["dpo"]) if algorithm == "dpo" else None,
        data=data,
        processor_flags=_processor_flags(recipe, algorithm, data),
        math_env=math_env_settings(recipe),
    )
