"""A step's throughput in NeMo-RL's units and names (its algorithms/utils.py performance
metrics): tokens (prompt and response) per second per GPU end to end and per phase, samples per
second per GPU, training TFLOP/s per GPU and model FLOPs utilization. All workers share the
GPUs (generation is colocated), so every phase divides by all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_rl_offload.config.policy_settings import PolicySettings


@dataclass(frozen=True)
class StepMeter:
    """A step body's throughput metrics: its phases' seconds under NeMo-RL's timer names
    (``timing/train/<phase>``) and :func:`step_throughput` over the policy's GPUs."""

    training_flops: Callable[[list[int]], float]
    gpus: int

    @classmethod
    def for_policy(cls, settings: PolicySettings, gpus: int) -> StepMeter:
        """The meter of a policy on ``gpus`` workers: its model FLOPs
        (:func:`nemo_rl_offload.models.flops.training_flops`) from its effective settings."""
        from nemo_rl_offload.models.flops import training_flops

        effective, vocab = settings.effective, settings.architecture.vocab_size
        return cls(lambda lengths: training_flops(effective, vocab, lengths), gpus)

    def metrics(
        self,
        lengths: list[int],
        *,
        elapsed_s: float,
        phases_s: dict[str, float],
        train_metrics: dict[str, float],
    ) -> dict[str, float]:
        """The step's timers and throughputs; ``train_metrics`` (the workers' training step)
        gives the GPU's peak (``device_peak_bf16_tflops``, absent on CPU workers)."""
        out = {f"timing/train/{name}": seconds for name, seconds in phases_s.items()}
        out.update(
            step_throughput(
                lengths=lengths,
                gpus=self.gpus,
                elapsed_s=elapsed_s,
                phases_s=phases_s,
                training_flops=self.training_flops(lengths),
                peak_tflops=float(train_metrics.get("device_peak_bf16_tflops", 0.0)),
            )
        )
        return out


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


@dataclass
class DecodeWork:
    """What a step's sampling had to read, for the generation floor (benchmarks/rl_step.py):
    each generation batch decodes until its longest response ends, every decode step reads the
    weights once, and each row's step reads its keys and values up to its current length."""

    rows: int = 0
    decode_steps: int = 0  # over the batches: each batch's longest response
    attended_positions: int = 0  # over rows and their decode steps: the positions read

    def add(self, prompts: Sequence[Any], responses: Sequence[Sequence[int]]) -> None:
        """One generation batch: ``prompts`` (with ``.ids``) and their ``responses``."""
        if not responses:
            return
        self.rows += len(responses)
        longest = max(len(r) for r in responses)
        self.decode_steps += longest
        for prompt, response in zip(prompts, responses, strict=True):
            start, new = len(prompt.ids), len(response)
            self.attended_positions += new * start + new * (new - 1) // 2

    def metrics(self) -> dict[str, float]:
        return {
            "generation_rows": float(self.rows),
            "generation_decode_steps": float(self.decode_steps),
            "generation_attended_positions": float(self.attended_positions),
        }
