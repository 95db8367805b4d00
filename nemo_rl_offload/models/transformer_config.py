"""Megatron-core's TransformerConfig from the effective settings: the one place the resolved
settings become Megatron's arguments (so what the rules checked is what runs)."""

from __future__ import annotations

from typing import Any

from nemo_rl_offload.config.megatron_settings import EffectiveSettings, project_offload_modules
from nemo_rl_offload.config.module_names import (
    LAYER_INPUT,
    MLP_OFFLOAD_MODULES,
    PROJECT_RECOMPUTE_MODULES,
)

_DTYPE_FIELDS = ("params_dtype", "pipeline_dtype")
# Architecture entries that are not TransformerConfig fields.
_NOT_TRANSFORMER_FIELDS = ("activation",)


def transformer_config_kwargs(effective: EffectiveSettings) -> dict[str, Any]:
    """Keyword arguments for TransformerConfig: plain values, dtype names turned into torch
    dtypes and the activation name into its function."""
    import torch
    import torch.nn.functional as F

    kwargs = {
        name: setting.value
        for name, setting in effective.settings.items()
        if name not in _NOT_TRANSFORMER_FIELDS
    }
    for name in _DTYPE_FIELDS:
        if isinstance(kwargs.get(name), str):
            kwargs[name] = getattr(torch, kwargs[name])
    activation = effective.value("activation")
    if activation is not None:
        kwargs["activation_func"] = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[activation]
    modules = kwargs.get("offload_modules")
    if isinstance(modules, list):
        # This package's own module names reach the layer spec (project_offload_modules) or the
        # decoder (offloads_layer_input), not TransformerConfig, which refuses names it does
        # not know.
        kwargs["offload_modules"] = [
            name for name in modules if name not in MLP_OFFLOAD_MODULES and name != LAYER_INPUT
        ]
        if (
            LAYER_INPUT in modules
            and not kwargs["offload_modules"]
            and not (set(modules) & MLP_OFFLOAD_MODULES)
        ):
            # layer_input alone runs outside Megatron's offload manager (offload.layer_input):
            # Megatron's flag would open offload chunks that nothing uses.
            kwargs["fine_grained_activation_offloading"] = False
    recompute = kwargs.get("recompute_modules")
    if isinstance(recompute, list):
        # Likewise for this package's recompute names (project_recompute_modules).
        kwargs["recompute_modules"] = [
            name for name in recompute if name not in PROJECT_RECOMPUTE_MODULES
        ]
    if not kwargs.get("mtp_num_layers"):
        # NeMo-RL writes 0 for "no MTP"; Megatron's off is None (its schedules set an MTP loss
        # scale whenever the field is not None).
        kwargs["mtp_num_layers"] = None
    if kwargs.get("sequence_parallel") and (kwargs.get("tensor_model_parallel_size") or 1) == 1:
        # Megatron's config refuses sequence parallelism without tensor parallelism; with one
        # tensor-parallel rank it would split nothing, so it is off (validate warns).
        kwargs["sequence_parallel"] = False
    return kwargs


def make_transformer_config(
    kwargs: dict[str, Any], project_modules: frozenset[str] = frozenset()
) -> Any:
    """TransformerConfig(**kwargs), where offloading may be on with none of Megatron's own
    modules listed, only this package's ``project_modules`` (:func:`project_offload_modules`):
    Megatron asserts a non-empty list whenever its flag is on, so the config is made with the
    flag off and the flag set afterwards. The flag is what makes the model open an offload chunk
    per micro-batch and the schedules reset the manager; the checks Megatron skips that way are
    the rules' (offload.rules), made on the recipe."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if (
        project_modules
        and kwargs.get("fine_grained_activation_offloading")
        and not kwargs.get("offload_modules")
    ):
        config = TransformerConfig(**{**kwargs, "fine_grained_activation_offloading": False})
        config.fine_grained_activation_offloading = True
        return config
    return TransformerConfig(**kwargs)


def build_transformer_config(effective: EffectiveSettings) -> Any:
    """Megatron-core's TransformerConfig for these settings (imports megatron-core)."""
    return make_transformer_config(
        transformer_config_kwargs(effective), project_offload_modules(effective)
    )
