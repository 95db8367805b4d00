"""Apply a validated ``policy.megatron_cfg`` to Megatron-core's TransformerConfig.

The one owner of what every TransformerConfig field ends up as and where that value came from
(:func:`effective_settings`); the offload rules read the same answer, so what is checked is
exactly what is applied. The layers, later winning: docs/offloading.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_rl_offload.config import fp8, multi_token_prediction, peft, router_replay
from nemo_rl_offload.config.fp8 import Fp8Settings
from nemo_rl_offload.config.model_presets import Architecture, has_experts
from nemo_rl_offload.config.module_names import (
    LAYER_INPUT,
    MLP_OFFLOAD_MODULES,
    PROJECT_RECOMPUTE_MODULES,
)
from nemo_rl_offload.config.peft import LoraSettings

# megatron_cfg keys that are TransformerConfig fields of the same name.
FGO_KEYS = (
    "fine_grained_activation_offloading",
    "offload_modules",
    "min_offloaded_tensor_size",
    "activation_offload_fraction",
    "delay_offload_until_cuda_graph",
    "delta_offload_bytes_across_pp_ranks",
    "fine_grained_offloading_max_inflight_offloads",
)
CUDA_GRAPH_KEYS = ("cuda_graph_impl", "cuda_graph_modules", "cuda_graph_warmup_steps")
# How a MoE model dispatches tokens: whether its step has static shapes (drop-and-pad), which
# full-iteration graphs need, and which changes what the model computes (dropped tokens).
MOE_DISPATCH_KEYS = (
    "moe_token_dispatcher_type",
    "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity",
)
RECOMPUTE_KEYS = (
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
)
DIRECT_TRANSFORMER_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "sequence_parallel",
    "pipeline_dtype",
    "moe_router_dtype",
    "moe_router_load_balancing_type",
    "moe_router_bias_update_rate",
    "moe_permute_fusion",
    "apply_rope_fusion",
    "bias_activation_fusion",
    *FGO_KEYS,
    *CUDA_GRAPH_KEYS,
    *multi_token_prediction.MTP_KEYS,
)
# Fusion switches whose kernels megatron-core takes from Transformer Engine (its config refuses
# them without TE). NeMo-RL's recipes turn apply_rope_fusion on; unfused, the same arithmetic
# runs (up to rounding), so without TE they are turned off with a warning.
TE_KERNEL_FUSIONS = ("apply_rope_fusion", "moe_permute_fusion")
# NeMo-RL's defaults for the recompute keys once activation_checkpointing is on.
RECOMPUTE_DEFAULTS: dict[str, Any] = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}
FULL_RECOMPUTE_ONLY_KEYS = ("recompute_method", "recompute_num_layers")


@dataclass(frozen=True)
class Setting:
    """A TransformerConfig value and the dotted recipe path it came from."""

    value: Any
    source: str


@dataclass(frozen=True)
class EffectiveSettings:
    settings: dict[str, Setting]
    # (field, path, other path): a named key and model_overrides disagree, or model_overrides
    # sets a key that only its named form may set.
    conflicts: list[tuple[str, str, str]]
    # recompute_* keys given while activation_checkpointing is off (NeMo-RL ignores them).
    ignored_recompute_keys: list[str]
    # The LoRA adapters the layer spec places (megatron_cfg.peft), None without.
    lora: LoraSettings | None = None
    # Fusions the recipe turned on whose kernels come from Transformer Engine, which is not
    # installed: the paths that asked for them (each runs unfused; validate warns).
    unavailable_fusions: list[str] = field(default_factory=list)
    # megatron_cfg.freeze_moe_router (:func:`freezes_moe_router`).
    freeze_moe_router: bool = False
    # megatron_cfg.fp8_cfg (config.fp8): the layers' linears make FP8 products; None without.
    fp8: Fp8Settings | None = None
    # megatron_cfg.activation_offload_fraction_by_module (:func:`fraction_by_module`).
    fraction_by_module: tuple[tuple[str, float], ...] = ()

    def value(self, name: str, default: Any = None) -> Any:
        setting = self.settings.get(name)
        return default if setting is None else setting.value

    def source(self, name: str, fallback: str) -> str:
        setting = self.settings.get(name)
        return fallback if setting is None else setting.source

    @property
    def is_moe(self) -> bool:
        """The model has experts (:func:`.model_presets.has_experts`)."""
        return has_experts(self.value("num_moe_experts"))

    @property
    def listed_offload_modules(self) -> tuple[str, ...]:
        """``offload_modules`` as resolved, whether offloading is on or not (the one reader of
        the key; () when it is not a list of names, which the schema reports)."""
        modules = self.value("offload_modules")
        if isinstance(modules, list) and all(isinstance(name, str) for name in modules):
            return tuple(modules)
        return ()

    @property
    def offload_modules(self) -> tuple[str, ...]:
        """The offload modules that run: none while fine-grained offloading is off."""
        if self.value("fine_grained_activation_offloading") is not True:
            return ()
        return self.listed_offload_modules


# The layout of a model built on one rank (export-hf's reader, the activation ledger): no
# parallelism, no per-stage layer counts, the local spec, no graphs.
SINGLE_RANK_LAYOUT: dict[str, Any] = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "sequence_parallel": False,
    "transformer_impl": "local",
    "cuda_graph_impl": "none",
}

# activation_offload_fraction_placement when the recipe does not set it.
DEFAULT_FRACTION_PLACEMENT = "spread"


@dataclass(frozen=True)
class RuntimeChoices:
    """The offload runtime's choices for every plan of one model (they become each plan's
    ``owned.PlanChoices``), decided in one place, :func:`runtime_choices`:

    - ``fraction_placement``: which groups a fraction below 1 offloads (``spread`` or Megatron's
      ``earliest``);
    - ``fraction_by_module``: ``activation_offload_fraction_by_module`` as (module, fraction)
      pairs, each module's own fraction in place of the plan's (spread placement);
    - ``strided_copies``: permuted tensors copied as they lie;
    - ``pool_expert_groups``: expert groups draw pinned buffers from the pool once their plan is
      recorded (their shapes recur only with drop-and-pad dispatch);
    - ``lean_hooks``: the hooks' work in less host time;
    - ``one_copy_per_storage``: tensors that view one storage are copied once, and what a
      later module keeps on the GPU is not copied (eager steps: it acts in the lean hooks)."""

    fraction_placement: str = DEFAULT_FRACTION_PLACEMENT
    fraction_by_module: tuple[tuple[str, float], ...] = ()
    strided_copies: bool = True
    pool_expert_groups: bool = False
    lean_hooks: bool = True
    one_copy_per_storage: bool = True


def runtime_choices(
    effective: EffectiveSettings, megatron_cfg: dict[str, Any], *, graphed: bool
) -> RuntimeChoices:
    """The runtime's choices for a model with ``effective`` settings (``graphed``: its steps run
    as full-iteration CUDA graphs)."""
    return RuntimeChoices(
        fraction_placement=megatron_cfg.get("activation_offload_fraction_placement")
        or DEFAULT_FRACTION_PLACEMENT,
        fraction_by_module=effective.fraction_by_module,
        # Faster on dense models and on graphed MoE steps, slower on eager MoE steps (host
        # bound), measured on an H100: see docs/offloading.md.
        strided_copies=not effective.is_moe or graphed,
        pool_expert_groups=effective.value("moe_pad_expert_input_to_capacity") is True,
    )


def fraction_by_module(megatron_cfg: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """``activation_offload_fraction_by_module`` as sorted (module, fraction) pairs (the rules
    have checked it: :func:`nemo_rl_offload.preflight.check_policy`)."""
    by_module = megatron_cfg.get("activation_offload_fraction_by_module")
    if not isinstance(by_module, dict):
        return ()
    return tuple(
        sorted(
            (str(name), float(share))
            for name, share in by_module.items()
            if isinstance(share, (int, float)) and not isinstance(share, bool)
        )
    )


def resolve_transformer_impl(requested: str | None, te_installed: bool) -> str:
    """``auto`` (the default) means Transformer Engine when it is installed, else Megatron's local
    layer spec."""
    if requested in (None, "auto"):
        return "transformer_engine" if te_installed else "local"
    return requested


def effective_settings(
    policy_cfg: dict[str, Any],
    architecture: Architecture | None,
    *,
    where: str = "policy",
    te_installed: bool,
) -> EffectiveSettings:
    """Every TransformerConfig field the recipe decides, with where it was decided."""
    megatron_cfg = policy_cfg.get("megatron_cfg") or {}
    prefix = f"{where}.megatron_cfg"
    settings: dict[str, Setting] = {}

    if architecture is not None:
        for name, value in architecture.transformer.items():
            settings[name] = Setting(value, f"{where}.model_name")

    precision = policy_cfg.get("precision")
    if precision in ("bfloat16", "float16", "float32"):
        source = f"{where}.precision"
        settings["bf16"] = Setting(precision == "bfloat16", source)
        settings["fp16"] = Setting(precision == "float16", source)
        settings["params_dtype"] = Setting(precision, source)

    ignored: list[str] = []
    if megatron_cfg.get("activation_checkpointing") is True:
        for name, value in RECOMPUTE_DEFAULTS.items():
            settings[name] = Setting(value, f"{prefix}.activation_checkpointing")
        for name in RECOMPUTE_KEYS:
            if megatron_cfg.get(name) is not None:
                settings[name] = Setting(megatron_cfg[name], f"{prefix}.{name}")
        if settings["recompute_granularity"].value == "selective":
            # How many layers and which method apply to full recompute only; Megatron rejects
            # them with selective, and NeMo-RL recipes carry them for "full".
            for name in FULL_RECOMPUTE_ONLY_KEYS:
                del settings[name]
    else:
        ignored = [name for name in RECOMPUTE_KEYS if megatron_cfg.get(name) is not None]

    overrides = megatron_cfg.get("model_overrides") or {}
    if isinstance(overrides, dict):
        for name, value in overrides.items():
            settings[name] = Setting(value, f"{prefix}.model_overrides.{name}")

    conflicts: list[tuple[str, str, str]] = []
    # Keys with their own meaning in the recipe (a switch gates the recompute keys, "auto"
    # resolves the implementation) cannot come through model_overrides at all.
    for name in (*RECOMPUTE_KEYS, "transformer_impl"):
        if isinstance(overrides, dict) and name in overrides:
            conflicts.append((name, f"{prefix}.model_overrides.{name}", f"{prefix}.{name}"))
            settings.pop(name, None)
            if name in RECOMPUTE_DEFAULTS and megatron_cfg.get("activation_checkpointing") is True:
                settings[name] = Setting(
                    megatron_cfg.get(name) or RECOMPUTE_DEFAULTS[name], f"{prefix}.{name}"
                )
    for name in DIRECT_TRANSFORMER_KEYS:
        if name not in megatron_cfg or (
            name in multi_token_prediction.MTP_KEYS and not multi_token_prediction.applies_to(where)
        ):
            continue
        value = megatron_cfg[name]
        if isinstance(overrides, dict) and name in overrides and overrides[name] != value:
            conflicts.append((name, f"{prefix}.{name}", f"{prefix}.model_overrides.{name}"))
        settings[name] = Setting(value, f"{prefix}.{name}")

    if megatron_cfg.get("fine_grained_activation_offloading") is False:
        settings["offload_modules"] = Setting([], f"{prefix}.fine_grained_activation_offloading")
    elif settings.get("offload_modules") is not None and settings["offload_modules"].value is None:
        settings["offload_modules"] = Setting([], settings["offload_modules"].source)
    # Megatron's own default, "full", is deprecated spelling for [] (whole layer).
    graph_modules = settings.get("cuda_graph_modules")
    if graph_modules is None or graph_modules.value is None:
        source = graph_modules.source if graph_modules else "nemo_rl_offload default"
        settings["cuda_graph_modules"] = Setting([], source)

    if router_replay.enabled(policy_cfg):
        # NeMo-RL's router replay (models.router_replay): Megatron's switch for it.
        settings["moe_enable_routing_replay"] = Setting(True, f"{where}.router_replay.enabled")

    unavailable: list[str] = []
    experts = settings.get("num_moe_experts")
    is_moe = has_experts(experts.value if experts else None)
    for name in () if te_installed else TE_KERNEL_FUSIONS:
        if name in settings and settings[name].value is True:
            if name != "moe_permute_fusion" or is_moe:  # a dense model has nothing to permute
                unavailable.append(settings[name].source)
            settings[name] = Setting(False, settings[name].source)
    impl_source = f"{prefix}.transformer_impl"
    settings["transformer_impl"] = Setting(
        resolve_transformer_impl(megatron_cfg.get("transformer_impl"), te_installed),
        impl_source,
    )
    return EffectiveSettings(
        settings,
        conflicts,
        ignored,
        peft.lora_settings(policy_cfg),
        unavailable,
        freezes_moe_router(policy_cfg),
        fp8.fp8_settings(policy_cfg),
        fraction_by_module(megatron_cfg),
    )


def freezes_moe_router(policy_cfg: dict[str, Any]) -> bool:
    """``megatron_cfg.freeze_moe_router`` (NeMo-RL's): the decoder's MoE routers keep their
    weights (no gradient, no optimizer state); NeMo-RL uses it to keep the sampler's and the
    trainer's routing close. Nothing to freeze on a dense model."""
    return (policy_cfg.get("megatron_cfg") or {}).get("freeze_moe_router") is True


def precision_aware_optimizer(opt_cfg: dict[str, Any], *, te_installed: bool, on_gpu: bool) -> bool:
    """Whether megatron-core's precision-aware optimizer runs for ``optimizer`` settings
    ``opt_cfg`` (NeMo-RL's ``use_precision_aware_optimizer``, true in its base recipes). It
    steps through Transformer Engine's FusedAdam, or, with ``optimizer_cpu_offload``, through
    the hybrid CPU optimizer; without either (and on CPU workers) the distributed optimizer
    runs instead. This backend's optimizer state is float32 either way (the schema has no
    lower-precision state dtypes), so the step is the same up to rounding; ``validate``
    warns (config.megatron_rules._optimizer_offload)."""
    if not (on_gpu and opt_cfg.get("use_precision_aware_optimizer") is True):
        return False
    return te_installed or opt_cfg.get("optimizer_cpu_offload") is True


def project_offload_modules(effective: EffectiveSettings) -> frozenset[str]:
    """The offload modules of this package (:data:`.module_names.MLP_OFFLOAD_MODULES`) that the
    settings turn on: the layer spec places them (``models.builder.layer_spec``)."""
    return frozenset(name for name in effective.offload_modules if name in MLP_OFFLOAD_MODULES)


def offloads_layer_input(effective: EffectiveSettings) -> bool:
    """The settings offload each full-recompute segment's input (``layer_input``, placed on
    the decoder by ``models.builder``; :mod:`.layer_input`)."""
    return LAYER_INPUT in effective.offload_modules


def project_recompute_modules(effective: EffectiveSettings) -> frozenset[str]:
    """The recompute modules of this package (:data:`.module_names.PROJECT_RECOMPUTE_MODULES`)
    that selective recompute turns on: the layer spec places them
    (``models.builder.layer_spec``)."""
    if effective.value("recompute_granularity") != "selective":
        return frozenset()
    modules = effective.value("recompute_modules")
    if not isinstance(modules, list):
        return frozenset()
    return frozenset(name for name in modules if name in PROJECT_RECOMPUTE_MODULES)
