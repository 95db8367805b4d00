"""Build the policy's Megatron-core GPTModel from the effective settings.

TransformerConfig's arguments come only from
:func:`config.transformer_config_kwargs` (so what the offload rules checked is
what runs); this module adds just what the chosen layer
spec and device need when the recipe left it unset, and reports every setting it could not
honour as a warning line instead of dropping it silently.

Must run after :func:`models.parallel.initialize_megatron_parallel` (pre/post-process flags and
head partitioning come from Megatron's parallel state).
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt.gpt_model import GPTModel

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.fp8 import Fp8Settings
from nemo_rl_offload.config.megatron_settings import EffectiveSettings
from nemo_rl_offload.config.model_presets import Architecture
from nemo_rl_offload.config.peft import LoraSettings
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models.transformer_config import (
    make_transformer_config,
    transformer_config_kwargs,
)

FGO_FIELD = "fine_grained_activation_offloading"
# Fusions that need Apex or Transformer Engine kernels the local spec does not have. Megatron
# 0.19 defaults them to False; stating it keeps a future default change from breaking us.
LOCAL_SPEC_DEFAULTS: dict[str, Any] = {
    "gradient_accumulation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
}


def _megatron_cfg_path(effective: EffectiveSettings, field: str) -> str:
    """The recipe path a setting came from (``policy.megatron_cfg.<field>`` when unset)."""
    impl_source = effective.source("transformer_impl", "policy.megatron_cfg.transformer_impl")
    prefix = impl_source.rsplit(".", 1)[0]
    return effective.source(field, f"{prefix}.{field}")


def transformer_config_for(
    effective: EffectiveSettings, *, on_gpu: bool
) -> tuple[dict[str, Any], list[str]]:
    """TransformerConfig keyword arguments for this device, and the warnings to report."""
    warnings: list[str] = []
    kwargs = transformer_config_kwargs(effective)
    impl = kwargs.get("transformer_impl", "local")

    if kwargs.get(FGO_FIELD):
        if on_gpu:
            from nemo_rl_offload.models.te_compat import ensure_offload_flag_module

            ensure_offload_flag_module()
        else:
            kwargs[FGO_FIELD] = False
            kwargs["offload_modules"] = []
            warnings.append(
                f"{_megatron_cfg_path(effective, FGO_FIELD)}: offloading is GPU-only; "
                "not applied on CPU workers"
            )

    if impl != "local" and effective.fp8 is not None:
        # Transformer Engine's own FP8, as NeMo-RL sets it (the local spec's is this package's).
        kwargs["fp8"] = "hybrid" if effective.fp8.hybrid else "e4m3"
        kwargs["fp8_recipe"] = effective.fp8.recipe
    if impl == "local":
        for name, value in LOCAL_SPEC_DEFAULTS.items():
            kwargs.setdefault(name, value)
    elif not on_gpu:
        raise UserInputError(
            f"{_megatron_cfg_path(effective, 'transformer_impl')}: '{impl}' needs a GPU; "
            "CPU workers run the local layer spec (set transformer_impl: local)"
        )

    if not on_gpu:
        if kwargs.get("use_cpu_initialization") is False:
            warnings.append(
                f"{_megatron_cfg_path(effective, 'use_cpu_initialization')}: false is ignored on "
                "CPU workers (weights can only be initialised on the CPU there)"
            )
        kwargs["use_cpu_initialization"] = True

    # policy.train_step normalises the loss per token over the whole step (Megatron's
    # per-token mode: sum per micro-batch, divide the gradients by the step's token count).
    kwargs.setdefault("calculate_per_token_loss", True)
    if kwargs["calculate_per_token_loss"] is not True:
        raise UserInputError(
            f"{_megatron_cfg_path(effective, 'calculate_per_token_loss')}: must be true; the "
            "training step normalises the loss per token over the whole step"
        )
    return kwargs, warnings


def layer_spec(
    config: Any,
    mlp_offload_modules: frozenset[str] = frozenset(),
    recompute_modules: frozenset[str] = frozenset(),
    lora: LoraSettings | None = None,
    fp8: Fp8Settings | None = None,
) -> Any:
    """The transformer layer spec for ``config.transformer_impl`` (for the local spec, this
    pipeline stage's block spec where its final norm had to be replaced: see
    :func:`_with_local_norms`), with the dense MLP's offload points ``mlp_offload_modules``
    (:mod:`models.mlp_offload`; the rules allow them on the local spec's dense MLP only), and
    on the local spec the selective recompute that runs there through this package
    (:mod:`models.local_recompute`: ``layernorm`` from ``config``, and this package's
    ``recompute_modules``, which TransformerConfig does not hold), the LoRA adapters
    ``lora`` (:mod:`models.lora`; dense local spec only, as validate checks first), and on the
    local spec the FP8 linears of ``fp8`` (:mod:`models.fp8_linear`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if mlp_offload_modules and (config.transformer_impl != "local" or config.num_moe_experts):
        raise UserInputError(
            f"policy.megatron_cfg.offload_modules: {sorted(mlp_offload_modules)} offload the "
            "dense MLP of the local layer spec; remove them (the offload rules say why)"
        )
    if recompute_modules and (config.transformer_impl != "local" or config.num_moe_experts):
        raise UserInputError(
            f"policy.megatron_cfg.recompute_modules: {sorted(recompute_modules)} recompute the "
            "dense MLP of the local layer spec; remove them (the offload rules say why)"
        )
    if lora is not None and (config.transformer_impl != "local" or config.num_moe_experts):
        raise UserInputError(
            "policy.megatron_cfg.peft.enabled: adapters sit on the dense local layer spec; "
            "set transformer_impl to local (models with experts are not supported yet)"
        )
    if config.transformer_impl == "transformer_engine":
        return _with_replay_router(
            gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=config.num_moe_experts,
                moe_grouped_gemm=config.moe_grouped_gemm,
                qk_layernorm=config.qk_layernorm,
            ),
            config,
        )
    if config.transformer_impl != "local":
        raise UserInputError(
            f"policy.megatron_cfg.transformer_impl: '{config.transformer_impl}' is not supported "
            "for training; use local or transformer_engine"
        )
    from megatron.core.transformer.attention import SelfAttention

    from nemo_rl_offload.models.attention import SDPACoreAttention
    from nemo_rl_offload.models.self_attention import CompactKVSelfAttention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if spec.submodules.self_attention.module is SelfAttention:
        spec.submodules.self_attention.module = CompactKVSelfAttention
    if lora is not None:
        from nemo_rl_offload.models.lora import with_lora

        spec = with_lora(spec, lora)
    from nemo_rl_offload.models.local_recompute import recomputes_norms, with_local_recompute

    if recompute_modules or recomputes_norms(config):
        spec = with_local_recompute(spec, config, recompute_modules, mlp_offload_modules)
    elif mlp_offload_modules:
        from nemo_rl_offload.models.mlp_offload import offloading_mlp_builder

        spec.submodules.mlp = offloading_mlp_builder(spec.submodules.mlp, mlp_offload_modules)
    if config.num_moe_experts:
        from nemo_rl_offload.models.moe_decode import with_dense_decode

        spec.submodules.mlp = with_dense_decode(spec.submodules.mlp)
    if config.num_moe_experts and config.moe_grouped_gemm:
        # Grouped experts without TE: TEGroupedMLP (where expert_fc1/moe_act are offloaded)
        # over pure-PyTorch grouped linears; the local spec would build SequentialMLP.
        from nemo_rl_offload.models.grouped_linear import with_local_grouped_experts

        spec.submodules.mlp = with_local_grouped_experts(spec.submodules.mlp)
    spec = _with_local_norms(_with_replay_router(spec, config), config)
    if fp8 is not None:
        from nemo_rl_offload.models import fp8_linear

        selective = config.recompute_granularity == "selective"
        megatron_recompute = config.recompute_modules if selective else None
        recomputed = recompute_modules | frozenset(megatron_recompute or [])
        spec = fp8_linear.with_fp8_linears(
            spec,
            fp8_linear.recipe_for(fp8),
            fp8_linear.linears_keeping_original_inputs(recomputed),
        )
    return spec


def _with_replay_router(spec: Any, config: Any) -> Any:
    """``spec`` with the routers of ``models.router_replay`` when the recipe replays routes
    (``policy.router_replay``; Megatron's ``moe_enable_routing_replay``) on a model with
    experts."""
    if not (config.moe_enable_routing_replay and config.num_moe_experts):
        return spec
    from nemo_rl_offload.models import router_replay

    router_replay.check_megatron()
    spec.submodules.mlp = router_replay.with_replay_router(spec.submodules.mlp)
    return spec


def _with_local_norms(spec: Any, config: Any) -> Any:
    """``spec`` with :class:`models.norms.LocalNorm` wherever megatron-core would build its
    ``WrappedTorchNorm``, which refuses sequence parallelism: the layer's input and pre-MLP
    norms, the q/k norms, and the decoder's final norm. The final norm is not part of a layer
    spec (TransformerBlock picks it from what is installed), so when Megatron would pick
    ``WrappedTorchNorm`` for it the spec becomes this stage's TransformerBlockSubmodules with
    LocalNorm as its norm. Where Apex or Transformer Engine is installed Megatron picks their
    norms, which support sequence parallelism already, and those are left as they are."""
    from megatron.core import parallel_state
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from nemo_rl_offload.models.norms import LocalNorm

    layer = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(layer, name) is WrappedTorchNorm:
            setattr(layer, name, LocalNorm)
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if getattr(attention, name, None) is WrappedTorchNorm:
            setattr(attention, name, LocalNorm)
    if transformer_block.LayerNormImpl is not WrappedTorchNorm:
        return spec
    layers = transformer_block.get_num_layers_to_build(
        config, pp_rank=parallel_state.get_pipeline_model_parallel_rank()
    )
    return transformer_block.TransformerBlockSubmodules(
        layer_specs=[spec] * layers, layer_norm=LocalNorm
    )


def mtp_block_spec(config: Any, spec: Any) -> Any:
    """The multi-token prediction block of ``config.mtp_num_layers`` layers (Megatron's MTP
    block spec for this stage, None where the stage has none): each MTP layer's transformer
    layer is the decoder's (``spec``, with this package's offload points, recompute and LoRA),
    its norms this package's :class:`models.norms.LocalNorm` where Megatron's local backend
    would build ``WrappedTorchNorm`` (which refuses sequence parallelism), as in the decoder."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from nemo_rl_offload.models.norms import LocalNorm

    block = get_gpt_mtp_block_spec(
        config, spec, use_transformer_engine=config.transformer_impl == "transformer_engine"
    )
    for layer in block.layer_specs if block is not None else []:
        for name in ("enorm", "hnorm", "layer_norm"):
            if getattr(layer.submodules, name) is WrappedTorchNorm:
                setattr(layer.submodules, name, LocalNorm)
    return block


def build_gpt_model(
    effective: EffectiveSettings, architecture: Architecture, *, on_gpu: bool
) -> tuple[GPTModel, list[str]]:
    """The policy's GPTModel for this pipeline stage, and warnings for the settings not applied.

    On GPU the model is moved to the current CUDA device; mixed-precision and data-parallel
    wrapping (Float16Module, DDP) belong to the caller.
    """
    import torch

    kwargs, warnings = transformer_config_for(effective, on_gpu=on_gpu)
    # This package's offload points go with the flag (off on CPU workers).
    mlp_modules = (
        megatron_settings.project_offload_modules(effective)
        if kwargs.get(FGO_FIELD)
        else frozenset()
    )
    config = make_transformer_config(kwargs, mlp_modules)
    model = gpt_model_for(
        config,
        architecture,
        mlp_modules,
        megatron_settings.project_recompute_modules(effective),
        effective.lora,
        effective.fp8,
    )
    if effective.lora is not None:
        from nemo_rl_offload.models.lora import prepare

        prepare(model)
    if effective.freeze_moe_router:
        freeze_decoder_routers(model)
    if megatron_settings.offloads_layer_input(effective):
        if on_gpu:
            from nemo_rl_offload.models.layer_input_block import offload_layer_inputs

            offload_layer_inputs(model)
        else:
            warnings.append(
                f"{_megatron_cfg_path(effective, 'offload_modules')}: layer_input offloading is "
                "GPU-only; not applied on CPU workers"
            )
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    return model, warnings


def freeze_decoder_routers(model: GPTModel) -> None:
    """``freeze_moe_router``: the decoder layers' MoE router weights take no gradient (before
    any data-parallel wrapper, so they get no gradient buffer or optimizer state either);
    their expert biases, where the model has them, follow their own update rate as in
    NeMo-RL."""
    from megatron.core.transformer.moe.router import TopKRouter

    for layer in model.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if isinstance(router, TopKRouter):
            router.weight.requires_grad_(False)


def gpt_model_for(
    config: Any,
    architecture: Architecture,
    mlp_offload_modules: frozenset[str] = frozenset(),
    recompute_modules: frozenset[str] = frozenset(),
    lora: LoraSettings | None = None,
    fp8: Fp8Settings | None = None,
) -> GPTModel:
    """The GPTModel of ``config`` for this pipeline stage, on the CPU, with the dense MLP's
    offload points ``mlp_offload_modules``, this package's ``recompute_modules``, the LoRA
    adapters ``lora`` (initialised by ``models.lora.prepare``, which freezes the rest) and the
    FP8 linears of ``fp8``."""
    from megatron.core import parallel_state

    spec = layer_spec(config, mlp_offload_modules, recompute_modules, lora, fp8)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp_block_spec(config, spec) if config.mtp_num_layers else None,
        vocab_size=architecture.vocab_size,
        max_sequence_length=architecture.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=architecture.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=architecture.rotary_base,
    )
