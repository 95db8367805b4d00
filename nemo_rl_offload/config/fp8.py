"""``megatron_cfg.fp8_cfg``: FP8 training with NeMo-RL's keys and Transformer Engine's meaning,
as settings (:class:`Fp8Settings`) and the rules that refuse what this backend does not run.
``models.fp8_linear`` applies them; validate and a run both go through :func:`problems`.
What each key means here: docs/fp8.md. No torch here.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_rl_offload.config import peft, quantization

FORMATS = ("e4m3", "hybrid")
RECIPES = ("blockwise", "tensorwise")
# Transformer Engine's switch from power-of-two to float32 block scales (NeMo-RL's FP8 recipes
# set it in megatron_cfg.env_vars).
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
# NeMo-RL's other fp8_recipe values, and why this backend does not run them.
_NOT_RUN = {
    "delayed": "delayed scaling (scales from an amax history) is not implemented by this "
    "backend; use tensorwise (scales from the tensor itself) or blockwise",
    "mxfp8": "MXFP8 products need Blackwell GPUs (SM 10.x); use blockwise, which Hopper runs",
}


@dataclass(frozen=True)
class Fp8Settings:
    """What ``fp8_cfg`` asks for, checked (:func:`problems`)."""

    recipe: str
    hybrid: bool
    power_of_2_scales: bool


def _section(policy_cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    megatron_cfg = policy_cfg.get("megatron_cfg") or {}
    section = megatron_cfg.get("fp8_cfg") if isinstance(megatron_cfg, Mapping) else None
    if not isinstance(section, Mapping) or section.get("enabled") is not True:
        return None
    return section


def fp8_settings(policy_cfg: Mapping[str, Any]) -> Fp8Settings | None:
    """The section's settings (None: FP8 is off, or its keys are refused by :func:`problems`)."""
    section = _section(policy_cfg)
    if section is None or section.get("fp8") not in FORMATS:
        return None
    if section.get("fp8_recipe") not in RECIPES:
        return None
    env_vars = (policy_cfg.get("megatron_cfg") or {}).get("env_vars") or {}
    fp32_scales = str(env_vars.get(FP32_SCALES_ENV, os.environ.get(FP32_SCALES_ENV, "0")))
    return Fp8Settings(
        recipe=section["fp8_recipe"],
        hybrid=section["fp8"] == "hybrid",
        power_of_2_scales=fp32_scales != "1",
    )


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1)
    did_you_mean = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key}: {value!r} is not one of {', '.join(choices)}{did_you_mean}"


def problems(
    policy_cfg: Mapping[str, Any], where: str, *, transformer_impl: Any
) -> tuple[list[str], list[str]]:
    """(errors, warnings), one line each, for ``{where}.megatron_cfg.fp8_cfg``, with the
    section's LoRA and ModelOpt keys it cannot run beside. Validate and a worker started
    without it (``policy.policy_worker``) both ask."""
    section = _section(policy_cfg)
    if section is None:
        return [], []
    key = f"{where}.megatron_cfg.fp8_cfg"
    errors: list[str] = []
    warnings: list[str] = []
    fmt, recipe = section.get("fp8"), section.get("fp8_recipe")
    if fmt is None:
        errors.append(f"{key}.fp8: missing; set it to e4m3 (or hybrid: e5m2 gradients)")
    elif fmt not in FORMATS:
        errors.append(_choice(f"{key}.fp8", fmt, FORMATS))
    if recipe is None:
        errors.append(f"{key}.fp8_recipe: missing; set it to blockwise or tensorwise")
    elif recipe in _NOT_RUN:
        errors.append(f"{key}.fp8_recipe: {recipe!r}: {_NOT_RUN[recipe]}")
    elif recipe not in RECIPES:
        errors.append(_choice(f"{key}.fp8_recipe", recipe, RECIPES))
    if fmt == "hybrid" and recipe == "blockwise":
        errors.append(
            f"{key}.fp8: 'hybrid' with blockwise scaling: torch's block-scaled FP8 products "
            "take e4m3 operands only; set fp8 to e4m3, or fp8_recipe to tensorwise"
        )
    if section.get("fp8_param") is True:
        errors.append(
            f"{key}.fp8_param: true (FP8 master weights) is not implemented by this backend; "
            "set it to false (weights stay in the training dtype, products run in FP8)"
        )
    if peft.lora_settings(policy_cfg) is not None:
        errors.append(
            f"{key}.enabled: FP8 linears with LoRA adapters are not implemented yet; turn one "
            f"of them off ({where}.megatron_cfg.peft.enabled or this)"
        )
    if quantization.policy_config(policy_cfg) is not None:
        errors.append(
            f"{key}.enabled: FP8 training with ModelOpt quantization-aware training "
            f"({where}.quant_cfg) is not implemented; use one of them"
        )
    if transformer_impl == "transformer_engine" and not errors:
        warnings.append(
            f"{key}: with transformer_impl transformer_engine, FP8 runs in Transformer Engine's "
            "layers as in NeMo-RL (this package's FP8 linears are the local spec's)"
        )
    return errors, warnings
