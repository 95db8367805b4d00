"""One policy section (``policy`` or ``teacher``) resolved once: what its workers build and run.

``validate`` and every command resolve a section once (:func:`resolve`) and hand the frozen,
picklable result to the workers, the planner and the estimates, so the settings that were
checked are the settings that run, and no layer below ``config/`` reads the recipe again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_offload.config import fp8, megatron_settings, quantization, router_replay
from nemo_rl_offload.config.batching_settings import BatchingSettings, step_buckets
from nemo_rl_offload.config.generation_settings import GenerationSettings
from nemo_rl_offload.config.http_server import ServingSettings, serving_settings
from nemo_rl_offload.config.megatron_settings import EffectiveSettings, RuntimeChoices
from nemo_rl_offload.config.model_presets import Architecture
from nemo_rl_offload.config.tokenizer_settings import TokenizerSettings, tokenizer_settings
from nemo_rl_offload.errors import UserInputError


@dataclass(frozen=True)
class OffloadRuntimeSettings:
    """What the offload runtime needs beyond TransformerConfig: the host budget, the length
    buckets steps are padded to, and its choices for eager and for graphed steps."""

    host_budget_gib: float | None
    sequence_buckets: tuple[int, ...]
    default_buckets: bool  # derived from the section's length, not given
    eager: RuntimeChoices
    graphed: RuntimeChoices

    def choices(self, *, graphed: bool) -> RuntimeChoices:
        return self.graphed if graphed else self.eager


@dataclass(frozen=True)
class PolicySettings:
    """A policy section resolved: its model, its Megatron settings with where each came from,
    batching, generation and the offload runtime's settings."""

    where: str
    architecture: Architecture
    effective: EffectiveSettings
    batching: BatchingSettings
    generation: GenerationSettings
    offload: OffloadRuntimeSettings
    serving: ServingSettings
    max_total_sequence_length: int
    train_global_batch_size: int
    model_name: str
    precision: str
    init_checkpoint: str | None
    # policy.logprob_chunk_size (None: whole sequences) and megatron_cfg.chunked_output_layer.
    logprob_chunk: int | None
    chunked_output_layer: bool
    rollouts_quantized: bool  # generation.quant_cfg: the sampler runs the quantized model
    records_routes: bool  # router_replay.enabled: the sampler records each position's experts
    quant_cfg: Any
    quant_calibration: quantization.Calibration
    tokenizer: TokenizerSettings
    # Megatron's optimizer, scheduler and DDP fields as the schema checked them (NeMo-RL's
    # names), for the optimizer the worker builds.
    optimizer: Mapping[str, Any] = field(default_factory=dict)
    scheduler: Mapping[str, Any] = field(default_factory=dict)
    ddp: Mapping[str, Any] = field(default_factory=dict)
    # Lines refusing the section's fp8_cfg (a worker started without validate raises the first).
    fp8_errors: tuple[str, ...] = ()

    @property
    def offload_modules(self) -> tuple[str, ...]:
        """The offload modules that run: none unless fine-grained offloading is on."""
        return self.effective.offload_modules

    def parallel_sizes(self) -> dict[str, Any]:
        """The parallel layout's sizes, as Megatron's parallel state takes them."""
        return {
            name: self.effective.value(name)
            for name in (
                "tensor_model_parallel_size",
                "pipeline_model_parallel_size",
                "context_parallel_size",
                "expert_model_parallel_size",
                "expert_tensor_parallel_size",
            )
        }


def _tokenizer(section: Mapping[str, Any], where: str) -> TokenizerSettings:
    """The section's tokenizer keys; a teacher's chat template is not applied (it scores the
    student's tokens), so a bad one there is not the run's to refuse (validate warns)."""
    try:
        return tokenizer_settings(section, where)
    except UserInputError:
        if where == "policy":
            raise
        return TokenizerSettings(name=(section.get("tokenizer") or {}).get("name"))


def resolve(
    section: Mapping[str, Any],
    *,
    where: str,
    architecture: Architecture,
    te_installed: bool,
    pair_rows: bool = False,
    effective: EffectiveSettings | None = None,
) -> PolicySettings:
    """``section`` (named ``where``) resolved for a model of ``architecture``. ``pair_rows``:
    DPO's forward-only rows default to two per pair. ``effective``: the section's Megatron
    settings when the caller resolved them already."""
    section = dict(section)
    if effective is None:
        effective = megatron_settings.effective_settings(
            section, architecture, where=where, te_installed=te_installed
        )
    megatron_cfg = section.get("megatron_cfg") or {}
    budget = megatron_cfg.get("offload_host_memory_budget_gib")
    buckets, default_buckets = step_buckets(section)
    chunk = section.get("logprob_chunk_size") or None
    fp8_errors, _ = fp8.problems(
        section, where, transformer_impl=effective.value("transformer_impl")
    )
    return PolicySettings(
        where=where,
        architecture=architecture,
        effective=effective,
        batching=BatchingSettings.from_policy(section, pair_rows=pair_rows, where=where),
        generation=GenerationSettings.from_section(section),
        offload=OffloadRuntimeSettings(
            host_budget_gib=float(budget) if budget else None,
            sequence_buckets=tuple(buckets),
            default_buckets=default_buckets,
            eager=megatron_settings.runtime_choices(effective, megatron_cfg, graphed=False),
            graphed=megatron_settings.runtime_choices(effective, megatron_cfg, graphed=True),
        ),
        serving=serving_settings(section),
        max_total_sequence_length=int(section["max_total_sequence_length"]),
        train_global_batch_size=int(section.get("train_global_batch_size") or 1),
        model_name=str(section["model_name"]),
        precision=str(section.get("precision", "float32")),
        init_checkpoint=section.get("init_checkpoint"),
        logprob_chunk=int(chunk) if chunk else None,
        chunked_output_layer=bool(chunk and megatron_cfg.get("chunked_output_layer")),
        rollouts_quantized=quantization.rollouts_quantized(section),
        records_routes=router_replay.enabled(section),
        quant_cfg=quantization.policy_config(section),
        quant_calibration=quantization.calibration(section),
        tokenizer=_tokenizer(section, where),
        optimizer=dict(megatron_cfg.get("optimizer") or {}),
        scheduler=dict(megatron_cfg.get("scheduler") or {}),
        ddp=dict(megatron_cfg.get("distributed_data_parallel_config") or {}),
        fp8_errors=tuple(fp8_errors),
    )
