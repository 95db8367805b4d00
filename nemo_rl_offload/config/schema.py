"""The recipe schema: one TypedDict per YAML section, with NeMo-RL's section and key names.

Why TypedDicts: the runtime passes plain dicts (they cross Ray process boundaries and are printed
back to users as YAML), while the TypedDicts document every key and let pydantic validate a whole
recipe in one pass. Every section forbids unknown keys so that a typo such as
``fine_grained_activation_offload`` fails before anything starts instead of being ignored.

Types here are strict (YAML already gives real ints, floats and bools): ``"5"`` is not a number,
``true`` is not an integer. Ranges and cross-key compatibility of the offload settings are not
checked here: they belong to :mod:`nemo_rl_offload.offload.rules`, their single owner. Keys marked
``NotRequired`` fall back to the default named in their comment (or Megatron-core's own default
for TransformerConfig fields) when absent.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

from pydantic import ConfigDict, with_config

_STRICT = ConfigDict(extra="forbid", strict=True)

Precision = Literal["float32", "bfloat16", "float16"]
CudaGraphImpl = Literal["none", "local", "transformer_engine", "full_iteration"]
CudaGraphModuleName = Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"]
Number = float  # strict float still accepts ints (not bools)


# --------------------------------------------------------------------------- policy.megatron_cfg


@with_config(_STRICT)
class MegatronOptimizerConfig(TypedDict):
    """Megatron-core OptimizerConfig fields, NeMo-RL names."""

    optimizer: Literal["adam", "sgd"]
    lr: Number
    min_lr: NotRequired[Number]  # default: lr (constant)
    weight_decay: NotRequired[Number]  # default 0.01
    bf16: NotRequired[bool]
    fp16: NotRequired[bool]
    params_dtype: NotRequired[Precision]
    adam_beta1: NotRequired[Number]
    adam_beta2: NotRequired[Number]
    adam_eps: NotRequired[Number]
    sgd_momentum: NotRequired[Number]
    use_distributed_optimizer: NotRequired[bool]
    use_precision_aware_optimizer: NotRequired[bool]
    clip_grad: NotRequired[Number | None]
    optimizer_cpu_offload: NotRequired[bool]
    optimizer_offload_fraction: NotRequired[Number]


@with_config(_STRICT)
class MegatronSchedulerConfig(TypedDict):
    """Megatron-core OptimizerParamScheduler settings, NeMo-RL names."""

    start_weight_decay: NotRequired[Number]
    end_weight_decay: NotRequired[Number]
    weight_decay_incr_style: NotRequired[Literal["constant", "linear", "cosine"]]
    lr_decay_style: NotRequired[Literal["constant", "linear", "cosine", "inverse-square-root"]]
    lr_decay_iters: NotRequired[int | None]
    lr_warmup_iters: NotRequired[int]
    lr_warmup_init: NotRequired[Number]


@with_config(_STRICT)
class DistributedDataParallelConfig(TypedDict):
    """Megatron-core DistributedDataParallelConfig fields, NeMo-RL names."""

    grad_reduce_in_fp32: NotRequired[bool]
    overlap_grad_reduce: NotRequired[bool]
    overlap_param_gather: NotRequired[bool]
    average_in_collective: NotRequired[bool]
    use_custom_fsdp: NotRequired[bool]
    data_parallel_sharding_strategy: NotRequired[
        Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
    ]


@with_config(_STRICT)
class MegatronConfig(TypedDict):
    """``policy.megatron_cfg``: the Megatron backend, its parallelism and every offload knob."""

    enabled: bool
    empty_unused_memory_level: NotRequired[Literal[0, 1, 2]]  # default 0
    # NeMo-RL's switch for full activation recompute (granularity full, uniform, 1 layer).
    activation_checkpointing: NotRequired[bool]
    # Parallelism (defaults 1; expert_tensor_parallel_size null means "same as tensor").
    tensor_model_parallel_size: NotRequired[int]
    pipeline_model_parallel_size: NotRequired[int]
    context_parallel_size: NotRequired[int]
    expert_model_parallel_size: NotRequired[int]
    expert_tensor_parallel_size: NotRequired[int | None]
    num_layers_in_first_pipeline_stage: NotRequired[int | None]
    num_layers_in_last_pipeline_stage: NotRequired[int | None]
    sequence_parallel: NotRequired[bool]
    pipeline_dtype: NotRequired[Precision | None]
    # MoE router settings (TransformerConfig fields).
    freeze_moe_router: NotRequired[bool]
    moe_router_dtype: NotRequired[Literal["fp32", "fp64"] | None]
    moe_router_load_balancing_type: NotRequired[
        Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
    ]
    moe_router_bias_update_rate: NotRequired[Number]
    moe_permute_fusion: NotRequired[bool]
    apply_rope_fusion: NotRequired[bool]
    bias_activation_fusion: NotRequired[bool]
    # Fine-grained activation offloading (TransformerConfig names; unset keeps Megatron's default).
    fine_grained_activation_offloading: NotRequired[bool]  # default false
    offload_modules: NotRequired[list[str] | None]  # default null
    min_offloaded_tensor_size: NotRequired[int]  # Megatron default 1048576 elements
    activation_offload_fraction: NotRequired[Number]  # Megatron default 1.0
    # Which groups a fraction below 1 offloads: "spread" evenly over the forward pass (ours,
    # the default) or the "earliest" (Megatron's choice).
    activation_offload_fraction_placement: NotRequired[Literal["spread", "earliest"]]
    delay_offload_until_cuda_graph: NotRequired[bool]  # Megatron default false
    delta_offload_bytes_across_pp_ranks: NotRequired[int]  # Megatron default 0
    fine_grained_offloading_max_inflight_offloads: NotRequired[int | None]  # Megatron default null
    # Pinned host memory the offload plans of one worker may hold (one plan per step shape);
    # null: half the host's RAM divided by its GPUs.
    offload_host_memory_budget_gib: NotRequired[Number | None]
    # Lengths every micro-batch of an offloaded step is padded to (one plan per micro-batch
    # count x length); null: powers of two and their 1.5x from 32 up to max_total_sequence_length.
    offload_sequence_length_buckets: NotRequired[list[int] | None]
    # Peak GPU memory (GiB per worker) to plan for at start: the job first runs
    # `nemo-rl-offload plan` for it and trains with the chosen offload or recompute settings.
    offload_plan_budget_gib: NotRequired[Number | None]
    # Training CUDA graphs.
    cuda_graph_impl: NotRequired[CudaGraphImpl]  # default "none"
    cuda_graph_modules: NotRequired[list[CudaGraphModuleName] | None]  # [] = whole layer
    cuda_graph_warmup_steps: NotRequired[int]  # Megatron default 3
    # Activation recompute.
    recompute_granularity: NotRequired[Literal["full", "selective"] | None]
    recompute_method: NotRequired[Literal["uniform", "block"] | None]
    recompute_num_layers: NotRequired[int | None]
    recompute_modules: NotRequired[list[str] | None]
    # "auto" (default) picks transformer_engine when Transformer Engine is installed, else local.
    transformer_impl: NotRequired[Literal["auto", "local", "transformer_engine"]]
    env_vars: NotRequired[dict[str, str] | None]
    # Any other TransformerConfig field, applied last-but-one (the keys above win on conflict,
    # and a conflict is reported).
    model_overrides: NotRequired[dict[str, Any] | None]
    # Required for the trained policy (checked in preflight); a teacher never steps.
    optimizer: NotRequired[MegatronOptimizerConfig]
    scheduler: NotRequired[MegatronSchedulerConfig]
    distributed_data_parallel_config: NotRequired[DistributedDataParallelConfig]


# --------------------------------------------------------------------------------------- policy


@with_config(_STRICT)
class TokenizerConfig(TypedDict):
    # null: the byte-level tokenizer for presets, or the model directory's own HF tokenizer.
    name: NotRequired[str | None]
    chat_template_kwargs: NotRequired[dict[str, Any] | None]


@with_config(_STRICT)
class GenerationConfig(TypedDict):
    """Sampling settings. Generation runs on the policy workers themselves (backend megatron)."""

    backend: Literal["megatron"]
    max_new_tokens: int
    temperature: Number
    top_p: NotRequired[Number]  # default 1.0
    top_k: NotRequired[int | None]
    stop_token_ids: NotRequired[list[int] | None]
    stop_strings: NotRequired[list[str] | None]


@with_config(_STRICT)
class PolicyConfig(TypedDict):
    # A preset name (see nemo_rl_offload.config.model_presets) or a local Hugging Face directory.
    model_name: str
    tokenizer: NotRequired[TokenizerConfig]
    train_global_batch_size: int
    train_micro_batch_size: int
    generation_batch_size: NotRequired[int]
    logprob_batch_size: NotRequired[int]  # default: train_micro_batch_size
    max_total_sequence_length: int
    precision: Precision
    max_grad_norm: NotRequired[Number | None]
    make_sequence_length_divisible_by: NotRequired[int]
    megatron_cfg: MegatronConfig
    generation: NotRequired[GenerationConfig | None]
    # Start from these weights: a checkpoint step directory, or a checkpoint_dir (its latest
    # step), e.g. the SFT run's before GRPO. Resuming the run's own checkpoint_dir wins.
    init_checkpoint: NotRequired[str | None]


# ------------------------------------------------------------------------- the other sections


@with_config(_STRICT)
class ClusterConfig(TypedDict):
    gpus_per_node: int  # 0 runs the workers on CPU
    num_nodes: int
    # Ray cluster to join ("auto", "ray://host:port", ...); null starts an embedded local cluster.
    # RAY_ADDRESS in the environment takes the same role.
    address: NotRequired[str | None]
    num_cpu_workers: NotRequired[int]  # workers when gpus_per_node is 0 (default 1)


@with_config(_STRICT)
class LoggerConfig(TypedDict):
    log_dir: str
    tensorboard_enabled: NotRequired[bool]
    monitor_gpus: NotRequired[bool]
    num_val_samples_to_print: NotRequired[int]


@with_config(_STRICT)
class CheckpointingConfig(TypedDict):
    enabled: bool
    checkpoint_dir: str
    metric_name: NotRequired[str | None]
    higher_is_better: NotRequired[bool]
    keep_top_k: NotRequired[int | None]
    save_period: NotRequired[int]
    checkpoint_must_save_by: NotRequired[str | None]


@with_config(_STRICT)
class DataConfig(TypedDict):
    # "arithmetic" is the built-in synthetic task; "jsonl" reads the paths below.
    dataset_name: str
    max_input_seq_length: NotRequired[int]
    shuffle: NotRequired[bool]
    seed: NotRequired[int]
    train_data_path: NotRequired[str | None]
    val_data_path: NotRequired[str | None]
    num_train_samples: NotRequired[int]
    num_val_samples: NotRequired[int]
    # The arithmetic task's problems: operators and operand ranges (0..max).
    arithmetic_ops: NotRequired[list[Literal["+", "-", "*"]]]
    max_operand: NotRequired[int]  # default 99
    max_factor: NotRequired[int]  # default 12 (multiplication)
    prompt_file: NotRequired[str | None]
    system_prompt_file: NotRequired[str | None]
    input_key: NotRequired[str]
    output_key: NotRequired[str]
    prompt_key: NotRequired[str]
    chosen_key: NotRequired[str]
    rejected_key: NotRequired[str]
    answer_key: NotRequired[str]


@with_config(_STRICT)
class MathEnvConfig(TypedDict):
    num_workers: NotRequired[int]


@with_config(_STRICT)
class EnvConfig(TypedDict):
    math: MathEnvConfig


# ------------------------------------------------------------------------ algorithm sections


@with_config(_STRICT)
class SFTConfig(TypedDict):
    max_num_epochs: int
    max_num_steps: int
    val_period: int
    val_batches: NotRequired[int]
    val_global_batch_size: NotRequired[int]
    val_micro_batch_size: NotRequired[int]
    val_at_start: NotRequired[bool]
    seed: int


@with_config(_STRICT)
class SFTLossConfig(TypedDict):
    # Average the token NLL over all tokens of the global batch (true) or per sequence (false).
    token_level_loss: NotRequired[bool]


@with_config(_STRICT)
class DPOConfig(TypedDict):
    max_num_epochs: int
    max_num_steps: int
    val_period: int
    val_batches: NotRequired[int]
    val_global_batch_size: NotRequired[int]
    val_micro_batch_size: NotRequired[int]
    val_at_start: NotRequired[bool]
    seed: int
    # The loss settings live here, as in NeMo-RL's dpo.yaml.
    reference_policy_kl_penalty: Number  # DPO's beta
    preference_average_log_probs: NotRequired[bool]
    sft_average_log_probs: NotRequired[bool]
    preference_loss_weight: NotRequired[Number]
    sft_loss_weight: NotRequired[Number]


@with_config(_STRICT)
class GRPOConfig(TypedDict):
    num_prompts_per_step: int
    num_generations_per_prompt: int
    max_rollout_turns: NotRequired[int]
    max_num_epochs: NotRequired[int]
    max_num_steps: int
    normalize_rewards: NotRequired[bool]
    use_leave_one_out_baseline: NotRequired[bool]
    val_period: int
    val_at_start: NotRequired[bool]
    max_val_samples: NotRequired[int]
    val_batch_size: NotRequired[int]
    seed: int


@with_config(_STRICT)
class GRPOLossConfig(TypedDict):
    reference_policy_kl_penalty: Number
    ratio_clip_min: Number
    ratio_clip_max: Number
    ratio_clip_c: NotRequired[Number | None]
    use_on_policy_kl_approximation: NotRequired[bool]
    use_importance_sampling_correction: NotRequired[bool]
    token_level_loss: NotRequired[bool]


@with_config(_STRICT)
class DistillationConfig(TypedDict):
    num_prompts_per_step: int
    num_generations_per_prompt: NotRequired[int]
    max_rollout_turns: NotRequired[int]
    max_num_steps: int
    max_num_epochs: NotRequired[int]
    val_batch_size: NotRequired[int]
    val_period: int
    val_at_start: NotRequired[bool]
    max_val_samples: NotRequired[int]
    topk_logits_k: NotRequired[int | None]
    seed: int


@with_config(_STRICT)
class DistillationLossConfig(TypedDict):
    kl_type: Literal["forward", "reverse", "mixed"]
    mixed_kl_weight: NotRequired[Number]  # weight of the forward KL when kl_type is "mixed"
    zero_outside_topk: NotRequired[bool]


# --------------------------------------------------------------------------- master configs


@with_config(_STRICT)
class SFTMasterConfig(TypedDict):
    sft: SFTConfig
    loss_fn: NotRequired[SFTLossConfig]
    policy: PolicyConfig
    data: DataConfig
    logger: LoggerConfig
    checkpointing: CheckpointingConfig
    cluster: ClusterConfig


@with_config(_STRICT)
class DPOMasterConfig(TypedDict):
    dpo: DPOConfig
    policy: PolicyConfig
    data: DataConfig
    logger: LoggerConfig
    checkpointing: CheckpointingConfig
    cluster: ClusterConfig


@with_config(_STRICT)
class GRPOMasterConfig(TypedDict):
    grpo: GRPOConfig
    loss_fn: GRPOLossConfig
    policy: PolicyConfig
    data: DataConfig
    env: EnvConfig
    logger: LoggerConfig
    checkpointing: CheckpointingConfig
    cluster: ClusterConfig


@with_config(_STRICT)
class DistillationMasterConfig(TypedDict):
    distillation: DistillationConfig
    loss_fn: DistillationLossConfig
    policy: PolicyConfig
    teacher: PolicyConfig
    data: DataConfig
    env: NotRequired[EnvConfig]
    logger: LoggerConfig
    checkpointing: CheckpointingConfig
    cluster: ClusterConfig


Algorithm = Literal["sft", "dpo", "grpo", "distillation"]

MASTER_CONFIGS: dict[str, type] = {
    "sft": SFTMasterConfig,
    "dpo": DPOMasterConfig,
    "grpo": GRPOMasterConfig,
    "distillation": DistillationMasterConfig,
}
