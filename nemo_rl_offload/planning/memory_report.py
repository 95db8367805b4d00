"""``validate``'s memory estimate: the recipe's sections estimated
(:mod:`nemo_rl_offload.planning.memory_estimate`) with their ledgers
(:mod:`nemo_rl_offload.planning.ledger_cache`), printed, and compared with the GPU's memory.

Why a module of its own: the arithmetic stays pure (the planner calls it for candidates); this
is the glue that knows the recipe's algorithm (who holds a reference, who samples, which groups
share a GPU) and the machine (the GPU's size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_rl_offload.planning.memory_estimate import (
    DEFAULT_GPU_MEMORY_GIB,
    GIB,
    MemoryEstimate,
    gpu_peak,
)

SECTIONS = ("policy", "teacher")


@dataclass
class EstimateReport:
    """What ``validate`` prints (``lines``, stdout) and warns (``warnings``, stderr)."""

    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    estimates: list[MemoryEstimate] = field(default_factory=list)


def gpu_memory(flag_gib: float | None) -> tuple[float, str]:
    """(GiB, where it came from): ``--gpu-memory-gib`` when given, else the visible GPU's,
    else the default."""
    if flag_gib is not None:
        return float(flag_gib), "--gpu-memory-gib"
    try:
        import torch

        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            return total / GIB, f"{torch.cuda.get_device_name(0)}, from torch.cuda"
    except (ImportError, RuntimeError):
        pass
    return DEFAULT_GPU_MEMORY_GIB, "default; --gpu-memory-gib sets it"


def _samples_per_step(recipe: dict[str, Any], algorithm: str | None) -> int:
    """Sequences the policy samples per step (GRPO, on-policy distillation), else 0."""
    section = recipe.get(algorithm or "")
    if algorithm not in ("grpo", "distillation") or not isinstance(section, dict):
        return 0
    prompts = int(section.get("num_prompts_per_step") or 0)
    return prompts * int(section.get("num_generations_per_prompt") or 1)


def _estimate(
    recipe: dict[str, Any], algorithm: str | None, where: str, base_dir: Path | None
) -> MemoryEstimate:
    from nemo_rl_offload.config import megatron_settings
    from nemo_rl_offload.config.cluster_settings import cluster_settings
    from nemo_rl_offload.config.model_presets import section_architecture
    from nemo_rl_offload.planning.ledger_cache import cached_ledger
    from nemo_rl_offload.planning.memory_estimate import estimate_peak
    from nemo_rl_offload.policy.policy_group import holds_reference

    section = recipe[where]
    architecture = section_architecture(section, where=where, base_dir=base_dir)
    # Estimated as the GPU machines this package runs on are set up: no Transformer Engine
    # (the local layer spec) and no Apex, so Megatron's optimizer is torch's, not a fused one.
    te_installed = False
    effective = megatron_settings.effective_settings(
        section, architecture, where=where, te_installed=te_installed
    )
    ledger, _ = cached_ledger(section, where=where, base_dir=base_dir)
    policy = where == "policy"
    return estimate_peak(
        effective,
        architecture,
        section,
        ledger,
        where=where,
        workers=cluster_settings(recipe.get("cluster")).workers,
        trainable=policy,
        with_reference=policy and holds_reference(recipe, algorithm or ""),
        samples_per_step=_samples_per_step(recipe, algorithm) if policy else 0,
        longest_prompt=(recipe.get("data") or {}).get("max_input_seq_length"),
        fused_adam=te_installed,
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def _lines(e: MemoryEstimate, section: dict[str, Any]) -> list[str]:
    where = e.where
    precision = section.get("precision") or "float32"
    optimizer = (section.get("megatron_cfg") or {}).get("optimizer") or {}
    out = [
        f"  {where} weights: {_gib(e.weights)} ({e.parameters.total / 1e9:.2f}B parameters "
        f"on this GPU, {precision})"
    ]
    if e.reference_weights:
        out.append(f"  {where} reference copy: {_gib(e.reference_weights)} (frozen weights)")
    if e.activations is not None:
        per_param = e.gradients / max(1.0, e.parameters.total)
        out.append(
            f"  {where} gradient buffers: {_gib(e.gradients)} ({per_param:.0f} bytes per parameter)"
        )
        host = f"; {_gib(e.optimizer_on_host)} on the host" if e.optimizer_on_host else ""
        sharded = " (distributed optimizer)" if optimizer.get("use_distributed_optimizer") else ""
        out.append(f"  {where} optimizer state: {_gib(e.optimizer)}{sharded}{host}")
        a = e.activations
        batches = "one micro-batch" if a.in_flight == 1 else f"{a.in_flight} micro-batches"
        removed = ", ".join(f"{name} -{_gib(b)}" for name, b in a.removed_by().items())
        out.append(
            f"  {where} activations: {_gib(a.total)} ({batches} of {a.tokens} tokens: "
            f"{a.tokens_source}; the ledger's {_gib(a.saved)}"
            + (f", {removed}" if removed else "")
            + ")"
        )
        for m in a.modules:
            if m.kept > 0:
                out.append(f"    {m.module:<34} {_gib(m.kept * a.in_flight):>10}")
        if a.layer_inputs:
            out.append(f"    {'(full recompute: layer inputs)':<34} {_gib(a.layer_inputs):>10}")
        if a.recomputed_segment:
            out.append(
                f"    {'(full recompute: one segment)':<34} {_gib(a.recomputed_segment):>10}"
            )
        out.append(f"    {'embedding, output, loss':<34} {_gib(a.model):>10}")
        if e.gradient_copies:
            out.append(
                f"  {where} optimizer step: +{_gib(e.gradient_copies)} (float32 copies of the "
                "gradients, kept until the next step)"
            )
        if e.step_temporaries:
            out.append(
                f"  {where} optimizer step: +{_gib(e.step_temporaries)} while it runs (torch's "
                "Adam: a float32 temporary of the parameters' size; no fused Adam without "
                "Transformer Engine or Apex)"
            )
    out.append(f"  {where} forward-only pass: +{_gib(e.forward_only)} (logits and one layer)")
    if e.kv_cache:
        out.append(
            f"  {where} generation KV cache: {_gib(e.kv_cache)} ({e.kv_cache_rows} sequences "
            f"of up to {e.kv_cache_length} tokens per data-parallel rank)"
        )
    phases = ", ".join(f"{name} {_gib(b)}" for name, b in e.phases().items())
    out.append(f"  {where} phases: {phases}")
    out += [f"  note: {note}" for note in e.notes]
    return out


def memory_estimate(
    recipe: dict[str, Any],
    algorithm: str | None,
    *,
    gpu_memory_gib: float | None = None,
    base_dir: Path | None = None,
) -> EstimateReport:
    """The estimate of a valid recipe for ``validate``: never raises; what cannot be estimated
    here is one line saying so."""
    from nemo_rl_offload.config.model_presets import ModelNotOnMachine

    report = EstimateReport()
    for where in SECTIONS:
        if not isinstance(recipe.get(where), dict):
            continue
        try:
            report.estimates.append(_estimate(recipe, algorithm, where, base_dir))
        except ModelNotOnMachine:
            report.lines.append(
                f"memory estimate: skipped ({where}.model_name is not on this machine, so its "
                "shapes are unknown)"
            )
            return report
        except Exception as exc:  # validate answers with its checks even if this fails
            reason = " ".join(str(exc).split()) or type(exc).__name__
            report.lines.append(f"memory estimate: skipped ({where}: {reason})")
            return report
    cluster = recipe.get("cluster") or {}
    on_gpu = int(cluster.get("gpus_per_node") or 0) > 0
    gib, source = gpu_memory(gpu_memory_gib)
    if on_gpu:
        report.estimates = [_chunked_sampling(e, report.estimates, gib) for e in report.estimates]
    peak, label = gpu_peak(report.estimates)
    report.lines.append(
        "memory estimate per GPU (one worker of each group; allocator slack, CUDA context and "
        "backward temporaries not counted):"
    )
    for e in report.estimates:
        report.lines += _lines(e, recipe[e.where])
    if not on_gpu:
        report.lines.append(
            f"  peak: {_gib(peak)} ({label}); CPU workers (cluster.gpus_per_node 0): not "
            "compared with a GPU"
        )
        return report
    report.lines.append(f"  peak: {_gib(peak)} ({label}) of {gib:.2f} GiB GPU memory ({source})")
    if peak > gib * GIB:
        report.warnings.append(
            f"warning: memory estimate: {_gib(peak)} per GPU ({label}) is more than the GPU's "
            f"{gib:.2f} GiB; {_advice(label, algorithm)}"
        )
    return report


def _chunked_sampling(
    estimate: MemoryEstimate, estimates: list[MemoryEstimate], gpu_gib: float
) -> MemoryEstimate:
    """``estimate`` with the KV cache the sampler allocates at most: a step whose cache is over
    ``KV_CACHE_FREE_FRACTION`` of the memory left free by every worker on the GPU is sampled in
    chunks of rows that fit it (policy/generation.py)."""
    from nemo_rl_offload.policy.generation import KV_CACHE_FREE_FRACTION

    if not estimate.kv_cache:
        return estimate
    kept = sum(e.between_steps for e in estimates)
    cap = KV_CACHE_FREE_FRACTION * max(0.0, gpu_gib * GIB - kept)
    if estimate.kv_cache <= cap:
        return estimate
    per_row = estimate.kv_cache / max(1, estimate.kv_cache_rows)
    rows = int(cap // per_row) if per_row else 0
    if rows < 1:
        note = (
            f"{estimate.where}.generation: one sequence's KV cache ({_gib(per_row)}) is over "
            f"{KV_CACHE_FREE_FRACTION:.0%} of the GPU memory left free; the sampler refuses it"
        )
        return dataclasses.replace(estimate, notes=[*estimate.notes, note])
    note = (
        f"{estimate.where}.generation: a full step's KV cache ({_gib(estimate.kv_cache)}) is "
        f"over {KV_CACHE_FREE_FRACTION:.0%} of the GPU memory left free: the sampler takes "
        f"chunks of about {rows} sequences; the estimate counts one chunk's cache"
    )
    return dataclasses.replace(estimate, kv_cache=rows * per_row, notes=[*estimate.notes, note])


def _advice(label: str, algorithm: str | None) -> str:
    """What to try for the phase that peaks."""
    m = "policy.megatron_cfg"
    if label.endswith("generation"):
        return (
            f"lower {algorithm}.num_prompts_per_step or num_generations_per_prompt, "
            "policy.generation.max_new_tokens or policy.max_total_sequence_length, or use "
            "more GPUs"
        )
    if label.endswith("training"):
        return (
            f"try an offload module ({m}.offload_modules), recompute "
            f"({m}.activation_checkpointing), or `nemo-rl-offload plan` to pick settings "
            "for a budget"
        )
    return (
        f"try {m}.optimizer.use_distributed_optimizer with more GPUs, or "
        f"{m}.optimizer.optimizer_cpu_offload"
    )
