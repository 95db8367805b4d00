"""Quantization-aware training with NVIDIA ModelOpt (``policy.quant_cfg``; the rules are
``config.quantization``'s).

ModelOpt's megatron-core plugin turns the local spec's ColumnParallelLinear and
RowParallelLinear into quantized linears: each weight (and, by the config, each input) passes
through a fake quantizer, which rounds it to the format's values in the forward and lets the
gradient through unchanged in the backward. The master weights stay in the training dtype, so
the optimizer and checkpoints are unchanged; the quantizers' state (their calibrated ranges)
is part of the model's state dict.

On CPU workers ModelOpt has no NVFP4 kernel (its triton and CUDA kernels need a GPU):
:func:`install_cpu_nvfp4` gives its ``tensorrt::dynamic_block_quantize_op`` a CPU kernel of
the same arithmetic, through torch's operator registry, the seam ModelOpt registers that op
with. GPU workers run ModelOpt's own kernels.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_rl_offload.config.quantization import is_config_name, locate, read_recipe_file
from nemo_rl_offload.errors import UserInputError

_KEY = "policy.quant_cfg"
_OP = "tensorrt::dynamic_block_quantize_op"
# NVFP4: E2M1 values (num_bits 4, exponent_bits 2) with E4M3 block scales (8, 4), the
# arguments ModelOpt's dynamic block quantizer passes to _OP.
_NVFP4_ARGS = (4, 2, 8, 4)
_E2M1_MAX, _E4M3_MAX = 6.0, 448.0
# The registration of the CPU kernel, kept for the process (install_cpu_nvfp4).
_cpu_library: torch.library.Library | None = None


def resolve(value: str, dirs: Sequence[Path]) -> dict[str, Any]:
    """The ``mtq.quantize`` config ``value`` names: a constant of
    ``modelopt.torch.quantization`` or a YAML recipe file (``config.quantization``)."""
    if is_config_name(value):
        import modelopt
        import modelopt.torch.quantization as mtq

        known = config_names()
        if value not in known:
            raise UserInputError(
                f"{_KEY}: {value!r} is not a quantization config of ModelOpt "
                f"{modelopt.__version__}; its configs: {', '.join(sorted(known))}"
            )
        return {"algorithm": "max", **copy.deepcopy(getattr(mtq, value))}
    path = locate(value, dirs)
    if path is None:  # validate reports it; a run started without validate gets it here
        raise UserInputError(f"{_KEY}: no file {value!r}; give the file's absolute path")
    try:
        read_recipe_file(path)  # the shape validate checks
    except (ValueError, OSError) as err:
        raise UserInputError(
            f"{_KEY}: {path} is not a ModelOpt quantization recipe: {err}"
        ) from err
    # ModelOpt's own reader turns the file's format names (e2m1, e4m3) into its bit tuples.
    from modelopt.recipe import load_config

    document = load_config(str(path))
    return {"algorithm": "max", **document.get("quantize", document)}


def config_names() -> set[str]:
    """The quantization configs ``modelopt.torch.quantization`` defines (validate checks a
    recipe's ``quant_cfg`` name against them)."""
    import modelopt.torch.quantization as mtq

    return {
        name
        for name in dir(mtq)
        if name.endswith("_CFG")
        and isinstance(getattr(mtq, name), dict)
        and "quant_cfg" in getattr(mtq, name)
    }


def _check_megatron_plugin() -> None:
    """ModelOpt registers megatron-core's linears from a plugin it imports quietly (a failed
    import only leaves them out): without the registration nothing would be quantized."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from modelopt.torch.quantization.nn import QuantModuleRegistry

    missing = [
        cls.__name__
        for cls in (ColumnParallelLinear, RowParallelLinear)
        if QuantModuleRegistry.get(cls) is None
    ]
    if missing:
        raise RuntimeError(
            f"ModelOpt's megatron-core plugin did not register {', '.join(missing)} "
            "(modelopt.torch.quantization.plugins.megatron failed to import)"
        )


def nvfp4_fake_quant(x: torch.Tensor, global_amax: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` rounded to NVFP4: blocks of ``block_size`` along the last dimension, each with an
    E4M3 scale of its largest magnitude over the E2M1 maximum (6), the scales themselves
    relative to a global scale ``global_amax / (6 * 448)``; E2M1 values (0, 0.5, 1, 1.5, 2, 3,
    4, 6) rounded to nearest with ties to even (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4)."""
    shape, dtype = x.shape, x.dtype
    n = shape[-1]
    pad = (-n) % block_size
    flat = x.float().reshape(-1, n)
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.reshape(flat.shape[0], -1, block_size)
    global_scale = global_amax.float().amax().to(x.device) / (_E2M1_MAX * _E4M3_MAX)
    global_scale = torch.where(global_scale > 0, global_scale, torch.full_like(global_scale, 1e-12))
    block_max = blocks.abs().amax(-1, keepdim=True)
    scale = torch.clamp(block_max / (_E2M1_MAX * global_scale), max=_E4M3_MAX)
    scale = scale.to(torch.float8_e4m3fn).float() * global_scale
    scale = torch.where(scale >= 1e-5, scale, torch.ones_like(scale))
    magnitude = _round_e2m1(blocks.abs() / scale) * scale
    out = torch.where(blocks >= 0, magnitude, -magnitude).reshape(flat.shape)[:, :n]
    return out.reshape(shape).to(dtype)


def _round_e2m1(a: torch.Tensor) -> torch.Tensor:
    """Non-negative ``a`` to the nearest E2M1 value, ties to the even mantissa."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=a.dtype)
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=a.dtype)
    index = torch.bucketize(a, bounds, right=False)
    # A value on 0.75, 1.75 or 3.5 rounds up (to 1, 2, 4: the even neighbour).
    index = index + (a == bounds[1]) + (a == bounds[3]) + (a == bounds[5])
    return values[index.clamp(max=7)]


def install_cpu_nvfp4() -> None:
    """Give ModelOpt's dynamic block quantizer op a CPU kernel for NVFP4 (module docstring);
    every other format keeps ModelOpt's own CPU kernel. Idempotent."""
    global _cpu_library
    if _cpu_library is not None:
        return
    from modelopt.torch.quantization import tensor_quant

    original = getattr(tensor_quant, "_dynamic_block_quantize_impl", None)
    if original is None or not hasattr(torch.ops.tensorrt, "dynamic_block_quantize_op"):
        raise RuntimeError(
            "ModelOpt's dynamic block quantization op is not where this package expects it "
            f"({_OP} with tensor_quant._dynamic_block_quantize_impl); a ModelOpt other than "
            "0.47 is installed"
        )

    def cpu_kernel(
        inputs: torch.Tensor,
        block_size: int,
        amax: torch.Tensor,
        num_bits: int,
        exponent_bits: int,
        scale_num_bits: int,
        scale_exponent_bits: int,
    ) -> torch.Tensor:
        if (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == _NVFP4_ARGS:
            return nvfp4_fake_quant(inputs, amax, block_size)
        return original(
            inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits
        )

    # ModelOpt registered one kernel for both devices; this replaces its CPU one only. The
    # registration lives as long as its Library.
    import warnings

    library = torch.library.Library(_OP.split("::")[0], "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes that a kernel is overridden
        library.impl(_OP.split("::")[1], cpu_kernel, "CPU", allow_override=True)
    _cpu_library = library


def enabled_quantizers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's quantizers that act, by name."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, TensorQuantizer) and module.is_enabled
    }


def quantize(
    model: torch.nn.Module,
    config: dict[str, Any],
    calibration: Sequence[torch.Tensor],
    *,
    on_gpu: bool,
    pipeline_or_context_parallel: bool,
) -> dict[str, int]:
    """Insert ModelOpt's quantizers into ``model`` (the unwrapped GPTModel, its weights final)
    and calibrate the ranges the config does not compute per call on ``calibration`` (token
    id batches, [batch, positions]). Returns counts for the run's log. Before a checkpoint of
    a quantized model loads, calibrating on anything makes the range buffers it restores.

    A quantized model's checkpoint entries differ from a plain one's (ModelOpt's layout:
    one entry per layer, fc1's halves apart, the quantizers' state): only a model quantized
    the same way reads it."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.config import need_calibration

    _check_megatron_plugin()
    if not on_gpu:
        from nemo_rl_offload.models.cpu_compat import enable_cpu_modelopt

        install_cpu_nvfp4()
        enable_cpu_modelopt()
    forward_loop = None
    if need_calibration(config):
        if not calibration:
            raise UserInputError(
                f"{_KEY}: this config calibrates activation ranges; set policy.quant_calib_size "
                "to how many training examples to calibrate on"
            )
        if pipeline_or_context_parallel:
            raise UserInputError(
                f"{_KEY}: calibrating activation ranges over pipeline stages or "
                "context-parallel ranks is not implemented yet by this backend; choose a "
                "config without static activation quantizers (e.g. a weight-only one), or "
                "pipeline and context parallel size 1"
            )

        def forward_loop(m: torch.nn.Module) -> None:
            with torch.no_grad():
                for ids in calibration:
                    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
                    m(ids, positions, None)

    try:
        mtq.quantize(model, config, forward_loop)
    except RuntimeError as err:
        if "quantizer" not in str(err):
            raise
        raise UserInputError(f"{_KEY}: ModelOpt cannot apply it to this model: {err}") from err
    enabled = enabled_quantizers(model)
    if not enabled:
        raise UserInputError(
            f"{_KEY}: the config enables no quantizer of this model's layers (its patterns "
            "match none of them); choose a config for this architecture"
        )
    calibrated = len(calibration) if forward_loop is not None else 0
    return {"quantizers": len(enabled), "calibration_batches": calibrated}


@contextlib.contextmanager
def quantizers_off(model: torch.nn.Module) -> Iterator[None]:
    """The model without its quantizers for the duration (rollouts of a quantization-aware
    policy whose ``generation.quant_cfg`` is null, as NeMo-RL samples them unquantized)."""
    acting = list(enabled_quantizers(model).values())
    for module in acting:
        module.disable()
    try:
        yield
    finally:
        for module in acting:
            module.enable()
