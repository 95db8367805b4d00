"""A step's throughput in NeMo-RL's units and names (its algorithms/utils.py performance
metrics): tokens (prompt and response) per second per GPU end to end and per phase, samples per
second per GPU, training TFLOP/s per GPU and model FLOPs utilization. All workers share the
GPUs (generation is colocated), so every phase divides by all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def flops_counter(policy_cfg: dict[str, Any]) -> Callable[[list[int]], float]:
    """Model FLOPs of a training step over sequences of the given lengths, for the policy of
    ``policy_cfg`` (:func:`nemo_rl_offload.models.flops.training_flops`)."""
    from nemo_rl_offload.config.model_presets import section_architecture
    from nemo_rl_offload.models.flops import training_flops
    from nemo_rl_offload.offload.apply import effective_settings

    architecture = section_architecture(policy_cfg, base_dir=Path.cwd())
    effective = effective_settings(policy_cfg, architecture, te_installed=False)
    return lambda lengths: training_flops(effective, architecture.vocab_size, lengths)


def step_throughput(
    *,
    lengths: list[int],
    gpus: int,
    elapsed_s: float,
    phases_s: dict[str, float],
    training_flops: float,
    peak_tflops: float,
) -> dict[str, float]:
    """NeMo-RL's per-GPU throughputs of one step of sequences of ``lengths`` tokens:
    ``phases_s`` holds the seconds of ``generation``, ``policy_and_reference_logprobs`` and
    ``policy_training`` (a phase under a millisecond, e.g. no log-probability pass, is left
    out). ``peak_tflops`` 0: utilization unknown (not reported)."""
    tokens, gpus = float(sum(lengths)), max(1, gpus)
    out: dict[str, float] = {}
    if elapsed_s > 0:
        out["samples_per_sec_per_gpu"] = len(lengths) / elapsed_s / gpus
        out["tokens_per_sec_per_gpu"] = tokens / elapsed_s / gpus
    for phase in ("policy_training", "policy_and_reference_logprobs"):
        seconds = phases_s.get(phase, 0.0)
        if seconds > 1e-3:
            out[f"{phase}_tokens_per_sec_per_gpu"] = tokens / seconds / gpus
    group = phases_s.get("policy_training", 0.0) + phases_s.get(
        "policy_and_reference_logprobs", 0.0
    )
    if group > 1e-3:
        out["training_worker_group_tokens_per_sec_per_gpu"] = tokens / group / gpus
    training = phases_s.get("policy_training", 0.0)
    if training > 1e-3 and training_flops > 0:
        out["train_flops_per_gpu"] = training_flops / training / gpus / 1e12
        if peak_tflops > 0:
            out["train_fp_utilization"] = out["train_flops_per_gpu"] / peak_tflops
    return out
