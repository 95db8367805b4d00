"""Every compatibility rule of fine-grained activation offloading (FGO), in one place.

Each rule reads the settings as
:func:`nemo_rl_offload.config.megatron_settings.effective_settings` resolves them (so what is
checked is what will be applied) and reports a complete line:
``dotted.path: what is wrong; how to fix it``. All rules run every time and all findings are
returned together, so a user fixes a recipe in one pass. Rules agree with megatron-core's own
TransformerConfig checks (tests/unit/offload/test_megatron_agreement.py proves it case by case):
whatever Megatron rejects is rejected here first, with the fix; some things Megatron accepts
silently but that cannot work (expert offload on a dense model) are rejected here too.

Types were already checked by the schema; a rule skips a value of the wrong type rather than
reporting it twice.
"""

from __future__ import annotations

import difflib
from typing import Any

from nemo_rl_offload.config.module_names import (
    LAYER_INPUT,
    LOCAL_RECOMPUTE_MODULES,
    MLP_OFFLOAD_MODULES,
    MOE_OFFLOAD_MODULES,
)
from nemo_rl_offload.config.rule_context import Rule, RuleContext, fmt, is_int, is_number, names
from nemo_rl_offload.offload.runtime import pads_steps

LOCAL_GRAPH_OFFLOAD_MODULES = MOE_OFFLOAD_MODULES
DEFAULT_MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024
DEFAULT_CUDA_GRAPH_WARMUP_STEPS = 3
# Offload modules that move what a local-spec recompute module frees (models.local_recompute):
# the norms' outputs (what qkv_linear and mlp_fc1 save), and the activation's input and output
# (what mlp_act and mlp_fc2 save; the recompute would read its input before that is reloaded).
OFFLOADS_FREED_BY_RECOMPUTE = {
    "layernorm": frozenset({"qkv_linear", "mlp_fc1"}),
    "mlp_act": frozenset({"mlp_act", "mlp_fc2"}),
    # The experts' activation output (fc2's input); the moe_act offload module moves fc1's
    # output, which the recompute reads back (Megatron reloads it first).
    "moe_act": frozenset(),
}


# ------------------------------------------------------------------------------------ rules


def _module_list(ctx: RuleContext) -> None:
    raw = ctx.value("offload_modules")
    path = ctx.path("offload_modules")
    if not isinstance(ctx.value("fine_grained_activation_offloading", False), bool):
        return  # the schema reports the switch's type; "off" would be a guess
    if not ctx.fgo_on:
        # The recipe's own list counts too: an explicit false clears the effective one.
        if names(ctx.megatron_cfg.get("offload_modules")) or ctx.modules:
            given = names(ctx.megatron_cfg.get("offload_modules"))
            where = f"{ctx.prefix}.offload_modules" if given else path
            ctx.warn(
                f"warning: {where}: ignored because fine_grained_activation_offloading is off; "
                f"set {ctx.prefix}.fine_grained_activation_offloading=true to use it"
            )
        return
    known = ctx.caps.offload_module_names | MLP_OFFLOAD_MODULES | {LAYER_INPUT}
    if raw is None or raw == []:
        ctx.error(
            f"{path}: fine-grained activation offloading is on but no modules are listed; "
            f"list at least one of {fmt(known)}, e.g. [core_attn, attn_proj]"
        )
        return
    modules = ctx.modules
    for name in modules:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            ctx.error(
                f"{path}: unknown module '{name}'; {hint}megatron-core "
                f"{ctx.caps.megatron_version} with this package offloads {fmt(known)}"
            )
    duplicates = sorted({name for name in modules if modules.count(name) > 1})
    if duplicates:
        ctx.warn(f"warning: {path}: {fmt(duplicates)} listed more than once; list each once")


def _module_dependencies(ctx: RuleContext) -> None:
    if not ctx.fgo_on:
        return
    modules = set(ctx.modules)
    path = ctx.path("offload_modules")
    if "attn_proj" in modules and "core_attn" not in modules:
        ctx.error(
            f"{path}: 'attn_proj' needs 'core_attn' (attn_proj's input is core attention's "
            "output, which core attention's backward also needs); add 'core_attn' or remove "
            "'attn_proj'"
        )
    moe_modules = modules & MOE_OFFLOAD_MODULES
    if moe_modules and not ctx.is_moe:
        ctx.error(
            f"{path}: {fmt(moe_modules)} offload expert activations but the model has no "
            f"experts (num_moe_experts is unset); remove them, or use a MoE model (a MoE preset "
            f"such as tiny-moe or moe-1b, or {ctx.prefix}.model_overrides.num_moe_experts)"
        )
    if "fused_group_mlp" in modules:
        if ctx.value("use_transformer_engine_op_fuser") is not True:
            ctx.error(
                f"{path}: 'fused_group_mlp' needs Transformer Engine's op fuser; set "
                f"{ctx.prefix}.model_overrides.use_transformer_engine_op_fuser=true (needs "
                "Transformer Engine) or offload expert_fc1/moe_act instead"
            )
        partial = modules & {"expert_fc1", "moe_act"}
        if partial:
            ctx.error(
                f"{path}: 'fused_group_mlp' already offloads the whole grouped MLP and cannot be "
                f"combined with {fmt(partial)}; keep one of the two"
            )
    grouped = modules & {"expert_fc1", "moe_act"}
    if grouped and ctx.is_moe and ctx.value("moe_grouped_gemm") is not True:
        ctx.error(
            f"{path}: {fmt(grouped)} are offloaded only inside the grouped expert MLP, and "
            f"moe_grouped_gemm is off: the experts would run as SequentialMLP and offload "
            f"nothing; set {ctx.prefix}.model_overrides.moe_grouped_gemm=true (Transformer "
            f"Engine's grouped linears, or this package's local ones without it), or remove "
            f"{fmt(grouped)}"
        )


def _mlp_offload(ctx: RuleContext) -> None:
    """The dense MLP's offload points (models.mlp_offload) exist where this package builds the
    layer: Megatron's dense MLP of the local layer spec, run eagerly or under recompute of other
    modules only."""
    if not ctx.fgo_on:
        return
    mlp = set(ctx.modules) & MLP_OFFLOAD_MODULES
    if not mlp:
        return
    path = ctx.path("offload_modules")
    if ctx.caps.mlp_code_drift:
        ctx.error(f"{path}: {ctx.caps.mlp_code_drift}")
    if ctx.is_moe:
        ctx.error(
            f"{path}: {fmt(mlp)} offload the dense MLP, and this model's MLPs are experts; "
            "offload expert_fc1/moe_act instead, or remove them"
        )
    if ctx.value("transformer_impl") != "local":
        ctx.error(
            f"{path}: {fmt(mlp)} are placed in Megatron's local layer spec, and "
            f"transformer_impl is {ctx.value('transformer_impl')!r}; set "
            f"{ctx.prefix}.transformer_impl: local, or remove them"
        )
    impl = ctx.value("cuda_graph_impl", "none")
    if impl not in (None, "none"):
        ctx.error(
            f"{path}: {fmt(mlp)} are not checked under CUDA graphs (cuda_graph_impl is "
            f"{impl!r}); set cuda_graph_impl: none, or remove them"
        )
    granularity = ctx.value("recompute_granularity")
    if granularity == "full":
        ctx.error(
            f"{ctx.path('recompute_granularity')}: full recompute keeps no MLP activations to "
            f"offload ({fmt(mlp)}); remove them, or use selective recompute"
        )
    elif granularity == "selective" and "mlp" in names(ctx.value("recompute_modules")):
        ctx.error(
            f"{ctx.path('recompute_modules')}: recomputing 'mlp' leaves nothing for "
            f"{fmt(mlp)} to offload; remove one of the two"
        )


def _layer_input(ctx: RuleContext) -> None:
    """``layer_input`` (offload.layer_input) offloads what full recompute keeps: each
    recomputed segment's input. It runs on Megatron's own block forward, eagerly, on one
    pipeline stage, with the segment input whole."""
    if not ctx.fgo_on or LAYER_INPUT not in ctx.modules:
        return
    path = ctx.path("offload_modules")
    if ctx.caps.layer_input_code_drift:
        ctx.error(f"{path}: {ctx.caps.layer_input_code_drift}")
    if ctx.value("recompute_granularity") != "full":
        ctx.error(
            f"{path}: 'layer_input' offloads the input of each full-recompute segment and needs "
            f"full recompute; set {ctx.prefix}.activation_checkpointing=true with "
            "recompute_granularity: full, or remove 'layer_input'"
        )
        return
    others = sorted(set(ctx.modules) - {LAYER_INPUT})
    if others:
        ctx.error(
            f"{path}: under full recompute the layers keep no activations for {fmt(others)} "
            "to offload (only each segment's input, which 'layer_input' offloads); list "
            "'layer_input' alone"
        )
    impl = ctx.value("cuda_graph_impl", "none")
    if impl not in (None, "none"):
        ctx.error(
            f"{path}: 'layer_input' runs eager hooks and copies that a CUDA graph cannot hold "
            f"(cuda_graph_impl is {impl!r}); set cuda_graph_impl: none, or remove 'layer_input'"
        )
    pp = ctx.value("pipeline_model_parallel_size", 1)
    if is_int(pp) and pp > 1:
        ctx.error(
            f"{path}: 'layer_input' is not checked with pipeline stages "
            f"(pipeline_model_parallel_size is {pp}); set it to 1, or remove 'layer_input'"
        )
    if ctx.value("distribute_saved_activations") is True:
        ctx.error(
            f"{ctx.path('distribute_saved_activations')}: already splits each segment's input "
            "over the tensor-parallel ranks, and 'layer_input' offloads it whole; use one of "
            "the two"
        )


def _exclusions(ctx: RuleContext) -> None:
    if not ctx.fgo_on:
        return
    if ctx.value("cpu_offloading") is True:
        ctx.error(
            f"{ctx.path('cpu_offloading')}: layer-level cpu_offloading cannot run with "
            "fine-grained activation offloading; turn one of them off"
        )
    moe_modules = set(ctx.modules) & MOE_OFFLOAD_MODULES
    recompute_modules = names(ctx.value("recompute_modules"))
    recomputes_moe = (
        ctx.value("recompute_granularity") == "selective" and "moe" in recompute_modules
    ) or ctx.value("moe_layer_recompute") is True
    if moe_modules and recomputes_moe:
        source = (
            ctx.path("moe_layer_recompute")
            if ctx.value("moe_layer_recompute") is True
            else ctx.path("recompute_modules")
        )
        undo = (
            "turn moe_layer_recompute off"
            if ctx.value("moe_layer_recompute") is True
            else "remove 'moe' from recompute_modules"
        )
        ctx.error(
            f"{source}: recomputing the whole 'moe' module makes offloading inside it "
            f"({fmt(moe_modules)}) redundant and breaks it; {undo} or remove "
            f"{fmt(moe_modules)} from offload_modules"
        )


def _ranges(ctx: RuleContext) -> None:
    fraction = ctx.value("activation_offload_fraction")
    if is_number(fraction):
        if not 0 <= fraction <= 1:
            ctx.error(
                f"{ctx.path('activation_offload_fraction')}: must be between 0 and 1 "
                f"(got: {fraction}); it is the fraction of eligible offload groups to offload"
            )
        elif fraction == 0 and ctx.fgo_on:
            ctx.warn(
                f"warning: {ctx.path('activation_offload_fraction')}: 0 means nothing will be "
                "offloaded; raise it or turn fine_grained_activation_offloading off"
            )
    placement = ctx.megatron_cfg.get("activation_offload_fraction_placement")
    by_module = ctx.megatron_cfg.get("activation_offload_fraction_by_module")
    module_below_one = isinstance(by_module, dict) and any(
        is_number(share) and share < 1 for share in by_module.values()
    )
    if (
        placement is not None
        and ctx.fgo_on
        and not (is_number(fraction) and fraction < 1)
        and not module_below_one
    ):
        ctx.warn(
            f"warning: {ctx.prefix}.activation_offload_fraction_placement: has no effect while "
            "activation_offload_fraction is 1 (every group is offloaded); set a fraction below "
            "1 or remove the placement"
        )
    for name in ("min_offloaded_tensor_size", "delta_offload_bytes_across_pp_ranks"):
        value = ctx.value(name)
        if is_int(value) and value < 0:
            ctx.error(f"{ctx.path(name)}: must be >= 0 (got: {value})")
    budget = ctx.megatron_cfg.get("offload_host_memory_budget_gib")
    if is_number(budget) and budget <= 0:
        ctx.error(
            f"{ctx.prefix}.offload_host_memory_budget_gib: must be > 0 (got: {budget}); it caps "
            "the pinned host memory of the offload plans, or set null for the default"
        )
    inflight = ctx.value("fine_grained_offloading_max_inflight_offloads")
    if is_int(inflight) and inflight < 0:
        ctx.error(
            f"{ctx.path('fine_grained_offloading_max_inflight_offloads')}: must be null or an "
            f"integer >= 0 (got: {inflight})"
        )
    _fraction_by_module(ctx, by_module, placement)


def _fraction_by_module(ctx: RuleContext, by_module: Any, placement: Any) -> None:
    """``activation_offload_fraction_by_module`` (ours; applied by
    ``owned.OwnedOffloadManager.post_warmup_callback``): each named module offloads that share
    of its groups, spread over the layers, in place of ``activation_offload_fraction``."""
    if by_module is None:
        return
    path = f"{ctx.prefix}.activation_offload_fraction_by_module"
    if not isinstance(by_module, dict) or not by_module:
        ctx.error(
            f"{path}: must map offload modules to the fraction of their groups to offload, "
            f"e.g. {{attn_proj: 0.5}} (got: {by_module!r})"
        )
        return
    if not ctx.fgo_on:
        ctx.warn(f"warning: {path}: has no effect while fine_grained_activation_offloading is off")
        return
    listed = set(ctx.modules)
    for name, share in by_module.items():
        if name not in listed:
            ctx.error(
                f"{path}.{name}: not in {ctx.prefix}.offload_modules ({fmt(sorted(listed))}); "
                "add it there or remove it here"
            )
        elif not (is_number(share) and 0 <= share <= 1):
            ctx.error(f"{path}.{name}: must be a number between 0 and 1 (got: {share!r})")
        elif name == "attn_proj" and "core_attn" in listed:
            # The projection's input is the attention's saved output, one storage: core_attn's
            # group copies it on every layer (one copy per storage), whatever attn_proj's share.
            ctx.error(
                f"{path}.attn_proj: not beside core_attn in offload_modules (the projection's "
                "input is the attention's saved output, which core_attn's groups copy on every "
                "layer); remove the fraction or core_attn"
            )
    if placement == "earliest":
        ctx.error(
            f"{path}: needs {ctx.prefix}.activation_offload_fraction_placement spread (Megatron's "
            "earliest placement counts the groups of every module together); remove the "
            "placement or set it to spread"
        )


def _plan_budget(ctx: RuleContext) -> None:
    """offload_plan_budget_gib runs the planner at start: it measures GPU memory, and its
    choice replaces the recipe's own offload and recompute settings."""
    budget = ctx.megatron_cfg.get("offload_plan_budget_gib")
    if budget is None:
        return
    path = f"{ctx.prefix}.offload_plan_budget_gib"
    if is_number(budget) and budget <= 0:
        ctx.error(f"{path}: must be > 0 GiB (got: {budget}), or null to plan nothing")
    if ctx.gpus_per_node == 0:
        ctx.error(
            f"{path}: planning measures GPU memory, and cluster.gpus_per_node is 0; remove it "
            "for CPU runs"
        )
    if ctx.fgo_on or ctx.megatron_cfg.get("activation_checkpointing") is True:
        ctx.warn(
            f"warning: {path}: the plan chosen at start replaces this recipe's offload and "
            "recompute settings"
        )


def _sequence_buckets(ctx: RuleContext) -> None:
    """The offload runtime pads each step to one of these lengths; it must find one for every
    sequence the recipe allows, and each must keep the padding multiple the model needs."""
    buckets = ctx.megatron_cfg.get("offload_sequence_length_buckets")
    if not isinstance(buckets, list):
        return
    path = f"{ctx.prefix}.offload_sequence_length_buckets"
    if not buckets:
        ctx.error(f"{path}: must list at least one length, or be null for the default buckets")
        return
    if any(not is_int(b) or b <= 0 for b in buckets):
        ctx.error(f"{path}: every bucket must be an integer > 0 (got: {buckets})")
        return
    if any(later <= earlier for earlier, later in zip(buckets, buckets[1:], strict=False)):
        ctx.error(f"{path}: buckets must be strictly increasing (got: {buckets}); sort them")
    multiple = ctx.policy_cfg.get("make_sequence_length_divisible_by")
    if is_int(multiple) and multiple > 1:
        odd = [b for b in buckets if b % multiple]
        if odd:
            ctx.error(
                f"{path}: {odd} not divisible by {ctx.where}.make_sequence_length_divisible_by="
                f"{multiple}; round them up to a multiple of {multiple}"
            )
    longest = ctx.policy_cfg.get("max_total_sequence_length")
    if is_int(longest) and buckets[-1] < longest:
        ctx.error(
            f"{path}: the largest bucket {buckets[-1]} is shorter than "
            f"{ctx.where}.max_total_sequence_length={longest}; add a bucket >= {longest}"
        )
    if not pads_steps(ctx.fgo_on, ctx.value("cuda_graph_impl") == "full_iteration"):
        ctx.warn(
            f"warning: {path}: set but neither fine_grained_activation_offloading nor "
            "full_iteration CUDA graphs is on, so nothing is padded to them"
        )


def _cuda_graphs(ctx: RuleContext) -> None:
    impl = ctx.value("cuda_graph_impl", "none")
    graph_modules = ctx.value("cuda_graph_modules")
    graph_modules = graph_modules if isinstance(graph_modules, list) else []
    impl_path = ctx.path("cuda_graph_impl")
    if impl == "transformer_engine" and not ctx.caps.has_transformer_engine:
        ctx.error(
            f"{impl_path}: transformer_engine CUDA graphs need Transformer Engine, which is not "
            "installed; use full_iteration (no TE needed) or none"
        )
    if impl == "full_iteration" and graph_modules:
        ctx.error(
            f"{ctx.path('cuda_graph_modules')}: must be empty with cuda_graph_impl "
            "full_iteration (the whole forward-backward is one graph); set it to []"
        )
    if impl in ("local", "transformer_engine") and ctx.value("recompute_granularity") == "full":
        ctx.error(
            f"{ctx.path('recompute_granularity')}: full recompute works only with "
            f"cuda_graph_impl full_iteration, not {impl}; use selective recompute or "
            "full_iteration graphs"
        )
    if ctx.value("delay_offload_until_cuda_graph") is True and impl != "transformer_engine":
        # megatron-core 0.19 reads it only while replaying a TE layer graph (_in_replay).
        ctx.warn(
            f"warning: {ctx.path('delay_offload_until_cuda_graph')}: has no effect without "
            f"Transformer Engine layer graphs (cuda_graph_impl is {impl}; it defers offloads "
            "until a transformer_engine layer graph has replayed)"
        )
    if impl == "full_iteration" and ctx.is_moe:
        _moe_in_full_iteration_graphs(ctx, impl_path)
    if impl != "none" and ctx.gpus_per_node == 0:
        ctx.warn(
            f"warning: {impl_path}: CUDA graphs are GPU-only and will not be applied on CPU "
            "workers (cluster.gpus_per_node is 0)"
        )
    if not ctx.fgo_on or impl == "none":
        return
    warmup = ctx.value("cuda_graph_warmup_steps", DEFAULT_CUDA_GRAPH_WARMUP_STEPS)
    if is_int(warmup) and warmup <= 0:
        ctx.error(
            f"{ctx.path('cuda_graph_warmup_steps')}: must be > 0 with CUDA graphs and "
            "fine-grained offloading (the offload plan is recorded during warm-up); set it to 3"
        )
    if "moe" in graph_modules:
        ctx.error(
            f"{ctx.path('cuda_graph_modules')}: capturing the whole 'moe' module (token-drop "
            "MoE) is not supported with activation offloading; use moe_router instead"
        )
    if impl == "full_iteration":
        inflight = ctx.value("fine_grained_offloading_max_inflight_offloads")
        if not (is_int(inflight) and inflight >= 0):
            ctx.error(
                f"{ctx.path('fine_grained_offloading_max_inflight_offloads')}: must be set to "
                "an integer >= 0 with full_iteration CUDA graphs (the graphed main stream no "
                "longer waits for offload copies by itself); set it to 4 (the fastest measured; "
                "0 waits for every copy)"
            )
    if impl == "local":
        unsupported = set(ctx.modules) - LOCAL_GRAPH_OFFLOAD_MODULES
        if unsupported:
            ctx.error(
                f"{ctx.path('offload_modules')}: with cuda_graph_impl local only "
                f"{fmt(LOCAL_GRAPH_OFFLOAD_MODULES)} can be offloaded; remove "
                f"{fmt(unsupported)} or use full_iteration graphs"
            )
        if not graph_modules:
            ctx.error(
                f"{ctx.path('cuda_graph_modules')}: whole-layer local CUDA graphs cannot run "
                "with offloading; list the parts to capture, e.g. [attn, moe_router]"
            )


def _moe_in_full_iteration_graphs(ctx: RuleContext, impl_path: str) -> None:
    """A full-iteration graph holds a MoE step only with drop-and-pad dispatch: otherwise the
    all-to-all dispatcher copies the per-expert token counts to the host every layer and waits
    for them (shapes follow the routing), and the allgather one does so always; a graph cannot
    hold a synchronisation or a changing shape. Drop-and-pad gives every expert exactly its
    capacity (tokens beyond it are dropped, empty slots padded), so nothing leaves the GPU."""
    dispatcher = ctx.value("moe_token_dispatcher_type", "allgather")
    factor = ctx.value("moe_expert_capacity_factor")
    padded = ctx.value("moe_pad_expert_input_to_capacity") is True
    if dispatcher != "alltoall":
        ctx.error(
            f"{ctx.path('moe_token_dispatcher_type')}: full_iteration CUDA graphs need the "
            f"alltoall token dispatcher on a MoE model, not {dispatcher!r} (it copies token "
            "counts to the host every layer); set model_overrides.moe_token_dispatcher_type: "
            "alltoall, or cuda_graph_impl: none"
        )
    elif not (padded and is_number(factor)):
        ctx.error(
            f"{impl_path}: full_iteration CUDA graphs cannot capture this MoE model without "
            "drop-and-pad dispatch: its token dispatch copies the per-expert token counts to "
            "the host every layer, a synchronisation a graph cannot hold; set "
            f"{ctx.prefix}.model_overrides: {{moe_expert_capacity_factor: 1.0 (or more: tokens "
            "beyond an expert's capacity are dropped), moe_pad_expert_input_to_capacity: "
            "true}, or cuda_graph_impl: none"
        )


def _local_recompute(ctx: RuleContext) -> None:
    """Selective recompute of ``layernorm``, ``mlp_act`` and ``moe_act`` on the local layer spec
    runs through this package's layer, MLP and grouped experts (models.local_recompute,
    models.grouped_linear): on Megatron code as checked, ``mlp_act`` on a dense MLP, eagerly,
    and not together with what already removes the same tensors."""
    if ctx.value("recompute_granularity") != "selective":
        return
    modules = set(names(ctx.value("recompute_modules")))
    path = ctx.path("recompute_modules")
    local = ctx.value("transformer_impl") == "local"
    if "mlp_act" in modules:
        if ctx.is_moe:
            ctx.error(
                f"{path}: 'mlp_act' recomputes the dense MLP's activation, and this model's MLPs "
                "are experts; recompute moe_act (with moe_grouped_gemm) instead, or remove it"
            )
        elif not local:
            ctx.error(
                f"{path}: 'mlp_act' is placed in Megatron's local layer spec, and "
                f"transformer_impl is {ctx.value('transformer_impl')!r}; set "
                f"{ctx.prefix}.transformer_impl: local, or remove it"
            )
        if "mlp" in modules:
            ctx.error(
                f"{path}: 'mlp' recomputes the whole MLP, its activation included; remove "
                "'mlp_act' (or 'mlp', to recompute only the activation)"
            )
    if "mlp" in modules and ctx.is_moe:
        ctx.error(
            f"{path}: 'mlp' recomputes the dense MLP, and this model's MLPs are experts (Megatron "
            "skips it there); recompute moe or moe_act instead, or remove it"
        )
    seams = modules & LOCAL_RECOMPUTE_MODULES if local else set()
    for line in sorted({line for name, line in ctx.caps.recompute_code_drift if name in seams}):
        ctx.error(f"{path}: {line}")
    impl = ctx.value("cuda_graph_impl", "none")
    if seams and impl not in (None, "none"):
        ctx.error(
            f"{path}: {fmt(seams)} recompute on the local layer spec is not checked under CUDA "
            f"graphs (cuda_graph_impl is {impl!r}); set cuda_graph_impl: none, or remove "
            f"{fmt(seams)}"
        )
    if not ctx.fgo_on:
        return
    for name in sorted(seams):
        both = OFFLOADS_FREED_BY_RECOMPUTE[name] & set(ctx.modules)
        if both:
            ctx.error(
                f"{path}: '{name}' recompute frees what {fmt(both)} offload (the same tensors); "
                f"remove '{name}' or remove {fmt(both)} from offload_modules"
            )


def _pipeline(ctx: RuleContext) -> None:
    delta = ctx.value("delta_offload_bytes_across_pp_ranks")
    pp = ctx.value("pipeline_model_parallel_size", 1)
    if ctx.fgo_on and is_int(delta) and delta > 0 and pp == 1:
        ctx.warn(
            f"warning: {ctx.path('delta_offload_bytes_across_pp_ranks')}: has no effect with "
            "pipeline_model_parallel_size 1"
        )


def _environment(ctx: RuleContext) -> None:
    if not ctx.fgo_on:
        return
    if ctx.gpus_per_node == 0:
        ctx.warn(
            f"warning: {ctx.path('fine_grained_activation_offloading')}: offloading is GPU-only "
            "and will not be applied on CPU workers (cluster.gpus_per_node is 0)"
        )
    elif ctx.caps.offload_code_drift:  # the offload runtime would refuse to start
        ctx.error(
            f"{ctx.path('fine_grained_activation_offloading')}: {ctx.caps.offload_code_drift}"
        )
    if ctx.caps.te_needs_offload_v1_env:
        env_vars = ctx.megatron_cfg.get("env_vars") or {}
        given = env_vars.get("NVTE_CPU_OFFLOAD_V1") if isinstance(env_vars, dict) else None
        if given is not None and given != "1":
            ctx.error(
                f"{ctx.prefix}.env_vars.NVTE_CPU_OFFLOAD_V1: Transformer Engine "
                f"{ctx.caps.te_version} needs '1' for Megatron's offloading; remove it (it is set "
                "for you)"
            )
        ctx.findings.worker_env["NVTE_CPU_OFFLOAD_V1"] = "1"
        ctx.findings.notes.append(
            f"Transformer Engine {ctx.caps.te_version} is installed: NVTE_CPU_OFFLOAD_V1=1 is set "
            "in every policy worker's environment, as Megatron's offloading needs"
        )


def _offloaded_input_elements(ctx: RuleContext, tokens: int) -> dict[str, int]:
    """Rough element counts of each module's offloaded input per micro-batch, to compare with
    min_offloaded_tensor_size (Megatron skips smaller tensors)."""
    hidden = ctx.value("hidden_size")
    heads = ctx.value("num_attention_heads")
    if not (is_int(hidden) and is_int(heads) and heads > 0):
        return {}
    head_dim = ctx.value("kv_channels") or hidden // heads
    tp = ctx.value("tensor_model_parallel_size", 1) or 1
    # Sequence parallelism: each rank normalises its share of the (padded) sequence.
    norm_tokens = -(-tokens // tp) if ctx.value("sequence_parallel") is True else tokens
    sizes = {
        "attn_norm": norm_tokens * hidden,
        "mlp_norm": norm_tokens * hidden,
        "qkv_linear": tokens * hidden,
        "core_attn": tokens * heads * head_dim // tp,
        "attn_proj": tokens * heads * head_dim // tp,
    }
    ffn = ctx.value("ffn_hidden_size")
    if is_int(ffn) and not ctx.is_moe:
        gated = 2 if ctx.value("gated_linear_unit") else 1
        sizes["mlp_fc1"] = norm_tokens * hidden
        sizes["mlp_act"] = tokens * ffn * gated // tp
        sizes["mlp_fc2"] = tokens * ffn // tp
    if ctx.is_moe:
        topk = ctx.value("moe_router_topk", 2)
        ffn = ctx.value("moe_ffn_hidden_size") or ctx.value("ffn_hidden_size") or 4 * hidden
        gated = 2 if ctx.value("gated_linear_unit") else 1
        routed = tokens * topk
        sizes["expert_fc1"] = routed * hidden
        sizes["fused_group_mlp"] = routed * hidden
        sizes["moe_act"] = routed * ffn * gated // (ctx.value("expert_tensor_parallel_size") or tp)
    return sizes


def _tensor_sizes(ctx: RuleContext) -> None:
    if not ctx.fgo_on or not ctx.modules:
        return
    micro = ctx.policy_cfg.get("train_micro_batch_size")
    seq = ctx.policy_cfg.get("max_total_sequence_length")
    cp = ctx.value("context_parallel_size", 1) or 1
    if not (is_int(micro) and is_int(seq) and is_int(cp) and cp > 0):
        return
    tokens = micro * seq // cp
    minimum = ctx.value("min_offloaded_tensor_size", DEFAULT_MIN_OFFLOADED_TENSOR_SIZE)
    if not is_int(minimum):
        return
    sizes = _offloaded_input_elements(ctx, tokens)
    small = {name: sizes[name] for name in ctx.modules if name in sizes and sizes[name] < minimum}
    if small:
        listing = ", ".join(f"{name} ~{count:,}" for name, count in sorted(small.items()))
        ctx.warn(
            f"warning: {ctx.path('min_offloaded_tensor_size')}: inputs of {listing} elements "
            f"per micro-batch (at {tokens:,} tokens) fall under the minimum of {minimum:,}, so "
            f"they will not be offloaded; lower min_offloaded_tensor_size to at most "
            f"{min(small.values()):,} or drop those modules"
        )


OFFLOAD_RULES: tuple[Rule, ...] = (
    _module_list,
    _module_dependencies,
    _mlp_offload,
    _layer_input,
    _exclusions,
    _ranges,
    _plan_budget,
    _sequence_buckets,
    _cuda_graphs,
    _local_recompute,
    _pipeline,
    _environment,
    _tensor_sizes,
)
