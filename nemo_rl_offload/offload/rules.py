"""Every compatibility rule of fine-grained activation offloading (FGO), in one place.

Each rule reads the settings as :func:`nemo_rl_offload.offload.apply.effective_settings` resolves
them (so what is checked is what will be applied) and reports a complete line:
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
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_offload.config.model_presets import Architecture
from nemo_rl_offload.offload import apply
from nemo_rl_offload.offload.capabilities import (
    LAYER_INPUT,
    LOCAL_RECOMPUTE_MODULES,
    MLP_OFFLOAD_MODULES,
    MOE_OFFLOAD_MODULES,
    Capabilities,
    transformer_config_fields,
)
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


@dataclass
class Findings:
    """What the rules found. ``worker_env`` holds variables every policy worker must get."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    worker_env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def extend(self, other: Findings) -> None:
        self.errors += other.errors
        self.warnings += other.warnings
        self.worker_env.update(other.worker_env)
        self.notes += other.notes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _names(value: Any) -> list[str]:
    """A list of module names, or [] when the value is not such a list (the schema reports it)."""
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    return []


def _fmt(names: Any) -> str:
    return "[" + ", ".join(sorted(names)) + "]"


@dataclass
class _Context:
    """What every rule needs: the effective settings and where each came from."""

    where: str
    megatron_cfg: dict[str, Any]
    effective: apply.EffectiveSettings
    architecture: Architecture | None
    caps: Capabilities
    policy_cfg: dict[str, Any]
    gpus_per_node: Any
    # How many workers the section runs on (None: the cluster section is malformed; the
    # schema reports it).
    workers: int | None = None
    findings: Findings = field(default_factory=Findings)

    @property
    def prefix(self) -> str:
        return f"{self.where}.megatron_cfg"

    def path(self, name: str) -> str:
        return self.effective.source(name, f"{self.prefix}.{name}")

    def value(self, name: str, default: Any = None) -> Any:
        return self.effective.value(name, default)

    def error(self, line: str) -> None:
        self.findings.errors.append(line)

    def warn(self, line: str) -> None:
        self.findings.warnings.append(line)

    @property
    def fgo_on(self) -> bool:
        return self.value("fine_grained_activation_offloading") is True

    @property
    def modules(self) -> list[str]:
        return _names(self.value("offload_modules"))

    @property
    def is_moe(self) -> bool:
        return self.effective.is_moe


def check_policy(
    policy_cfg: dict[str, Any],
    *,
    where: str,
    architecture: Architecture | None,
    caps: Capabilities,
    gpus_per_node: Any = None,
    workers: int | None = None,
) -> Findings:
    """Run every rule on one policy section (``policy`` or ``teacher``) that runs on
    ``workers`` workers."""
    megatron_cfg = policy_cfg.get("megatron_cfg")
    if not isinstance(megatron_cfg, dict):
        return Findings()  # the schema reports the missing or malformed section
    effective = apply.effective_settings(
        policy_cfg, architecture, where=where, te_installed=caps.has_transformer_engine
    )
    ctx = _Context(
        where, megatron_cfg, effective, architecture, caps, policy_cfg, gpus_per_node, workers
    )
    for rule in _RULES:
        rule(ctx)
    return ctx.findings


# ------------------------------------------------------------------------------------ rules


def _backend(ctx: _Context) -> None:
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


def _overrides(ctx: _Context) -> None:
    for name, path, other in ctx.effective.conflicts:
        if path.startswith(f"{ctx.prefix}.model_overrides."):
            ctx.error(f"{path}: {name} cannot be set through model_overrides; set {other} instead")
        else:
            ctx.error(f"{path}: disagrees with {other}; set {name} in one place only")
    overrides = ctx.megatron_cfg.get("model_overrides")
    known = transformer_config_fields()
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


def _module_list(ctx: _Context) -> None:
    raw = ctx.value("offload_modules")
    path = ctx.path("offload_modules")
    if not isinstance(ctx.value("fine_grained_activation_offloading", False), bool):
        return  # the schema reports the switch's type; "off" would be a guess
    if not ctx.fgo_on:
        # The recipe's own list counts too: an explicit false clears the effective one.
        if _names(ctx.megatron_cfg.get("offload_modules")) or ctx.modules:
            given = _names(ctx.megatron_cfg.get("offload_modules"))
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
            f"list at least one of {_fmt(known)}, e.g. [core_attn, attn_proj]"
        )
        return
    modules = ctx.modules
    for name in modules:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            ctx.error(
                f"{path}: unknown module '{name}'; {hint}megatron-core "
                f"{ctx.caps.megatron_version} with this package offloads {_fmt(known)}"
            )
    duplicates = sorted({name for name in modules if modules.count(name) > 1})
    if duplicates:
        ctx.warn(f"warning: {path}: {_fmt(duplicates)} listed more than once; list each once")


def _module_dependencies(ctx: _Context) -> None:
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
            f"{path}: {_fmt(moe_modules)} offload expert activations but the model has no "
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
                f"combined with {_fmt(partial)}; keep one of the two"
            )
    grouped = modules & {"expert_fc1", "moe_act"}
    if grouped and ctx.is_moe and ctx.value("moe_grouped_gemm") is not True:
        ctx.error(
            f"{path}: {_fmt(grouped)} are offloaded only inside the grouped expert MLP, and "
            f"moe_grouped_gemm is off: the experts would run as SequentialMLP and offload "
            f"nothing; set {ctx.prefix}.model_overrides.moe_grouped_gemm=true (Transformer "
            f"Engine's grouped linears, or this package's local ones without it), or remove "
            f"{_fmt(grouped)}"
        )


def _mlp_offload(ctx: _Context) -> None:
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
            f"{path}: {_fmt(mlp)} offload the dense MLP, and this model's MLPs are experts; "
            "offload expert_fc1/moe_act instead, or remove them"
        )
    if ctx.value("transformer_impl") != "local":
        ctx.error(
            f"{path}: {_fmt(mlp)} are placed in Megatron's local layer spec, and "
            f"transformer_impl is {ctx.value('transformer_impl')!r}; set "
            f"{ctx.prefix}.transformer_impl: local, or remove them"
        )
    impl = ctx.value("cuda_graph_impl", "none")
    if impl not in (None, "none"):
        ctx.error(
            f"{path}: {_fmt(mlp)} are not checked under CUDA graphs (cuda_graph_impl is "
            f"{impl!r}); set cuda_graph_impl: none, or remove them"
        )
    granularity = ctx.value("recompute_granularity")
    if granularity == "full":
        ctx.error(
            f"{ctx.path('recompute_granularity')}: full recompute keeps no MLP activations to "
            f"offload ({_fmt(mlp)}); remove them, or use selective recompute"
        )
    elif granularity == "selective" and "mlp" in _names(ctx.value("recompute_modules")):
        ctx.error(
            f"{ctx.path('recompute_modules')}: recomputing 'mlp' leaves nothing for "
            f"{_fmt(mlp)} to offload; remove one of the two"
        )


def _layer_input(ctx: _Context) -> None:
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
            f"{path}: under full recompute the layers keep no activations for {_fmt(others)} "
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
    if _is_int(pp) and pp > 1:
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


def _exclusions(ctx: _Context) -> None:
    if not ctx.fgo_on:
        return
    if ctx.value("cpu_offloading") is True:
        ctx.error(
            f"{ctx.path('cpu_offloading')}: layer-level cpu_offloading cannot run with "
            "fine-grained activation offloading; turn one of them off"
        )
    moe_modules = set(ctx.modules) & MOE_OFFLOAD_MODULES
    recompute_modules = _names(ctx.value("recompute_modules"))
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
            f"({_fmt(moe_modules)}) redundant and breaks it; {undo} or remove "
            f"{_fmt(moe_modules)} from offload_modules"
        )


def _ranges(ctx: _Context) -> None:
    fraction = ctx.value("activation_offload_fraction")
    if _is_number(fraction):
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
        _is_number(share) and share < 1 for share in by_module.values()
    )
    if (
        placement is not None
        and ctx.fgo_on
        and not (_is_number(fraction) and fraction < 1)
        and not module_below_one
    ):
        ctx.warn(
            f"warning: {ctx.prefix}.activation_offload_fraction_placement: has no effect while "
            "activation_offload_fraction is 1 (every group is offloaded); set a fraction below "
            "1 or remove the placement"
        )
    for name in ("min_offloaded_tensor_size", "delta_offload_bytes_across_pp_ranks"):
        value = ctx.value(name)
        if _is_int(value) and value < 0:
            ctx.error(f"{ctx.path(name)}: must be >= 0 (got: {value})")
    budget = ctx.megatron_cfg.get("offload_host_memory_budget_gib")
    if _is_number(budget) and budget <= 0:
        ctx.error(
            f"{ctx.prefix}.offload_host_memory_budget_gib: must be > 0 (got: {budget}); it caps "
            "the pinned host memory of the offload plans, or set null for the default"
        )
    inflight = ctx.value("fine_grained_offloading_max_inflight_offloads")
    if _is_int(inflight) and inflight < 0:
        ctx.error(
            f"{ctx.path('fine_grained_offloading_max_inflight_offloads')}: must be null or an "
            f"integer >= 0 (got: {inflight})"
        )
    _fraction_by_module(ctx, by_module, placement)


def _fraction_by_module(ctx: _Context, by_module: Any, placement: Any) -> None:
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
    modules = ctx.value("offload_modules")
    listed = set(modules) if isinstance(modules, list) else set()
    for name, share in by_module.items():
        if name not in listed:
            ctx.error(
                f"{path}.{name}: not in {ctx.prefix}.offload_modules ({_fmt(sorted(listed))}); "
                "add it there or remove it here"
            )
        elif not (_is_number(share) and 0 <= share <= 1):
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


def _plan_budget(ctx: _Context) -> None:
    """offload_plan_budget_gib runs the planner at start: it measures GPU memory, and its
    choice replaces the recipe's own offload and recompute settings."""
    budget = ctx.megatron_cfg.get("offload_plan_budget_gib")
    if budget is None:
        return
    path = f"{ctx.prefix}.offload_plan_budget_gib"
    if _is_number(budget) and budget <= 0:
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


def _sequence_buckets(ctx: _Context) -> None:
    """The offload runtime pads each step to one of these lengths; it must find one for every
    sequence the recipe allows, and each must keep the padding multiple the model needs."""
    buckets = ctx.megatron_cfg.get("offload_sequence_length_buckets")
    if not isinstance(buckets, list):
        return
    path = f"{ctx.prefix}.offload_sequence_length_buckets"
    if not buckets:
        ctx.error(f"{path}: must list at least one length, or be null for the default buckets")
        return
    if any(not _is_int(b) or b <= 0 for b in buckets):
        ctx.error(f"{path}: every bucket must be an integer > 0 (got: {buckets})")
        return
    if any(later <= earlier for earlier, later in zip(buckets, buckets[1:], strict=False)):
        ctx.error(f"{path}: buckets must be strictly increasing (got: {buckets}); sort them")
    multiple = ctx.policy_cfg.get("make_sequence_length_divisible_by")
    if _is_int(multiple) and multiple > 1:
        odd = [b for b in buckets if b % multiple]
        if odd:
            ctx.error(
                f"{path}: {odd} not divisible by {ctx.where}.make_sequence_length_divisible_by="
                f"{multiple}; round them up to a multiple of {multiple}"
            )
    longest = ctx.policy_cfg.get("max_total_sequence_length")
    if _is_int(longest) and buckets[-1] < longest:
        ctx.error(
            f"{path}: the largest bucket {buckets[-1]} is shorter than "
            f"{ctx.where}.max_total_sequence_length={longest}; add a bucket >= {longest}"
        )
    if not pads_steps(ctx.fgo_on, ctx.value("cuda_graph_impl") == "full_iteration"):
        ctx.warn(
            f"warning: {path}: set but neither fine_grained_activation_offloading nor "
            "full_iteration CUDA graphs is on, so nothing is padded to them"
        )


def _cuda_graphs(ctx: _Context) -> None:
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
    if _is_int(warmup) and warmup <= 0:
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
        if not (_is_int(inflight) and inflight >= 0):
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
                f"{_fmt(LOCAL_GRAPH_OFFLOAD_MODULES)} can be offloaded; remove "
                f"{_fmt(unsupported)} or use full_iteration graphs"
            )
        if not graph_modules:
            ctx.error(
                f"{ctx.path('cuda_graph_modules')}: whole-layer local CUDA graphs cannot run "
                "with offloading; list the parts to capture, e.g. [attn, moe_router]"
            )


def _moe_in_full_iteration_graphs(ctx: _Context, impl_path: str) -> None:
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
    elif not (padded and _is_number(factor)):
        ctx.error(
            f"{impl_path}: full_iteration CUDA graphs cannot capture this MoE model without "
            "drop-and-pad dispatch: its token dispatch copies the per-expert token counts to "
            "the host every layer, a synchronisation a graph cannot hold; set "
            f"{ctx.prefix}.model_overrides: {{moe_expert_capacity_factor: 1.0 (or more: tokens "
            "beyond an expert's capacity are dropped), moe_pad_expert_input_to_capacity: "
            "true}, or cuda_graph_impl: none"
        )


def _fusions(ctx: _Context) -> None:
    """Fusions whose kernels come from Transformer Engine, asked for without it
    (:data:`.apply.TE_KERNEL_FUSIONS`): they run unfused."""
    for path in ctx.effective.unavailable_fusions:
        ctx.warn(
            f"warning: {path}: ignored: its fused kernel comes from Transformer Engine, which is "
            "not installed; the unfused path runs (same results up to rounding)"
        )


def _recompute(ctx: _Context) -> None:
    for name in ctx.effective.ignored_recompute_keys:
        value = ctx.megatron_cfg.get(name)
        if name == "recompute_modules" and value or value == "selective":
            ctx.warn(
                f"warning: {ctx.prefix}.{name}: ignored because activation_checkpointing is "
                f"false; set {ctx.prefix}.activation_checkpointing=true to recompute"
            )


def _local_recompute(ctx: _Context) -> None:
    """Selective recompute of ``layernorm``, ``mlp_act`` and ``moe_act`` on the local layer spec
    runs through this package's layer, MLP and grouped experts (models.local_recompute,
    models.grouped_linear): on Megatron code as checked, ``mlp_act`` on a dense MLP, eagerly,
    and not together with what already removes the same tensors."""
    if ctx.value("recompute_granularity") != "selective":
        return
    modules = set(_names(ctx.value("recompute_modules")))
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
            f"{path}: {_fmt(seams)} recompute on the local layer spec is not checked under CUDA "
            f"graphs (cuda_graph_impl is {impl!r}); set cuda_graph_impl: none, or remove "
            f"{_fmt(seams)}"
        )
    if not ctx.fgo_on:
        return
    for name in sorted(seams):
        both = OFFLOADS_FREED_BY_RECOMPUTE[name] & set(ctx.modules)
        if both:
            ctx.error(
                f"{path}: '{name}' recompute frees what {_fmt(both)} offload (the same tensors); "
                f"remove '{name}' or remove {_fmt(both)} from offload_modules"
            )


def _optimizer_offload(ctx: _Context) -> None:
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
        and not apply.precision_aware_optimizer(
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
        if _is_number(fraction) and fraction > 0:
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
    if not (_is_number(fraction) and 0 < fraction <= 1):
        ctx.error(
            f"{path}.optimizer_offload_fraction: must be in (0, 1] with optimizer_cpu_offload "
            f"(got: {fraction}); it is the share of the optimizer state kept on the host, e.g. 1.0"
        )
    if ctx.gpus_per_node == 0:
        ctx.error(
            f"{path}.optimizer_cpu_offload: megatron-core's hybrid CPU optimizer needs CUDA "
            "(cluster.gpus_per_node is 0); turn it off for CPU runs"
        )


def _gradient_reduction(ctx: _Context) -> None:
    ddp = ctx.megatron_cfg.get("distributed_data_parallel_config")
    if isinstance(ddp, dict) and ddp.get("average_in_collective") is True:
        ctx.error(
            f"{ctx.prefix}.distributed_data_parallel_config.average_in_collective: must be false:"
            " losses are normalised per token over the whole step (Megatron's per-token loss), "
            "which cannot average in the collective; set it to false"
        )


def _pipeline(ctx: _Context) -> None:
    delta = ctx.value("delta_offload_bytes_across_pp_ranks")
    pp = ctx.value("pipeline_model_parallel_size", 1)
    if ctx.fgo_on and _is_int(delta) and delta > 0 and pp == 1:
        ctx.warn(
            f"warning: {ctx.path('delta_offload_bytes_across_pp_ranks')}: has no effect with "
            "pipeline_model_parallel_size 1"
        )


def _parallel_layout(ctx: _Context) -> None:
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
    if not all(_is_int(size) and size >= 1 for size in sizes.values()):
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
        # apply.transformer_config_kwargs turns it off (Megatron refuses it without tensor
        # parallelism); sequences are padded to a multiple of the tensor-parallel size at the
        # model's input (models.train_step), so no other setting can conflict with it.
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
    if ctx.is_moe and _is_int(etp) and ctx.workers % (ep * etp * pp):
        ctx.error(
            f"{ctx.path('expert_model_parallel_size')}: expert x expert-tensor x pipeline "
            f"parallel sizes ({ep} x {etp} x {pp}) do not divide the {ctx.workers} worker(s) of "
            f"{workers_key}; use sizes whose product divides it"
        )


def _pipeline_layers(ctx: _Context, pp: int) -> None:
    """Megatron builds num_layers / pp layers per stage (after the first and last stages'
    own counts when given): a remainder fails only when the workers build the model."""
    layers = ctx.value("num_layers")
    if pp == 1 or not _is_int(layers):
        return
    given = {
        name: ctx.value(name)
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
        if _is_int(ctx.value(name))
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


def _tensor_split(ctx: _Context, tp: int) -> None:
    """Tensor parallelism splits heads, query groups and the MLP's hidden size over the ranks:
    each must divide (Megatron asserts it while building the layers)."""
    if tp == 1:
        return
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        value = ctx.value(name)
        if _is_int(value) and value % tp:
            ctx.error(
                f"{ctx.path('tensor_model_parallel_size')}: {tp} does not divide the model's "
                f"{name} ({value}); use a tensor parallel size that divides it"
            )


def _environment(ctx: _Context) -> None:
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


def _offloaded_input_elements(ctx: _Context, tokens: int) -> dict[str, int]:
    """Rough element counts of each module's offloaded input per micro-batch, to compare with
    min_offloaded_tensor_size (Megatron skips smaller tensors)."""
    hidden = ctx.value("hidden_size")
    heads = ctx.value("num_attention_heads")
    if not (_is_int(hidden) and _is_int(heads) and heads > 0):
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
    if _is_int(ffn) and not ctx.is_moe:
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


def _tensor_sizes(ctx: _Context) -> None:
    if not ctx.fgo_on or not ctx.modules:
        return
    micro = ctx.policy_cfg.get("train_micro_batch_size")
    seq = ctx.policy_cfg.get("max_total_sequence_length")
    cp = ctx.value("context_parallel_size", 1) or 1
    if not (_is_int(micro) and _is_int(seq) and _is_int(cp) and cp > 0):
        return
    tokens = micro * seq // cp
    minimum = ctx.value("min_offloaded_tensor_size", DEFAULT_MIN_OFFLOADED_TENSOR_SIZE)
    if not _is_int(minimum):
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


def _token_batching(ctx: _Context) -> None:
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
                f"{algorithm!r}; use one of {_fmt(PACKERS)}"
            )
    longest = ctx.policy_cfg.get("max_total_sequence_length")
    multiple = ctx.policy_cfg.get("make_sequence_length_divisible_by") or 1
    rounding = dynamic_cfg.get("sequence_length_round") or 1 if dynamic_on else 1
    if _is_int(longest) and _is_int(multiple) and _is_int(rounding):
        step = max(multiple, rounding)
        need = -(-longest // step) * step
        for budget in ("train_mb_tokens", "logprob_mb_tokens"):
            value = cfg.get(budget)
            if value is None:
                continue
            if _is_int(value) and value < need and packing_on:
                # NeMo-RL's packers refuse only a sequence longer than the pack, when one
                # comes: most RL sequences are far shorter than max_total_sequence_length.
                ctx.warn(
                    f"warning: {ctx.where}.{key}.{budget}: {value} is less than "
                    f"max_total_sequence_length {longest} (padded: {need}): a sequence longer "
                    f"than {value} tokens stops the run when it occurs; set it to at least "
                    f"{need} to rule that out"
                )
            elif not _is_int(value) or value < need:
                ctx.error(
                    f"{ctx.where}.{key}.{budget}: {value} cannot hold a sequence of "
                    f"max_total_sequence_length {longest} (padded: {need}); set it to at "
                    f"least {need}"
                )
    rounding_value = dynamic_cfg.get("sequence_length_round")
    if (
        dynamic_on
        and rounding_value is not None
        and not (_is_int(rounding_value) and rounding_value >= 1)
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
    if dynamic_on and _is_int(pp) and pp > 1:
        ctx.error(
            f"{ctx.where}.dynamic_batching: needs pipeline_model_parallel_size 1 (as in "
            "NeMo-RL: the stages exchange micro-batches of one shape); use sequence_packing"
        )


def _logprob_chunk(ctx: _Context) -> None:
    """``logprob_chunk_size`` (``models.chunked_logprobs``): positions per chunk, null for
    none."""
    chunk = ctx.policy_cfg.get("logprob_chunk_size")
    if chunk is not None and not (_is_int(chunk) and chunk >= 1):
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


def _multi_token_prediction(ctx: _Context) -> None:
    """``mtp_num_layers`` (Megatron's MTP block: ``models.builder.mtp_block_spec``, its loss
    mask from ``models.train_step``, its metrics from ``models.mtp``): what it runs beside."""
    depth = ctx.value("mtp_num_layers")
    path = ctx.path("mtp_num_layers")
    if depth is not None and not (_is_int(depth) and depth >= 0):
        ctx.error(f"{path}: must be an integer >= 0 (0 or null: no MTP) (got: {depth})")
        return
    scale = ctx.value("mtp_loss_scaling_factor")
    if scale is not None and not (_is_number(scale) and scale >= 0):
        ctx.error(
            f"{ctx.path('mtp_loss_scaling_factor')}: must be a number >= 0 (the MTP losses' "
            f"weight beside the policy's loss) (got: {scale})"
        )
    if not depth:
        return
    pp = ctx.value("pipeline_model_parallel_size", 1)
    if _is_int(pp) and pp > 1:
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


_RULES = (
    _backend,
    _overrides,
    _module_list,
    _module_dependencies,
    _mlp_offload,
    _layer_input,
    _exclusions,
    _ranges,
    _plan_budget,
    _sequence_buckets,
    _cuda_graphs,
    _fusions,
    _recompute,
    _local_recompute,
    _pipeline,
    _parallel_layout,
    _gradient_reduction,
    _optimizer_offload,
    _environment,
    _tensor_sizes,
    _token_batching,
    _logprob_chunk,
    _multi_token_prediction,
)
