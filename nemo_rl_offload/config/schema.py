"""The recipe schema: one TypedDict per YAML section, with NeMo-RL's section and key names.

Why TypedDicts: the runtime passes plain dicts (they cross Ray process boundaries and are printed
back to users as YAML), while the TypedDicts document every key and let pydantic validate a whole
recipe in one pass. Every section forbids unknown keys so that a typo such as
``fine_grained_activation_offload`` fails before anything starts instead of being ignored.

Types here are strict (YAML already gives real ints, floats and bools): ``"5"`` is not a number,
``true`` is not an integer. Every value is bounded where its key is defined, by the named types
below (counts positive, rates finite and in range, sizes within what a run can address);
:mod:`nemo_rl_offload.config.value_bounds` adds the bounds one key sets for another (``min_lr``
at most ``lr``, a micro-batch within its batch). Keys typed ``AddressableInt`` are bounded
here in size only: their lower bound is checked where the key is acted on (offload/rules.py,
config/megatron_rules.py, grpo_options.py, peft.py, on_policy_distillation.py, preflight.py),
in a line that says what the value means. Ranges and cross-key compatibility of the offload
settings belong to :mod:`nemo_rl_offload.offload.rules`, their single owner. Keys marked
``NotRequired`` fall back to the default named in their comment (or Megatron-core's own default
for TransformerConfig fields) when absent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, TypedDict

from pydantic import ConfigDict, Field, with_config

_STRICT = ConfigDict(extra="forbid", strict=True)
# A section NeMo-RL itself leaves open (backend kwargs, environment variables, dataset- or
# sink-specific options): the keys named here are typed, any other key is taken as it is.
_OPEN = ConfigDict(extra="allow", strict=True)
# A NeMo-RL section this backend does not act on as a whole (see config/ignored_keys.py): only
# its type is checked here, every key of it is the registry's.
OpenSection = dict[str, Any]

Precision = Literal["float32", "bfloat16", "float16"]
CudaGraphImpl = Literal["none", "local", "transformer_engine", "full_iteration"]
CudaGraphModuleName = Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"]

# ------------------------------------------------------------------------------ value bounds
# Each bound's ``description`` is the fix config/validate.py prints after the violated bound.

# The most a count or a token length may be: a run indexes samples and tokens with 32-bit
# integers (a micro-batch of 1e26 rows is refused here, not in a worker).
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**32 - 1  # numpy's seeds, as NeMo-RL seeds every generator

PositiveInt = Annotated[
    int, Field(ge=1, le=MAX_COUNT, description=f"set a positive count (1 to {MAX_COUNT})")
]
NonNegativeInt = Annotated[
    int, Field(ge=0, le=MAX_COUNT, description=f"set 0 or a positive count (up to {MAX_COUNT})")
]
SequenceLength = Annotated[
    int, Field(ge=1, le=MAX_COUNT, description=f"set a length of 1 to {MAX_COUNT} tokens")
]
# An integer whose lower bound the module acting on the key checks (module docstring); here
# only its size.
AddressableInt = Annotated[
    int,
    Field(ge=-MAX_COUNT, le=MAX_COUNT, description=f"set a value from -{MAX_COUNT} to {MAX_COUNT}"),
]
# Validation every val_period steps; 0 or -1 (both in NeMo-RL's recipes): never.
Period = Annotated[
    int,
    Field(ge=-1, le=MAX_COUNT, description="set a number of steps, or 0 (or -1) for never"),
]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description=f"set a seed from 0 to {MAX_SEED}")]
Port = Annotated[int, Field(ge=1, le=65535, description="set a port number from 1 to 65535")]
# top_k: null or -1 sample without a top-k cut (NeMo-RL's two spellings); 0 is refused by
# config/value_bounds.py, as NeMo-RL refuses it.
TopK = Annotated[
    int,
    Field(ge=-1, le=MAX_COUNT, description="set -1 or null for no top-k cut, or a count from 1"),
]

FiniteFloat = Annotated[float, Field(allow_inf_nan=False, description="set a finite number")]
Number = FiniteFloat  # strict float still accepts ints (not bools)
PositiveFloat = Annotated[
    float, Field(gt=0, allow_inf_nan=False, description="set a finite number above 0")
]
NonNegativeFloat = Annotated[
    float, Field(ge=0, allow_inf_nan=False, description="set a finite number, 0 or more")
]
Fraction = Annotated[
    float, Field(ge=0, le=1, allow_inf_nan=False, description="set a fraction from 0 to 1")
]
# Adam's betas and SGD's momentum: the share of the running average kept each step.
Decay = Annotated[
    float,
    Field(ge=0, lt=1, allow_inf_nan=False, description="set a number from 0 to below 1"),
]
# top_p: the probability mass sampled from; 1 samples from all of it.
TopP = Annotated[
    float,
    Field(gt=0, le=1, allow_inf_nan=False, description="set a number above 0, at most 1 (1: off)"),
]


# --------------------------------------------------------------------------- policy.megatron_cfg


@with_config(_STRICT)
class MegatronOptimizerConfig(TypedDict):
    """Megatron-core OptimizerConfig fields, NeMo-RL names."""

    optimizer: Literal["adam", "sgd"]
    lr: PositiveFloat
    min_lr: NotRequired[NonNegativeFloat]  # default: lr (constant)
    weight_decay: NotRequired[NonNegativeFloat]  # default 0.01
    bf16: NotRequired[bool]
    fp16: NotRequired[bool]
    params_dtype: NotRequired[Precision]
    adam_beta1: NotRequired[Decay]
    adam_beta2: NotRequired[Decay]
    adam_eps: NotRequired[PositiveFloat]
    sgd_momentum: NotRequired[Decay]
    use_distributed_optimizer: NotRequired[bool]
    use_precision_aware_optimizer: NotRequired[bool]
    # Decay biases and 1-D weights (norms) too, as torch's AdamW over all parameters does
    # (default false: megatron-core exempts them). DTensor recipes are mapped with true.
    weight_decay_all_params: NotRequired[bool]
    clip_grad: NotRequired[NonNegativeFloat | None]
    optimizer_cpu_offload: NotRequired[bool]
    optimizer_offload_fraction: NotRequired[Fraction]
    overlap_cpu_optimizer_d2h_h2d: NotRequired[bool]


@with_config(_STRICT)
class MegatronSchedulerConfig(TypedDict):
    """Megatron-core OptimizerParamScheduler settings, NeMo-RL names."""

    start_weight_decay: NotRequired[NonNegativeFloat]
    end_weight_decay: NotRequired[NonNegativeFloat]
    weight_decay_incr_style: NotRequired[Literal["constant", "linear", "cosine"]]
    lr_decay_style: NotRequired[Literal["constant", "linear", "cosine", "inverse-square-root"]]
    lr_decay_iters: NotRequired[PositiveInt | None]
    lr_warmup_iters: NotRequired[NonNegativeInt]
    lr_warmup_init: NotRequired[NonNegativeFloat]
    override_opt_param_scheduler: NotRequired[bool]


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
class MegatronFp8Config(TypedDict):
    """``megatron_cfg.fp8_cfg``: FP8 training (NeMo-RL's names)."""

    enabled: bool
    fp8: NotRequired[str | None]
    fp8_recipe: NotRequired[str | None]
    fp8_param: NotRequired[bool]


@with_config(_STRICT)
class MegatronPeftConfig(TypedDict):
    """``megatron_cfg.peft``: LoRA adapters (NeMo-RL's names)."""

    enabled: bool
    target_modules: NotRequired[list[str]]
    exclude_modules: NotRequired[list[str]]
    dim: NotRequired[AddressableInt]
    alpha: NotRequired[AddressableInt]
    dropout: NotRequired[Number]
    dropout_position: NotRequired[Literal["pre", "post"]]
    lora_A_init_method: NotRequired[str]
    lora_B_init_method: NotRequired[str]
    a2a_experimental: NotRequired[bool]
    lora_dtype: NotRequired[str | None]


@with_config(_STRICT)
class MegatronCheckpointConfig(TypedDict):
    """``megatron_cfg.checkpoint``: how NeMo-RL's Megatron backend writes checkpoint files."""

    async_save: NotRequired[bool]
    ckpt_assume_constant_structure: NotRequired[bool]
    ckpt_fully_parallel_save_process_group: NotRequired[str]
    ckpt_fully_parallel_load_process_group: NotRequired[str]
    ckpt_fully_parallel_load_exchange_algo: NotRequired[str]


@with_config(_STRICT)
class MegatronConfig(TypedDict):
    """``policy.megatron_cfg``: the Megatron backend, its parallelism and every offload knob."""

    enabled: bool
    empty_unused_memory_level: NotRequired[Literal[0, 1, 2]]  # default 0
    # NeMo-RL's switch for full activation recompute (granularity full, uniform, 1 layer).
    activation_checkpointing: NotRequired[bool]
    # Parallelism (defaults 1; expert_tensor_parallel_size null means "same as tensor").
    tensor_model_parallel_size: NotRequired[PositiveInt]
    pipeline_model_parallel_size: NotRequired[PositiveInt]
    context_parallel_size: NotRequired[PositiveInt]
    expert_model_parallel_size: NotRequired[PositiveInt]
    expert_tensor_parallel_size: NotRequired[PositiveInt | None]
    num_layers_in_first_pipeline_stage: NotRequired[NonNegativeInt | None]
    num_layers_in_last_pipeline_stage: NotRequired[NonNegativeInt | None]
    sequence_parallel: NotRequired[bool]
    pipeline_dtype: NotRequired[Precision | None]
    # MoE router settings (TransformerConfig fields).
    freeze_moe_router: NotRequired[bool]
    moe_router_dtype: NotRequired[Literal["fp32", "fp64"] | None]
    moe_router_load_balancing_type: NotRequired[
        Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
    ]
    moe_router_bias_update_rate: NotRequired[NonNegativeFloat]
    moe_permute_fusion: NotRequired[bool]
    apply_rope_fusion: NotRequired[bool]
    # With policy.logprob_chunk_size: the output layer runs in those chunks too, each chunk's
    # logits recomputed in the backward (ours; default false: only the log-softmax in chunks).
    chunked_output_layer: NotRequired[bool]
    bias_activation_fusion: NotRequired[bool]
    # Fine-grained activation offloading (TransformerConfig names; unset keeps Megatron's default).
    fine_grained_activation_offloading: NotRequired[bool]  # default false
    offload_modules: NotRequired[list[str] | None]  # default null
    min_offloaded_tensor_size: NotRequired[AddressableInt]  # Megatron default 1048576 elements
    activation_offload_fraction: NotRequired[Number]  # Megatron default 1.0
    # Per offload module, the fraction of its groups offloaded (spread over the layers), in
    # place of activation_offload_fraction for that module, e.g. {attn_proj: 0.5}.
    activation_offload_fraction_by_module: NotRequired[dict[str, Number] | None]
    # Which groups a fraction below 1 offloads: "spread" evenly over the forward pass (ours,
    # the default) or the "earliest" (Megatron's choice).
    activation_offload_fraction_placement: NotRequired[Literal["spread", "earliest"]]
    delay_offload_until_cuda_graph: NotRequired[bool]  # Megatron default false
    delta_offload_bytes_across_pp_ranks: NotRequired[AddressableInt]  # Megatron default 0
    # Megatron default null.
    fine_grained_offloading_max_inflight_offloads: NotRequired[PositiveInt | None]
    # Pinned host memory the offload plans of one worker may hold (one plan per step shape);
    # null: half the host's RAM divided by its GPUs.
    offload_host_memory_budget_gib: NotRequired[Number | None]
    # Lengths every micro-batch of an offloaded step is padded to (one plan per micro-batch
    # count x length); null: powers of two and their 1.5x from 32 up to max_total_sequence_length.
    offload_sequence_length_buckets: NotRequired[list[AddressableInt] | None]
    # Peak GPU memory (GiB per worker) to plan for at start: the job first runs
    # `nemo-rl-offload plan` for it and trains with the chosen offload or recompute settings.
    offload_plan_budget_gib: NotRequired[Number | None]
    # Training CUDA graphs.
    cuda_graph_impl: NotRequired[CudaGraphImpl]  # default "none"
    cuda_graph_modules: NotRequired[list[CudaGraphModuleName] | None]  # [] = whole layer
    cuda_graph_warmup_steps: NotRequired[AddressableInt]  # Megatron default 3
    # Activation recompute.
    recompute_granularity: NotRequired[Literal["full", "selective"] | None]
    recompute_method: NotRequired[Literal["uniform", "block"] | None]
    recompute_num_layers: NotRequired[PositiveInt | None]
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
    # NeMo-RL keys this backend does not act on (config/ignored_keys.py says how each is
    # treated); typed as NeMo-RL types them.
    attention_backend: NotRequired[str]
    calculate_per_token_loss: NotRequired[bool]
    checkpoint: NotRequired[MegatronCheckpointConfig]
    clear_memory_caches_before_refit: NotRequired[bool]
    converter_type: NotRequired[str]
    cp_normalize: NotRequired[bool]
    defer_fp32_logits: NotRequired[bool]
    do_not_average_loss: NotRequired[bool]
    force_reconvert_from_hf: NotRequired[bool]
    fp8_cfg: NotRequired[MegatronFp8Config | None]
    freeze_config: NotRequired[OpenSection | None]
    freeze_vision_model: NotRequired[bool]
    freeze_vision_projection: NotRequired[bool]
    fused_linear_logprobs_chunk_size: NotRequired[PositiveInt]
    gradient_accumulation_fusion: NotRequired[bool]
    hybridep_num_ranks_per_nvlink_domain: NotRequired[PositiveInt]
    hybridep_use_mnnvl: NotRequired[bool]
    inference_grouped_gemm_backend: NotRequired[str]
    inference_moe_token_dispatcher_type: NotRequired[str]
    moe_aux_loss_coeff: NotRequired[NonNegativeFloat]
    moe_enable_deepep: NotRequired[bool]
    moe_flex_dispatcher_backend: NotRequired[str]
    moe_grouped_gemm: NotRequired[bool]
    moe_hybridep_num_sms: NotRequired[PositiveInt]
    moe_pad_experts_for_cuda_graph_inference: NotRequired[bool]
    moe_per_layer_logging: NotRequired[bool]
    moe_router_enable_expert_bias: NotRequired[bool]
    moe_router_group_topk: NotRequired[PositiveInt | None]
    moe_router_num_groups: NotRequired[PositiveInt | None]
    moe_shared_expert_overlap: NotRequired[bool]
    moe_token_dispatcher_type: NotRequired[Literal["allgather", "alltoall", "flex"]]
    mtp_detach_heads: NotRequired[bool]
    mtp_loss_scaling_factor: NotRequired[Number]
    mtp_num_layers: NotRequired[AddressableInt | None]
    mtp_use_repeated_layer: NotRequired[bool]
    peft: NotRequired[MegatronPeftConfig | None]
    scale_loss_by_dp_cp_size: NotRequired[bool]
    track_moe_metrics: NotRequired[bool]
    train_iters: NotRequired[PositiveInt]
    use_fused_linear_logprobs: NotRequired[bool]
    use_fused_weighted_squared_relu: NotRequired[bool]
    use_gloo_process_groups: NotRequired[bool]


# --------------------------------------------------------------------------------------- policy


@with_config(_STRICT)
class TokenizerConfig(TypedDict):
    # null: the byte-level tokenizer for presets, or the model directory's own HF tokenizer.
    name: NotRequired[str | None]
    chat_template_kwargs: NotRequired[dict[str, Any] | None]
    chat_template: NotRequired[str | None]
    use_fastokens: NotRequired[bool]
    use_processor: NotRequired[bool]
    audio: NotRequired[OpenSection]
    video: NotRequired[OpenSection]


@with_config(_OPEN)
class ColocationResources(TypedDict):
    gpus_per_node: NotRequired[NonNegativeInt | None]
    num_nodes: NotRequired[PositiveInt | None]


@with_config(_STRICT)
class ColocationConfig(TypedDict):
    enabled: bool
    resources: NotRequired[ColocationResources]


@with_config(_STRICT)
class GenerationConfig(TypedDict):
    """Sampling settings. Generation runs on the policy workers themselves with megatron-core,
    whichever NeMo-RL backend the recipe names (config/ignored_keys.py says so for the others)."""

    backend: Literal["megatron", "vllm", "sglang", "trtllm", "dynamo"]
    max_new_tokens: SequenceLength
    temperature: PositiveFloat
    top_p: NotRequired[TopP]  # default 1.0
    top_k: NotRequired[TopK | None]
    stop_token_ids: NotRequired[list[NonNegativeInt] | None]
    stop_strings: NotRequired[list[str] | None]
    # Validation sampling (NeMo-RL defaults: the training values).
    val_temperature: NotRequired[PositiveFloat | None]
    val_top_p: NotRequired[TopP | None]
    val_top_k: NotRequired[TopK | None]
    model_name: NotRequired[str]
    bad_words: NotRequired[list[str] | None]
    colocated: NotRequired[ColocationConfig]
    port_range_low: NotRequired[Port]
    port_range_high: NotRequired[Port]
    use_async_rollouts: NotRequired[bool]
    # The other NeMo-RL generation backends' own settings (open, as in NeMo-RL).
    vllm_cfg: NotRequired[OpenSection | None]
    vllm_kwargs: NotRequired[OpenSection | None]
    sglang_cfg: NotRequired[OpenSection | None]
    sglang_kwargs: NotRequired[OpenSection | None]
    trtllm_cfg: NotRequired[OpenSection | None]
    trtllm_kwargs: NotRequired[OpenSection | None]
    dynamo_cfg: NotRequired[OpenSection | None]
    mcore_generation_config: NotRequired[OpenSection | None]
    refit_cfg: NotRequired[OpenSection | None]
    refit_transport: NotRequired[str | None]
    quant_cfg: NotRequired[str | None]
    real_quant: NotRequired[bool]
    real_quant_export_cpu_offload: NotRequired[bool]
    real_quant_ignore: NotRequired[list[str]]


@with_config(_STRICT)
class DTensorConfig(TypedDict):
    """``policy.dtensor_cfg``: NeMo-RL's DTensor backend (its keys); a section that selects it
    trains on megatron-core with the same meaning (config/dtensor_recipes.py)."""

    enabled: bool
    env_vars: NotRequired[dict[str, str] | None]
    _v2: NotRequired[bool]
    tensor_parallel_size: NotRequired[PositiveInt]
    context_parallel_size: NotRequired[PositiveInt]
    expert_parallel_size: NotRequired[PositiveInt]
    dp_replicate_size: NotRequired[PositiveInt]
    sequence_parallel: NotRequired[bool]
    activation_checkpointing: NotRequired[bool]
    cpu_offload: NotRequired[bool]
    custom_parallel_plan: NotRequired[str | None]
    defer_fsdp_grad_sync: NotRequired[bool]
    moe_parallelizer: NotRequired[OpenSection | None]
    lora_cfg: NotRequired[OpenSection | None]
    automodel_kwargs: NotRequired[OpenSection | None]
    clear_cache_every_n_steps: NotRequired[PositiveInt | None]


@with_config(_STRICT)
class SequencePackingConfig(TypedDict):
    enabled: bool
    train_mb_tokens: NotRequired[SequenceLength]
    logprob_mb_tokens: NotRequired[SequenceLength]
    algorithm: NotRequired[str]
    sequence_length_round: NotRequired[PositiveInt]
    microbatch_order: NotRequired[Literal["packer", "largest_first"]]
    fuse_loss: NotRequired[bool]


@with_config(_STRICT)
class DynamicBatchingConfig(TypedDict):
    enabled: bool
    train_mb_tokens: NotRequired[SequenceLength]
    logprob_mb_tokens: NotRequired[SequenceLength]
    sequence_length_round: NotRequired[AddressableInt]


@with_config(_OPEN)
class SwitchedSection(TypedDict):
    """A NeMo-RL feature switched by ``enabled`` (draft model, router replay, reward model)."""

    enabled: bool


@with_config(_STRICT)
class PolicyConfig(TypedDict):
    # A preset name (see nemo_rl_offload.config.model_presets) or a local Hugging Face directory.
    model_name: str
    tokenizer: NotRequired[TokenizerConfig]
    train_global_batch_size: PositiveInt
    train_micro_batch_size: PositiveInt
    generation_batch_size: NotRequired[PositiveInt]
    logprob_batch_size: NotRequired[AddressableInt]  # default: train_micro_batch_size
    max_total_sequence_length: SequenceLength
    precision: Precision
    max_grad_norm: NotRequired[NonNegativeFloat | None]
    make_sequence_length_divisible_by: NotRequired[PositiveInt]
    megatron_cfg: MegatronConfig
    generation: NotRequired[GenerationConfig | None]
    # Start from these weights: a checkpoint step directory, or a checkpoint_dir (its latest
    # step), e.g. the SFT run's before GRPO. Resuming the run's own checkpoint_dir wins.
    init_checkpoint: NotRequired[str | None]
    # NeMo-RL keys this backend does not act on (config/ignored_keys.py says how each is
    # treated); typed as NeMo-RL types them.
    dtensor_cfg: NotRequired[DTensorConfig | None]
    sequence_packing: NotRequired[SequencePackingConfig | None]
    dynamic_batching: NotRequired[DynamicBatchingConfig | None]
    logprob_chunk_size: NotRequired[AddressableInt | None]
    refit_buffer_size_gb: NotRequired[PositiveFloat | None]
    offload_optimizer_for_logprob: NotRequired[bool]
    hf_config_overrides: NotRequired[OpenSection | None]
    draft: NotRequired[SwitchedSection | None]
    router_replay: NotRequired[SwitchedSection | None]
    reward_model_cfg: NotRequired[SwitchedSection | None]
    pretrained_checkpoint: NotRequired[OpenSection | None]
    # The DTensor backend's PyTorch optimizer and scheduler (mapped when DTensor is selected).
    optimizer: NotRequired[OpenSection | None]
    scheduler: NotRequired[list[OpenSection] | OpenSection | None]
    quant_cfg: NotRequired[str | None]
    quant_calib_data: NotRequired[str | None]
    quant_calib_size: NotRequired[PositiveInt | None]
    quant_batch_size: NotRequired[PositiveInt | None]
    quant_sequence_length: NotRequired[SequenceLength | None]
    disable_modelopt_layer_spec: NotRequired[bool]
    is_vlm: NotRequired[bool]


# ------------------------------------------------------------------------- the other sections


@with_config(_STRICT)
class ClusterConfig(TypedDict):
    gpus_per_node: NonNegativeInt  # 0 runs the workers on CPU
    num_nodes: PositiveInt
    # Ray cluster to join ("auto", "ray://host:port", ...); null starts an embedded local cluster.
    # RAY_ADDRESS in the environment takes the same role.
    address: NotRequired[str | None]
    num_cpu_workers: NotRequired[PositiveInt]  # workers when gpus_per_node is 0 (default 1)
    master_port_range_low: NotRequired[Port]
    master_port_range_high: NotRequired[Port]
    segment_size: NotRequired[PositiveInt | None]


@with_config(_OPEN)
class WandbConfig(TypedDict):
    project: NotRequired[str]
    name: NotRequired[str]
    entity: NotRequired[str]
    log_nemo_gym_full_result_tables: NotRequired[bool]


@with_config(_OPEN)
class SwanlabConfig(TypedDict):
    project: NotRequired[str]
    name: NotRequired[str]


@with_config(_OPEN)
class TensorboardConfig(TypedDict):
    log_dir: NotRequired[str]


@with_config(_OPEN)
class MLflowConfig(TypedDict):
    experiment_name: NotRequired[str | None]
    run_id: NotRequired[str | None]
    run_name: NotRequired[str | None]
    tracking_uri: NotRequired[str | None]
    artifact_location: NotRequired[str | None]


@with_config(_STRICT)
class GPUMonitoringConfig(TypedDict):
    collection_interval: PositiveFloat
    flush_interval: PositiveFloat


@with_config(_STRICT)
class LoggerConfig(TypedDict):
    log_dir: str
    tensorboard_enabled: NotRequired[bool]
    monitor_gpus: NotRequired[bool]
    num_val_samples_to_print: NotRequired[NonNegativeInt]
    # NeMo-RL's other metric sinks and their settings.
    wandb_enabled: NotRequired[bool]
    swanlab_enabled: NotRequired[bool]
    mlflow_enabled: NotRequired[bool]
    wandb: NotRequired[WandbConfig | None]
    swanlab: NotRequired[SwanlabConfig | None]
    mlflow: NotRequired[MLflowConfig | None]
    tensorboard: NotRequired[TensorboardConfig | None]
    gpu_monitoring: NotRequired[GPUMonitoringConfig | None]


@with_config(_STRICT)
class CheckpointingConfig(TypedDict):
    enabled: bool
    checkpoint_dir: str
    metric_name: NotRequired[str | None]
    higher_is_better: NotRequired[bool]
    keep_top_k: NotRequired[PositiveInt | None]
    save_period: NotRequired[PositiveInt]
    checkpoint_must_save_by: NotRequired[str | None]
    # NeMo-RL's checkpoint file options.
    save_optimizer: NotRequired[bool]
    model_save_format: NotRequired[str | None]
    save_consolidated: NotRequired[bool]
    model_cache_dir: NotRequired[str]
    model_repo_id: NotRequired[str]
    is_peft: NotRequired[bool]
    is_async: NotRequired[bool]
    ft_keep_latest_k: NotRequired[PositiveInt | None]
    ft_save_period: NotRequired[PositiveInt]
    pretrained_checkpoint: NotRequired[OpenSection | None]


@with_config(_OPEN)
class NemoRLDatasetConfig(TypedDict):
    """One of NeMo-RL's dataset entries (``data.train``, ``data.validation``, ``data.default``):
    its common keys typed, dataset-specific ones taken as they are (NeMo-RL passes them on)."""

    dataset_name: NotRequired[str]
    data_path: NotRequired[str]
    input_key: NotRequired[str]
    output_key: NotRequired[str]
    prompt_key: NotRequired[str]
    chosen_key: NotRequired[str]
    rejected_key: NotRequired[str]
    subset: NotRequired[str | None]
    split: NotRequired[str]
    prompt_file: NotRequired[str | None]
    system_prompt_file: NotRequired[str | None]
    env_name: NotRequired[str]
    processor: NotRequired[str]
    download_dir: NotRequired[str]
    split_validation_size: NotRequired[Fraction]
    seed: NotRequired[Seed]


NemoRLDatasets = NemoRLDatasetConfig | list[NemoRLDatasetConfig]


@with_config(_STRICT)
class DataConfig(TypedDict):
    # "arithmetic" is the built-in synthetic task; "jsonl" reads the paths below. Required
    # unless the recipe names NeMo-RL's datasets (data.train), which preflight reports.
    dataset_name: NotRequired[str]
    max_input_seq_length: NotRequired[AddressableInt | None]  # null: no limit
    shuffle: NotRequired[bool]
    seed: NotRequired[Seed]
    train_data_path: NotRequired[str | None]
    val_data_path: NotRequired[str | None]
    num_train_samples: NotRequired[PositiveInt]
    num_val_samples: NotRequired[NonNegativeInt]
    # The arithmetic task's problems: operators and operand ranges (0..max).
    arithmetic_ops: NotRequired[list[Literal["+", "-", "*"]]]
    max_operand: NotRequired[PositiveInt]  # default 99
    max_factor: NotRequired[PositiveInt]  # default 12 (multiplication)
    prompt_file: NotRequired[str | None]
    system_prompt_file: NotRequired[str | None]
    input_key: NotRequired[str]
    output_key: NotRequired[str]
    prompt_key: NotRequired[str]
    chosen_key: NotRequired[str]
    rejected_key: NotRequired[str]
    answer_key: NotRequired[str]
    # NeMo-RL's data sources and loader options.
    train: NotRequired[NemoRLDatasets]
    validation: NotRequired[NemoRLDatasets | None]
    default: NotRequired[NemoRLDatasetConfig | None]
    add_bos: NotRequired[bool]
    add_eos: NotRequired[bool]
    add_generation_prompt: NotRequired[bool]
    add_system_prompt: NotRequired[bool]
    num_workers: NotRequired[NonNegativeInt]
    use_multiple_dataloader: NotRequired[bool]
    num_prompts_per_dataloader: NotRequired[PositiveInt]
    custom_dataloader: NotRequired[str]


@with_config(_STRICT)
class MathEnvConfig(TypedDict):
    num_workers: NotRequired[PositiveInt]
    math_verify_impl: NotRequired[Literal["hf_math_verify", "dapo_math_verify"] | None]


@with_config(_OPEN)
class OtherEnvConfig(TypedDict):
    """Another NeMo-RL environment's settings (e.g. ``env.dapo``)."""

    num_workers: NotRequired[PositiveInt]


@with_config(_STRICT)
class EnvConfig(TypedDict):
    math: NotRequired[MathEnvConfig]
    dapo: NotRequired[OtherEnvConfig]
    nemo_gym: NotRequired[OpenSection | None]
    should_use_nemo_gym: NotRequired[bool]
    should_log_nemo_gym_responses: NotRequired[bool]
    should_mask_flagged_samples: NotRequired[bool]


# ------------------------------------------------------------------------ algorithm sections


@with_config(_STRICT)
class SFTConfig(TypedDict):
    max_num_epochs: PositiveInt
    max_num_steps: PositiveInt
    val_period: Period
    val_batches: NotRequired[NonNegativeInt]
    val_global_batch_size: NotRequired[PositiveInt]
    val_micro_batch_size: NotRequired[PositiveInt]
    val_at_start: NotRequired[bool]
    seed: Seed
    val_at_end: NotRequired[bool]
    only_unmask_final: NotRequired[bool]


@with_config(_STRICT)
class SFTLossConfig(TypedDict):
    # Average the token NLL over all tokens of the global batch (true) or per sequence (false).
    token_level_loss: NotRequired[bool]


@with_config(_STRICT)
class DPOConfig(TypedDict):
    max_num_epochs: PositiveInt
    max_num_steps: PositiveInt
    val_period: Period
    val_batches: NotRequired[NonNegativeInt]
    val_global_batch_size: NotRequired[PositiveInt]
    val_micro_batch_size: NotRequired[PositiveInt]
    val_at_start: NotRequired[bool]
    seed: Seed
    # The loss settings live here, as in NeMo-RL's dpo.yaml.
    reference_policy_kl_penalty: NonNegativeFloat  # DPO's beta
    preference_average_log_probs: NotRequired[bool]
    sft_average_log_probs: NotRequired[bool]
    preference_loss_weight: NotRequired[NonNegativeFloat]
    sft_loss_weight: NotRequired[NonNegativeFloat]
    val_at_end: NotRequired[bool]


@with_config(_STRICT)
class AsyncRLSamplerConfig(TypedDict):
    """``async_rl.sampler``: which rollouts a step trains on (each built-in sampler's schedule
    here: config/grpo_options.async_lead; ``custom`` is refused)."""

    name: NotRequired[str]
    max_lookahead_versions: NotRequired[AddressableInt]
    max_staleness_versions: NotRequired[AddressableInt]
    sample_freshest_first: NotRequired[bool]
    target: NotRequired[str]


@with_config(_STRICT)
class AsyncRLConfig(TypedDict):
    """NeMo-RL's single-controller asynchronous trainer (algorithms/async_rollouts.py for the
    schedule; config/ignored_keys.py for the keys with nothing to act on here)."""

    sampler: NotRequired[AsyncRLSamplerConfig]
    recompute_kv_cache_after_weight_updates: NotRequired[bool]
    min_groups_for_streaming_train: NotRequired[AddressableInt]
    max_inflight_prompts: NotRequired[PositiveInt]
    max_buffered_rollouts: NotRequired[PositiveInt]
    diagnostics: NotRequired[bool]
    rollout_failure: NotRequired[OpenSection]
    stall_watchdog: NotRequired[OpenSection]
    generation_fleet_health: NotRequired[OpenSection]
    generation_router: NotRequired[OpenSection]


@with_config(_STRICT)
class AsyncGRPOConfig(TypedDict):
    enabled: bool
    max_trajectory_age_steps: NotRequired[AddressableInt]
    max_generation_failures: NotRequired[NonNegativeInt]
    in_flight_weight_updates: NotRequired[bool]
    recompute_kv_cache_after_weight_updates: NotRequired[bool]


@with_config(_STRICT)
class RewardShapingConfig(TypedDict):
    """``grpo.reward_shaping`` (algorithms/rewards.py): DAPO's overlong penalty, or with
    ``stop_properly_penalty_coef`` a factor on truncated responses' rewards."""

    enabled: bool
    overlong_buffer_length: NotRequired[AddressableInt | None]
    overlong_buffer_penalty: NotRequired[Number | None]
    max_response_length: NotRequired[SequenceLength | None]
    stop_properly_penalty_coef: NotRequired[Number | None]


@with_config(_STRICT)
class RewardScalingConfig(TypedDict):
    """``grpo.reward_scaling``: rewards clamped to [source_min, source_max] and mapped linearly
    onto [target_min, target_max] (defaults 0, 1, 0, 1)."""

    enabled: bool
    source_min: NotRequired[Number]
    source_max: NotRequired[Number]
    target_min: NotRequired[Number]
    target_max: NotRequired[Number]


@with_config(_STRICT)
class AdvEstimatorConfig(TypedDict):
    name: NotRequired[str]
    normalize_rewards: NotRequired[bool]
    use_leave_one_out_baseline: NotRequired[bool]
    reward_weights: NotRequired[list[Number] | None]
    minus_baseline: NotRequired[bool]


@with_config(_STRICT)
class GRPOConfig(TypedDict):
    num_prompts_per_step: PositiveInt
    num_generations_per_prompt: PositiveInt
    max_rollout_turns: NotRequired[PositiveInt]
    max_num_epochs: NotRequired[PositiveInt]
    max_num_steps: PositiveInt
    normalize_rewards: NotRequired[bool]
    use_leave_one_out_baseline: NotRequired[bool]
    val_period: Period
    val_at_start: NotRequired[bool]
    max_val_samples: NotRequired[PositiveInt | None]
    val_batch_size: NotRequired[PositiveInt | None]
    seed: Seed
    # Reward and advantage transforms (algorithms/rewards.py; checks: config/grpo_options.py).
    advantage_clip_low: NotRequired[Number | None]  # default null: no lower bound
    advantage_clip_high: NotRequired[Number | None]  # default null: no upper bound
    overlong_filtering: NotRequired[bool]  # default false
    use_dynamic_sampling: NotRequired[bool]  # default false
    dynamic_sampling_max_gen_batches: NotRequired[AddressableInt]  # default 10
    batch_multiplier: NotRequired[Number]  # default 1; other values need dynamic sampling
    reward_shaping: NotRequired[RewardShapingConfig | None]
    reward_scaling: NotRequired[RewardScalingConfig | None]
    # Validation schedule and early stop.
    val_start_at: NotRequired[AddressableInt]  # default -1: periodic validation from the first step
    val_at_end: NotRequired[bool]  # default false
    val_num_generations_per_prompt: NotRequired[AddressableInt]  # default 1
    stop_at_validation_metric: NotRequired[str | None]  # default null: no early stop
    stop_at_validation_threshold: NotRequired[Number | None]
    # NeMo-RL options not implemented by this backend yet: accepted at their NeMo-RL
    # defaults, refused otherwise (config/ignored_keys.py).
    skip_reference_policy_logprobs_calculation: NotRequired[bool]
    async_grpo: NotRequired[AsyncGRPOConfig | None]
    calculate_advantages_on_gpu: NotRequired[bool]
    seq_logprob_error_threshold: NotRequired[Number | None]
    invalid_tool_call_advantage: NotRequired[Number | None]
    invalid_tool_call_strategy: NotRequired[str]
    penalize_invalid_tool_call: NotRequired[bool]
    malformed_thinking_advantage: NotRequired[Number | None]
    penalize_malformed_thinking: NotRequired[bool]
    adv_estimator: NotRequired[AdvEstimatorConfig | None]
    deduplicate_multimodal_data: NotRequired[bool]
    debug_payload_metrics: NotRequired[bool]


@with_config(_STRICT)
class GRPOLossConfig(TypedDict):
    reference_policy_kl_penalty: NonNegativeFloat
    ratio_clip_min: NonNegativeFloat
    ratio_clip_max: NonNegativeFloat
    ratio_clip_c: NotRequired[Number | None]
    use_on_policy_kl_approximation: NotRequired[bool]
    use_importance_sampling_correction: NotRequired[bool]
    token_level_loss: NotRequired[bool]
    # Values and combinations: grpo_loss_problems below; meanings: losses.PolicyLossOptions.
    reference_policy_kl_type: NotRequired[str]
    kl_input_clamp_value: NotRequired[Number | None]
    kl_output_clamp_value: NotRequired[Number | None]
    use_kl_in_reward: NotRequired[bool]
    truncated_importance_sampling_type: NotRequired[str | None]
    truncated_importance_sampling_ratio: NotRequired[Number | None]
    truncated_importance_sampling_ratio_min: NotRequired[Number | None]
    sequence_level_importance_ratios: NotRequired[bool]
    disable_ppo_ratio: NotRequired[bool]
    force_on_policy_ratio: NotRequired[bool]
    use_cispo: NotRequired[bool]
    positive_example_nll_weight: NotRequired[Number]


@with_config(_OPEN)
class TeacherResourceConfig(TypedDict):
    """A teacher's workers in NeMo-RL's on_policy_distillation.non_colocated_teachers; any other
    key is a megatron_cfg setting of the teacher (config/on_policy_distillation.py)."""

    tensor_model_parallel_size: NotRequired[AddressableInt]
    pipeline_model_parallel_size: NotRequired[AddressableInt]
    context_parallel_size: NotRequired[AddressableInt]
    expert_model_parallel_size: NotRequired[AddressableInt]
    num_nodes: NotRequired[AddressableInt]
    gpus_per_node: NotRequired[AddressableInt]
    precision: NotRequired[str]
    micro_batch_size: NotRequired[AddressableInt]
    megatron_cfg_overrides: NotRequired[dict[str, Any]]


@with_config(_STRICT)
class NonColocatedTeachersConfig(TypedDict):
    enabled: NotRequired[bool]
    default_teacher_cfg: NotRequired[TeacherResourceConfig]
    teacher_overrides: NotRequired[dict[str, TeacherResourceConfig]]


@with_config(_STRICT)
class OnPolicyDistillationConfig(TypedDict):
    """NeMo-RL's multi-teacher on-policy distillation inside GRPO (``grpo.adv_estimator.name:
    opd``); rules and meaning: config/on_policy_distillation.py."""

    enabled: NotRequired[bool]
    teacher_model_by_agent_name: NotRequired[dict[str, str]]
    default_teacher_alias: NotRequired[str | None]
    strict_agent_name_match: NotRequired[bool]
    deduplicate_shared_teacher_checkpoints: NotRequired[bool]
    non_colocated_teachers: NotRequired[NonColocatedTeachersConfig | None]


@with_config(_STRICT)
class DistillationConfig(TypedDict):
    num_prompts_per_step: PositiveInt
    num_generations_per_prompt: NotRequired[PositiveInt]
    max_rollout_turns: NotRequired[PositiveInt]
    max_num_steps: PositiveInt
    max_num_epochs: NotRequired[PositiveInt]
    val_batch_size: NotRequired[PositiveInt]
    val_period: Period
    val_at_start: NotRequired[bool]
    max_val_samples: NotRequired[PositiveInt | None]
    topk_logits_k: NotRequired[PositiveInt | None]
    seed: Seed
    val_at_end: NotRequired[bool]


@with_config(_STRICT)
class DistillationLossConfig(TypedDict):
    kl_type: Literal["forward", "reverse", "mixed"]
    mixed_kl_weight: NotRequired[Fraction]  # weight of the forward KL when kl_type is "mixed"
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
    # NeMo-RL sections of features this backend does not have (config/ignored_keys.py).
    reward_penalties: NotRequired[OpenSection | None]
    data_plane: NotRequired[OpenSection | None]
    on_policy_distillation: NotRequired[OnPolicyDistillationConfig | None]
    async_rl: NotRequired[AsyncRLConfig | None]


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


# --------------------------------------------------------------------------- loss_fn values

KL_TYPES = ("k1", "k2", "k3")
TRUNCATED_IS_TYPES = ("tis", "icepop", "seq-mask-tis")


def grpo_loss_problems(loss: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the values and combinations of GRPO's ``loss_fn`` options that
    NeMo-RL's loss refuses (its asserts), each one line naming the key and the fix. Wrong types
    are pydantic's to report, so only well-typed values are looked at here."""
    errors: list[str] = []
    warnings: list[str] = []

    def number(key: str) -> float | None:
        value = loss.get(key)
        return (
            float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        )

    kl_type = loss.get("reference_policy_kl_type")
    if isinstance(kl_type, str) and kl_type not in KL_TYPES:
        errors.append(
            f"loss_fn.reference_policy_kl_type: {kl_type!r} is not a KL estimator; use one of "
            f"{', '.join(KL_TYPES)}"
        )
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = number(key)
        if value is not None and value <= 0:
            errors.append(f"loss_fn.{key}: must be positive (got: {value:g}); or null for no clamp")
    clip_c = number("ratio_clip_c")
    if clip_c is not None and clip_c <= 1:
        errors.append(
            f"loss_fn.ratio_clip_c: the dual-clip bound must exceed 1 (got: {clip_c:g}); "
            "usually 3, or null to turn dual clipping off"
        )
    nll = number("positive_example_nll_weight")
    if nll is not None and nll < 0:
        errors.append(
            f"loss_fn.positive_example_nll_weight: must be 0 or more (got: {nll:g}); 0 turns "
            "the positive-example NLL off"
        )
    tis_type = loss.get("truncated_importance_sampling_type")
    ratio = number("truncated_importance_sampling_ratio")
    ratio_min = number("truncated_importance_sampling_ratio_min")
    sequence_level = loss.get("sequence_level_importance_ratios") is True
    if isinstance(tis_type, str):
        if tis_type not in TRUNCATED_IS_TYPES:
            errors.append(
                f"loss_fn.truncated_importance_sampling_type: {tis_type!r} is not a truncation; "
                f"use one of {', '.join(TRUNCATED_IS_TYPES)} (or null)"
            )
        elif loss.get("use_importance_sampling_correction") is not True:
            errors.append(
                "loss_fn.truncated_importance_sampling_type: truncates importance weights, "
                "which only act with loss_fn.use_importance_sampling_correction: true; set it"
            )
        elif ratio is None or ratio <= 0:
            errors.append(
                "loss_fn.truncated_importance_sampling_ratio: must be a positive upper bound "
                f"when truncated_importance_sampling_type is {tis_type!r}; set it (e.g. 2)"
            )
        elif tis_type in ("icepop", "seq-mask-tis") and ratio_min is None:
            errors.append(
                "loss_fn.truncated_importance_sampling_ratio_min: must be set when "
                f"truncated_importance_sampling_type is {tis_type!r}; set the lower bound"
            )
        elif ratio_min is not None and ratio_min > ratio:
            errors.append(
                f"loss_fn.truncated_importance_sampling_ratio_min: {ratio_min:g} is above "
                f"truncated_importance_sampling_ratio {ratio:g}; lower it"
            )
        elif tis_type == "seq-mask-tis" and sequence_level:
            errors.append(
                "loss_fn.truncated_importance_sampling_type: 'seq-mask-tis' keeps token-level "
                "weights and cannot go with sequence_level_importance_ratios: true; use 'tis' "
                "or 'icepop', or set sequence_level_importance_ratios to false"
            )
    elif ratio is not None:
        errors.append(
            "loss_fn.truncated_importance_sampling_ratio: set without "
            "truncated_importance_sampling_type; set the type (tis, icepop or seq-mask-tis) "
            "or make the ratio null"
        )
    token_level = loss.get("token_level_loss") is not False
    if sequence_level and token_level:
        errors.append(
            "loss_fn.sequence_level_importance_ratios: GSPO's sequence ratios need "
            "per-sequence averaging; set loss_fn.token_level_loss to false"
        )
    if loss.get("use_cispo") is True:
        for key, clash, fix in (
            ("disable_ppo_ratio", True, "false"),
            ("force_on_policy_ratio", True, "false"),
            ("sequence_level_importance_ratios", True, "false"),
            ("token_level_loss", False, "true"),
        ):
            if loss.get(key) is clash:
                errors.append(
                    f"loss_fn.use_cispo: cannot go with {key}: {str(clash).lower()}; "
                    f"set loss_fn.{key} to {fix} or use_cispo to false"
                )
        if clip_c is not None:
            errors.append(
                "loss_fn.use_cispo: cannot go with dual clipping; set loss_fn.ratio_clip_c to "
                "null or use_cispo to false"
            )
    penalty = number("reference_policy_kl_penalty")
    if loss.get("use_kl_in_reward") is True and penalty:
        warnings.append(
            "warning: loss_fn.use_kl_in_reward: takes the KL penalty out of the loss, and "
            "GRPO's advantages (the only estimator here, as in NeMo-RL's 'grpo') do not add it "
            "to the reward, so no KL penalty acts; set reference_policy_kl_penalty to 0 to say so"
        )
    return errors, warnings
