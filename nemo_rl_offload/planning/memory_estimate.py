"""A pre-launch estimate of one GPU's peak memory for a policy (or teacher) section.

A recipe that cannot fit should say so before a Ray cluster starts, and say where the bytes go.
The estimate is arithmetic over what the recipe decides plus the activation ledger, through
:mod:`.activation_bytes`; it is pure: the ledger is passed in, nothing is measured here. Its
phases and what it leaves out: docs/offloading.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.generation_settings import GenerationSettings
from nemo_rl_offload.config.megatron_settings import EffectiveSettings
from nemo_rl_offload.config.model_presets import Architecture
from nemo_rl_offload.config.model_shape import DENSE, MOE, layer_weights
from nemo_rl_offload.planning.activation_bytes import (
    ActivationEstimate,
    activations,
    dtype_bytes,
    parallel_sizes,
    stage_layer_counts,
    tp_share,
)
from nemo_rl_offload.planning.ledger import MODEL, Ledger

GIB = 2**30
DEFAULT_GPU_MEMORY_GIB = 80.0


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters one rank holds (its pipeline stage; split by tensor and expert parallelism)."""

    layers: float
    embedding: float
    output: float

    @property
    def total(self) -> float:
        return self.layers + self.embedding + self.output


@dataclass(frozen=True)
class MemoryEstimate:
    """One worker's estimate, in bytes, by part and by phase (:data:`PHASES`)."""

    where: str
    parameters: ParameterCounts
    weights: float
    reference_weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    optimizer_on_host: float = 0.0
    gradient_copies: float = 0.0  # float32 copies of 16-bit gradients, made by the step
    step_temporaries: float = 0.0  # held only while the optimizer steps (torch's Adam)
    activations: ActivationEstimate | None = None  # None: forward-only (a teacher)
    forward_only: float = 0.0
    kv_cache: float = 0.0
    kv_cache_rows: int = 0
    kv_cache_length: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def resident(self) -> float:
        """What stays allocated through a training step (its start: ``zero_grad`` has freed
        the gradient copies)."""
        return self.weights + self.reference_weights + self.gradients + self.optimizer

    @property
    def between_steps(self) -> float:
        """What stays allocated after a training step (forward-only passes, sampling)."""
        return self.resident + self.gradient_copies

    def phases(self) -> dict[str, float]:
        """Each phase's peak (bytes)."""
        out: dict[str, float] = {}
        if self.activations is not None:
            out["training"] = self.resident + self.activations.total
            out["optimizer step"] = self.between_steps + self.step_temporaries
        out["forward-only"] = self.between_steps + self.forward_only
        if self.kv_cache:
            out["generation"] = self.between_steps + self.kv_cache
        return out

    @property
    def peak(self) -> float:
        return max(self.phases().values())

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=lambda name: phases[name])


def gpu_peak(estimates: list[MemoryEstimate]) -> tuple[float, str]:
    """(bytes, "where phase") of the largest peak of workers that share one GPU (a policy and
    its teacher): each one's phases beside what the others keep between their steps."""
    best, label = 0.0, ""
    for estimate in estimates:
        others = sum(o.between_steps for o in estimates if o is not estimate)
        for phase, peak in estimate.phases().items():
            if peak + others > best:
                best, label = peak + others, f"{estimate.where} {phase}"
    return best, label


# ------------------------------------------------------------------------------ the parts


def parameter_counts(effective: EffectiveSettings, architecture: Architecture) -> ParameterCounts:
    """Parameters on one rank of the largest pipeline stage, from the effective settings."""
    v = effective.value
    vocab_size = architecture.vocab_size
    shared = architecture.share_embeddings_and_output_weights
    sizes = parallel_sizes(effective)
    tp, pp = sizes["tensor_model_parallel_size"], sizes["pipeline_model_parallel_size"]
    hidden, heads = int(v("hidden_size")), int(v("num_attention_heads"))
    head_dim = int(v("kv_channels") or hidden // heads)
    q_dim, kv_dim = heads * head_dim, int(v("num_query_groups") or heads) * head_dim
    gated = 2 if v("gated_linear_unit") else 1
    bias = bool(v("add_bias_linear", True))
    qkv_bias = bias or bool(v("add_qkv_bias"))
    norm = 2 * hidden if v("normalization") == "LayerNorm" else hidden
    weights = layer_weights(effective)
    attention = weights.attention + (q_dim + 2 * kv_dim) * qkv_bias + hidden * bias
    replicated = 2 * norm + (2 * head_dim if v("qk_layernorm") else 0)
    ffn = int(v("ffn_hidden_size") or 4 * hidden)
    dense = weights.dense_mlp + (ffn * gated + hidden) * bias
    counts = stage_layer_counts(effective)
    dense_layer = (attention + dense) / tp + replicated
    layers = counts.get(DENSE, 0) * dense_layer
    moe_layer = 0.0
    if counts.get(MOE):
        experts = int(v("num_moe_experts"))
        split = sizes["expert_model_parallel_size"] * sizes["expert_tensor_parallel_size"]
        moe = (attention + weights.shared_experts) / tp + experts * weights.expert / split
        moe_layer = moe + replicated + weights.router
        layers += counts[MOE] * moe_layer
    mtp = int(v("mtp_num_layers") or 0)
    if mtp:
        # Each MTP depth: a layer like the decoder's last, the projection of [embedding;
        # hidden] back to hidden, and three norms (one layer for every depth when repeated).
        copies = 1 if v("mtp_use_repeated_layer") else mtp
        layers += copies * ((moe_layer or dense_layer) + 2 * hidden * hidden / tp + 3 * norm)
    embedding = vocab_size * hidden / tp
    output = 0.0 if shared and pp == 1 else vocab_size * hidden / tp
    if pp > 1:  # the first stage holds the embedding, the last the output layer
        embedding, output = max(embedding, output), 0.0
    return ParameterCounts(layers=layers, embedding=embedding, output=output + norm)


def _data_parallel(effective: EffectiveSettings, workers: int) -> int:
    s = parallel_sizes(effective)
    model = (
        s["tensor_model_parallel_size"]
        * s["pipeline_model_parallel_size"]
        * s["context_parallel_size"]
    )
    return max(1, workers // model)


@dataclass(frozen=True)
class _Optimizer:
    on_gpu: float
    on_host: float
    gradient_copies: float
    step_temporaries: float


def _optimizer(
    params: float, param_bytes: int, megatron_cfg: dict[str, Any], shards: int, fused_adam: bool
) -> _Optimizer:
    """Adam: a float32 master copy of 16-bit weights and two moments (SGD: one momentum), over
    ``shards`` data-parallel ranks with the distributed optimizer; ``optimizer_cpu_offload``
    keeps ``optimizer_offload_fraction`` of it on the host. Without ``fused_adam``, torch's
    multi-tensor Adam computes ``sqrt(v) + eps`` for all the parameters it steps at once: one
    float32 temporary of their size during the step."""
    opt = megatron_cfg.get("optimizer") or {}
    sixteen_bit = param_bytes == 2
    # Whether the precision-aware optimizer runs (its fused Adam, or the hybrid CPU one).
    aware = megatron_settings.precision_aware_optimizer(opt, te_installed=fused_adam, on_gpu=True)
    master = (dtype_bytes(opt.get("main_params_dtype")) if aware else 4) if sixteen_bit else 0
    if opt.get("optimizer", "adam") == "sgd":
        states = 4 if opt.get("sgd_momentum") else 0
    else:
        states = dtype_bytes(opt.get("exp_avg_dtype")) if aware else 4
        states += dtype_bytes(opt.get("exp_avg_sq_dtype")) if aware else 4
    copies = 4 if sixteen_bit and not aware else 0
    adam = opt.get("optimizer", "adam") != "sgd"
    temporaries = 4 if adam and not fused_adam else 0
    if not opt.get("use_distributed_optimizer"):
        shards = 1
    host = float(opt.get("optimizer_offload_fraction") or 0.0)
    host = min(1.0, max(0.0, host)) if opt.get("optimizer_cpu_offload") else 0.0
    state = params * (master + states) / shards
    on_gpu = (1 - host) / shards
    # megatron-core's hybrid CPU optimizer (optimizer_cpu_offload) steps the share it keeps on
    # the GPU in float32 copies of the parameters, each given a float32 copy of its gradient
    # that stays until the next step (its zero_grad clears the 16-bit parameters' gradients,
    # not these): held through the training step. The planner's host-optimizer runs on an H100
    # showed it: a small share lowered the peak far less than its part of the state (see
    # docs/offloading.md).
    hybrid_grads = 4 if sixteen_bit and opt.get("optimizer_cpu_offload") else 0
    return _Optimizer(
        state * (1 - host) + params * hybrid_grads * on_gpu,
        state * host,
        params * copies * on_gpu,
        params * temporaries * on_gpu,
    )


def host_optimizer_state(
    effective: EffectiveSettings,
    architecture: Architecture,
    section: dict[str, Any],
    *,
    workers: int = 1,
) -> tuple[float, float, float]:
    """(bytes per share, bytes at no share, parameters) for the planner's host-optimizer
    candidates on one rank. What ``optimizer_cpu_offload`` at ``optimizer_offload_fraction`` s
    takes off the training step's resident optimizer state, against the recipe's own optimizer,
    is ``bytes at no share + s x bytes per share``: megatron-core's hybrid optimizer (through
    the precision-aware path) keeps more per parameter on the GPU than the plain distributed
    optimizer, so a small share can cost memory. ``parameters``: those whose Adam step the
    host runs at share 1."""
    megatron_cfg = section.get("megatron_cfg") or {}
    own = megatron_cfg.get("optimizer") or {}
    params = parameter_counts(effective, architecture).total
    shards = _data_parallel(effective, workers) * parallel_sizes(effective)["context_parallel_size"]
    param_bytes = dtype_bytes(section.get("precision") or "float32")

    def on_gpu(opt: dict[str, Any]) -> float:
        cfg = {**megatron_cfg, "optimizer": opt}
        return _optimizer(params, param_bytes, cfg, shards, False).on_gpu

    def hybrid(share: float) -> float:
        return on_gpu(
            {
                **own,
                "optimizer_cpu_offload": True,
                "optimizer_offload_fraction": share,
                "use_precision_aware_optimizer": True,
            }
        )

    sharded = shards if own.get("use_distributed_optimizer") else 1
    return hybrid(0.0) - hybrid(1.0), on_gpu(own) - hybrid(0.0), params / sharded


def _forward_only(
    effective: EffectiveSettings, ledger: Ledger, section: dict[str, Any], where: str
) -> float:
    """A forward-only pass's peak above the resident state: its logits (the ledger's model
    entries) and one layer's working set at the forward-only micro-batch's tokens."""
    from nemo_rl_offload.config.batching_settings import BatchingSettings

    batching = BatchingSettings.from_policy(section, where=where)
    sizes = parallel_sizes(effective)
    if batching.mode == "rows":
        tokens = batching.logprob_rows * int(section.get("max_total_sequence_length") or 0)
    else:
        tokens = batching.pack_length(training=False)
    tokens //= sizes["context_parallel_size"]
    tp = sizes["tensor_model_parallel_size"]
    model = layer = 0.0
    for kind in ledger.kinds:
        if kind.kind == MODEL:
            model = sum(e.bytes_at(tokens) for e in kind.entries) / tp
        else:
            layer = max(
                layer,
                sum(e.bytes_at(tokens) * tp_share(e.owner, effective) for e in kind.entries),
            )
    return model + layer


def kv_cache_bytes(
    effective: EffectiveSettings, rows: int, max_len: int, activation_bytes: int
) -> float:
    """The sampler's KV cache for ``rows`` sequences of up to ``max_len`` tokens: keys and
    values of every layer of the stage, the query groups split by tensor parallelism."""
    v = effective.value
    sizes = parallel_sizes(effective)
    hidden, heads = int(v("hidden_size")), int(v("num_attention_heads"))
    head_dim = int(v("kv_channels") or hidden // heads)
    groups = max(1, int(v("num_query_groups") or heads) // sizes["tensor_model_parallel_size"])
    layers = sum(stage_layer_counts(effective).values())
    return 2.0 * layers * rows * max_len * groups * head_dim * activation_bytes


def estimate_peak(
    effective: EffectiveSettings,
    architecture: Architecture,
    section: dict[str, Any],
    ledger: Ledger,
    *,
    where: str = "policy",
    workers: int = 1,
    trainable: bool = True,
    with_reference: bool = False,
    samples_per_step: int = 0,
    longest_prompt: int | None = None,
    fused_adam: bool = False,
) -> MemoryEstimate:
    """The peak GPU memory of one worker of ``section`` (see docs/offloading.md).

    ``effective``: the section's effective settings (:func:`.apply.effective_settings`, the
    candidate's for a planner); ``architecture``: its model (vocabulary, tied embeddings);
    ``ledger``: its activation ledger at the section's tokens per
    micro-batch; ``workers``: the group's workers (data-parallel size = workers / (tensor x
    pipeline x context parallel)); ``trainable``: False for a forward-only group (a teacher);
    ``with_reference``: the workers hold a frozen reference copy (DPO, GRPO with a KL
    penalty); ``samples_per_step``: sequences the group samples per step (0: it does not
    sample); ``longest_prompt``: the longest prompt's tokens where the recipe bounds it
    (``data.max_input_seq_length``): a sampled sequence is at most that plus
    ``generation.max_new_tokens``, and never more than ``max_total_sequence_length``;
    ``fused_adam``: the job's Megatron has a fused Adam (Transformer Engine or Apex installed
    on its GPU machine)."""
    megatron_cfg = section.get("megatron_cfg") or {}
    param_bytes = dtype_bytes(section.get("precision") or "float32")
    params = parameter_counts(effective, architecture)
    notes: list[str] = []
    weights = params.total * param_bytes
    estimate: dict[str, Any] = {"where": where, "parameters": params, "weights": weights}
    if with_reference:
        estimate["reference_weights"] = weights
    dp = _data_parallel(effective, workers)
    if trainable:
        ddp = megatron_cfg.get("distributed_data_parallel_config") or {}
        grad_bytes = 4 if ddp.get("grad_reduce_in_fp32") else param_bytes
        shards = dp * parallel_sizes(effective)["context_parallel_size"]
        opt = _optimizer(params.total, param_bytes, megatron_cfg, shards, fused_adam)
        estimate.update(
            gradients=params.total * grad_bytes,
            optimizer=opt.on_gpu,
            optimizer_on_host=opt.on_host,
            gradient_copies=opt.gradient_copies,
            step_temporaries=opt.step_temporaries,
            activations=activations(effective, ledger, activation_bytes=param_bytes),
        )
    estimate["forward_only"] = _forward_only(effective, ledger, section, where)
    if samples_per_step:
        rows = math.ceil(samples_per_step / dp)
        generation = GenerationSettings.from_section(section)
        max_len = int(section.get("max_total_sequence_length") or 0)
        if isinstance(longest_prompt, int) and generation.max_new_tokens is not None:
            max_len = min(max_len, longest_prompt + generation.max_new_tokens)
        kv = kv_cache_bytes(effective, rows, max_len, param_bytes)
        limit = generation.engine.buffer_size_gb
        if limit is not None and kv > limit * GIB:
            notes.append(
                f"{where}.generation.mcore_generation_config.buffer_size_gb: a full step's KV "
                f"cache ({kv / GIB:.2f} GiB) is over it: the sampler samples the step in chunks "
                f"of rows that fit it; the estimate counts {limit} GiB"
            )
            kv = float(limit) * GIB
        estimate.update(kv_cache=kv, kv_cache_rows=rows, kv_cache_length=max_len)
    if parallel_sizes(effective)["pipeline_model_parallel_size"] > 1:
        notes.append(
            "pipeline_model_parallel_size > 1: the first stage's layers for as many "
            "micro-batches as stages, beside the last stage's logits (an upper bound)"
        )
    return MemoryEstimate(notes=notes, **estimate)
