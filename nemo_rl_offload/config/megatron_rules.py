"""The rules of a policy section's Megatron settings that are not about offloading: the backend,
parallel layout, gradient reduction, fusions, optimizer-state offload, token batching, chunked
log-probabilities and multi-token prediction. Each reports a complete line,
``dotted.path: what is wrong; how to fix it``; all run every time (:mod:`.rule_context`)."""

from __future__ import annotations

import difflib

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.rule_context import Rule, RuleContext, fmt, is_int, is_number


def _backend(ctx: RuleContext) -> None:
    if ctx.megatron_cfg.get("enabled") is False:
        # A section that selects DTensor arrives here already mapped (config.dtensor_recipes).
        ctx.error(
            f"{ctx.prefix}.enabled: false selects NeMo-RL's DTensor backend, but "
            f"{ctx.where}.dtensor_cfg.enabled is not true; set {ctx.prefix}.enabled to true "
            f"(or {ctx.where}.dtensor_cfg.enabled to true, to train its DTensor settings on "
            "megatron-core)"
        )
        if ctx.fgo_on:
            ctx.error(
                f"{ctx.path('fine_grained_activation_offloading')}: fine-grained activation "
                f"offloading needs the Megatron backend; set {ctx.prefix}.enabled=true"
            )
    requested = ctx.megatron_cfg.get("transformer_impl")
    if requested == "transformer_engine" and not ctx.caps.has_transformer_engine:
        ctx.error(
            f"{ctx.prefix}.transformer_impl: transformer_engine, but Transformer Engine is not "
            "installed; use auto or local (Megatron's local layer spec)"
        )


def _overrides(ctx: RuleContext) -> None:
    for name, path, other in ctx.effective.conflicts:
        if path.startswith(f"{ctx.prefix}.model_overrides."):
            ctx.error(f"{path}: {name} cannot be set through model_overrides; set {other} instead")
        else:
            ctx.error(f"{path}: disagrees with {other}; set {name} in one place only")
    overrides = ctx.megatron_cfg.get("model_overrides")
    known = ctx.transformer_fields
    if not isinstance(overrides, dict) or known is None:
        return
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            ctx.error(
                f"{ctx.prefix}.model_overrides.{name}: not a TransformerConfig field of "
                f"megatron-core {ctx.caps.megatron_version}; {hint}remove it"
            )


def _fusions(ctx: RuleContext) -> None:
    """Fusions whose kernels come from Transformer Engine, asked for without it
    (:data:`.apply.TE_KERNEL_FUSIONS`): they run unfused."""
    for path in ctx.effective.unavailable_fusions:
        ctx.warn(
            f"warning: {path}: ignored: its fused kernel comes from Transformer Engine, which is "
            "not installed; the unfused path runs (same results up to rounding)"
        )


def _recompute(ctx: RuleContext) -> None:
    for name in ctx.effective.ignored_recompute_keys:
        value = ctx.megatron_cfg.get(name)
        if name == "recompute_modules" and value or value == "selective":
            ctx.warn(
                f"warning: {ctx.prefix}.{name}: ignored because activation_checkpointing is "
                f"false; set {ctx.prefix}.activation_checkpointing=true to recompute"
            )


def _optimizer_offload(ctx: RuleContext) -> None:
    """``optimizer.optimizer_cpu_offload`` (NeMo-RL's key): megatron-core's hybrid optimizer
    keeps ``optimizer_offload_fraction`` of the Adam state on the host and steps it there. It
    reuses the precision-aware optimizer's code path (Megatron-LM's arguments require that
    flag, which megatron-core allows only with Adam and the distributed optimizer) and moves
    the state with CUDA streams (GPU workers only)."""
    optimizer = ctx.megatron_cfg.get("optimizer")
    if not isinstance(optimizer, dict):
        return
    path = f"{ctx.prefix}.optimizer"
    if (
        optimizer.get("use_precision_aware_optimizer") is True
        and ctx.gpus_per_node != 0
        and not megatron_settings.precision_aware_optimizer(
            optimizer, te_installed=ctx.caps.has_transformer_engine, on_gpu=True
        )
    ):
        ctx.warn(
            f"warning: {path}.use_precision_aware_optimizer: ignored: megatron-core runs it "
            "through Transformer Engine's FusedAdam, which is not installed (or, with "
            "optimizer_cpu_offload, its hybrid CPU optimizer); the distributed optimizer takes "
            "the same float32 step instead (same results up to rounding)"
        )
    fraction = optimizer.get("optimizer_offload_fraction")
    if optimizer.get("optimizer_cpu_offload") is not True:
        if is_number(fraction) and fraction > 0:
            ctx.warn(
                f"warning: {path}.optimizer_offload_fraction: ignored because "
                f"optimizer_cpu_offload is off; set {path}.optimizer_cpu_offload=true to use it"
            )
        return
    needs = [
        f"{path}.{name}=true"
        for name in ("use_distributed_optimizer", "use_precision_aware_optimizer")
        if optimizer.get(name) is not True
    ]
    if needs:
        ctx.error(
            f"{path}.optimizer_cpu_offload: megatron-core's hybrid CPU optimizer runs through "
            f"the precision-aware distributed optimizer; set {' and '.join(needs)}, or turn "
            "optimizer_cpu_offload off"
        )
    if optimizer.get("optimizer", "adam") != "adam":
        ctx.error(
            f"{path}.optimizer: optimizer_cpu_offload needs adam (megatron-core's "
            f"precision-aware optimizer is Adam only), not {optimizer.get('optimizer')!r}"
        )
    if not (is_number(fraction) and 0 < fraction <= 1):
        ctx.error(
            f"{path}.optimizer_offload_fraction: must be in (0, 1] with optimizer_cpu_offload "
            f"(got: {fraction}); it is the share of the optimizer state kept on the host, e.g. 1.0"
        )
    if ctx.gpus_per_node == 0:
        ctx.error(
            f"{path}.optimizer_cpu_offload: megatron-core's hybrid CPU optimizer needs CUDA "
            "(cluster.gpus_per_node is 0); turn it off for CPU runs"
        )


def _gradient_reduction(ctx: RuleContext) -> None:
    ddp = ctx.megatron_cfg.get("distributed_data_parallel_config")
    if isinstance(ddp, dict) and ddp.get("average_in_collective") is True:
        ctx.error(
            f"{ctx.prefix}.distributed_data_parallel_config.average_in_collective: must be false:"
            " losses are normalised per token over the whole step (Megatron's per-token loss), "
            "which cannot average in the collective; set it to false"
        )


def _parallel_layout(ctx: RuleContext) -> None:
    """Parallel sizes every pass of this backend runs with (training, forward-only passes and
    sampling go through Megatron's schedules), or a one-line refusal: what Megatron would only
    find when the workers build the model, and what this backend does not do yet."""
    sizes = {
        name: ctx.value(name, 1)
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        )
    }
    if not all(is_int(size) and size >= 1 for size in sizes.values()):
        return  # the schema or Megatron's own checks report it
    tp = sizes["tensor_model_parallel_size"]
    pp = sizes["pipeline_model_parallel_size"]
    cp = sizes["context_parallel_size"]
    if cp > 1 and ctx.value("cuda_graph_impl") == "full_iteration":
        ctx.error(
            f"{ctx.path('context_parallel_size')}: cannot run with full_iteration CUDA graphs "
            "(each pass builds its context-parallel split of the sequences on the host, which "
            "a captured graph cannot replay); set cuda_graph_impl to none or "
            "context_parallel_size to 1"
        )
    virtual = ctx.value("virtual_pipeline_model_parallel_size")
    if virtual not in (None, 1):
        ctx.error(
            f"{ctx.path('virtual_pipeline_model_parallel_size')}: interleaved (virtual) "
            "pipeline stages are not supported by this backend (it builds one model chunk per "
            "stage); remove it"
        )
    _pipeline_layers(ctx, pp)
    _tensor_split(ctx, tp)
    if ctx.value("sequence_parallel") is True and tp == 1:
        # models.transformer_config turns it off (Megatron refuses it without
        # tensor parallelism); sequences are padded to a multiple of the tensor-parallel size at the
        # model's input (policy.train_step), so no other setting can conflict with it.
        ctx.warn(
            f"warning: {ctx.path('sequence_parallel')}: ignored at tensor_model_parallel_size 1 "
            "(there is nothing to split the sequence over); set it to false"
        )
    if ctx.workers is None or ctx.workers < 1:
        return
    model_parallel = tp * pp * cp
    workers_key = "cluster.gpus_per_node" if ctx.gpus_per_node else "cluster.num_cpu_workers"
    if ctx.workers % model_parallel:
        ctx.error(
            f"{ctx.prefix}: tensor x pipeline x context parallel sizes ({tp} x {pp} x {cp} = "
            f"{model_parallel}) do not divide the {ctx.workers} worker(s) of {workers_key}; "
            f"use a multiple of {model_parallel} workers or smaller sizes"
        )
        return
    ep = sizes["expert_model_parallel_size"]
    etp = ctx.value("expert_tensor_parallel_size") or tp
    if ctx.is_moe and is_int(etp) and ctx.workers % (ep * etp * pp):
        ctx.error(
            f"{ctx.path('expert_model_parallel_size')}: expert x expert-tensor x pipeline "
            f"parallel sizes ({ep} x {etp} x {pp}) do not divide the {ctx.workers} worker(s) of "
            f"{workers_key}; use sizes whose product divides it"
        )


def _pipeline_layers(ctx: RuleContext, pp: int) -> None:
    """Megatron builds num_layers / pp layers per stage (after the first and last stages'
    own counts when given): a remainder fails only when the workers build the model."""
    layers = ctx.value("num_layers")
    if pp == 1 or not is_int(layers):
        return
    given = {
        name: ctx.value(name)
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
        if is_int(ctx.value(name))
    }
    middle_stages = pp - len(given)
    middle_layers = layers - sum(given.values())
    if middle_stages > 0 and (middle_layers < 0 or middle_layers % middle_stages):
        ctx.error(
            f"{ctx.path('pipeline_model_parallel_size')}: {layers} layers do not split evenly "
            f"over {pp} pipeline stages"
            + (f" after {sum(given.values())} in the first/last stage" if given else "")
            + "; use a pipeline size that divides the layer count, or set "
            "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
        )


def _tensor_split(ctx: RuleContext, tp: int) -> None:
    """Tensor parallelism splits heads, query groups and the MLP's hidden size over the ranks:
    each must divide (Megatron asserts it while building the layers)."""
    if tp == 1:
        return
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        value = ctx.value(name)
        if is_int(value) and value % tp:
            ctx.error(
                f"{ctx.path('tensor_model_parallel_size')}: {tp} does not divide the model's "
                f"{name} ({value}); use a tensor parallel size that divides it"
            )


def _token_batching(ctx: RuleContext) -> None:
    """``sequence_packing`` and ``dynamic_batching`` (``algorithms.packing``): one at a time
    (as in NeMo-RL), a known packing algorithm, token budgets that hold the longest sequence,
    and the setups they cannot run in."""
    packing_cfg = ctx.policy_cfg.get("sequence_packing") or {}
    dynamic_cfg = ctx.policy_cfg.get("dynamic_batching") or {}
    if not isinstance(packing_cfg, dict) or not isinstance(dynamic_cfg, dict):
        return  # the schema reports it
    packing_on, dynamic_on = bool(packing_cfg.get("enabled")), bool(dynamic_cfg.get("enabled"))
    if packing_on and dynamic_on:
        ctx.error(
            f"{ctx.where}.sequence_packing: cannot be enabled together with "
            f"{ctx.where}.dynamic_batching (as in NeMo-RL); disable one of them"
        )
        return
    if not (packing_on or dynamic_on):
        return
    key = "sequence_packing" if packing_on else "dynamic_batching"
    cfg = packing_cfg if packing_on else dynamic_cfg
    if packing_on:
        from nemo_rl_offload.config.batching_settings import PACKER_NAMES as PACKERS

        algorithm = packing_cfg.get("algorithm")
        if algorithm is not None and str(algorithm).lower() not in PACKERS:
            ctx.error(
                f"{ctx.where}.sequence_packing.algorithm: unknown packing algorithm "
                f"{algorithm!r}; use one of {fmt(PACKERS)}"
            )
    longest = ctx.policy_cfg.get("max_total_sequence_length")
    multiple = ctx.policy_cfg.get("make_sequence_length_divisible_by") or 1
    rounding = dynamic_cfg.get("sequence_length_round") or 1 if dynamic_on else 1
    if is_int(longest) and is_int(multiple) and is_int(rounding):
        step = max(multiple, rounding)
        need = -(-longest // step) * step
        for budget in ("train_mb_tokens", "logprob_mb_tokens"):
            value = cfg.get(budget)
            if value is None:
                continue
            if is_int(value) and value < need and packing_on:
                # NeMo-RL's packers refuse only a sequence longer than the pack, when one
                # comes: most RL sequences are far shorter than max_total_sequence_length.
                ctx.warn(
                    f"warning: {ctx.where}.{key}.{budget}: {value} is less than "
                    f"max_total_sequence_length {longest} (padded: {need}): a sequence longer "
                    f"than {value} tokens stops the run when it occurs; set it to at least "
                    f"{need} to rule that out"
                )
            elif not is_int(value) or value < need:
                ctx.error(
                    f"{ctx.where}.{key}.{budget}: {value} cannot hold a sequence of "
                    f"max_total_sequence_length {longest} (padded: {need}); set it to at "
                    f"least {need}"
                )
    rounding_value = dynamic_cfg.get("sequence_length_round")
    if (
        dynamic_on
        and rounding_value is not None
        and not (is_int(rounding_value) and rounding_value >= 1)
    ):
        ctx.error(
            f"{ctx.where}.dynamic_batching.sequence_length_round: must be an integer >= 1 "
            f"(got: {rounding_value})"
        )
    if packing_on and ctx.value("cuda_graph_impl") == "full_iteration":
        ctx.error(
            f"{ctx.where}.sequence_packing: cannot run with full_iteration CUDA graphs (the "
            "boundaries of the packed sequences change every step and a captured graph would "
            "replay the first step's); set cuda_graph_impl to none or disable packing"
        )
    pp = ctx.value("pipeline_model_parallel_size", 1)
    if dynamic_on and is_int(pp) and pp > 1:
        ctx.error(
            f"{ctx.where}.dynamic_batching: needs pipeline_model_parallel_size 1 (as in "
            "NeMo-RL: the stages exchange micro-batches of one shape); use sequence_packing"
        )


def _logprob_chunk(ctx: RuleContext) -> None:
    """``logprob_chunk_size`` (``models.chunked_logprobs``): positions per chunk, null for
    none."""
    chunk = ctx.policy_cfg.get("logprob_chunk_size")
    if chunk is not None and not (is_int(chunk) and chunk >= 1):
        ctx.error(
            f"{ctx.where}.logprob_chunk_size: must be an integer >= 1 (positions per chunk) or "
            f"null for no chunking (got: {chunk})"
        )
    output_chunked = ctx.megatron_cfg.get("chunked_output_layer")
    if output_chunked is not None and not isinstance(output_chunked, bool):
        ctx.error(
            f"{ctx.prefix}.chunked_output_layer: must be true or false (got: {output_chunked!r})"
        )
    elif output_chunked and not chunk:
        ctx.warn(
            f"warning: {ctx.prefix}.chunked_output_layer: has no effect without "
            f"{ctx.where}.logprob_chunk_size (the positions per chunk); set a chunk size"
        )
    overrides = ctx.megatron_cfg.get("model_overrides")
    if (
        chunk
        and output_chunked is True
        and isinstance(overrides, dict)
        and overrides.get("defer_embedding_wgrad_compute")
    ):
        # The chunked output layer runs the output layer once per chunk (and again in the
        # backward); Megatron's deferred weight gradient would buffer every chunk's input.
        ctx.error(
            f"{ctx.prefix}.chunked_output_layer: not with {ctx.prefix}.model_overrides."
            "defer_embedding_wgrad_compute (the chunked output layer would buffer each chunk's "
            "input); set one of them off"
        )


def _multi_token_prediction(ctx: RuleContext) -> None:
    """``mtp_num_layers`` (Megatron's MTP block: ``models.builder.mtp_block_spec``, its loss
    mask from ``policy.train_step``, its metrics from ``models.mtp``): what it runs beside."""
    depth = ctx.value("mtp_num_layers")
    path = ctx.path("mtp_num_layers")
    if depth is not None and not (is_int(depth) and depth >= 0):
        ctx.error(f"{path}: must be an integer >= 0 (0 or null: no MTP) (got: {depth})")
        return
    scale = ctx.value("mtp_loss_scaling_factor")
    if scale is not None and not (is_number(scale) and scale >= 0):
        ctx.error(
            f"{ctx.path('mtp_loss_scaling_factor')}: must be a number >= 0 (the MTP losses' "
            f"weight beside the policy's loss) (got: {scale})"
        )
    if not depth:
        return
    pp = ctx.value("pipeline_model_parallel_size", 1)
    if is_int(pp) and pp > 1:
        # Megatron puts the MTP block on the last stage with its own copy of the embedding,
        # which this package's pipeline schedule does not tie or checkpoint yet.
        ctx.error(
            f"{path}: multi-token prediction is not implemented with pipeline parallelism "
            f"yet; set {ctx.path('pipeline_model_parallel_size')} to 1 or {path} to 0"
        )
    if ctx.value("cuda_graph_impl") == "full_iteration":
        # The MTP metrics' buffers are new each step (models.mtp), which a replay would miss.
        ctx.error(
            f"{path}: multi-token prediction cannot run in full_iteration CUDA graphs yet; "
            f"set {ctx.path('cuda_graph_impl')} to none or {path} to 0"
        )


MEGATRON_RULES: tuple[Rule, ...] = (
    _backend,
    _overrides,
    _fusions,
    _recompute,
    _parallel_layout,
    _gradient_reduction,
    _optimizer_offload,
    _token_batching,
    _logprob_chunk,
    _multi_token_prediction,
)
