"""The transformer layers' linears in FP8 without Transformer Engine (``fp8_cfg``; the rules
are :mod:`config.fp8`, the arithmetic :mod:`models.fp8_math`).

The linears that Transformer Engine's FP8 runs in a Megatron GPT layer make their three products
in FP8 here, through subclasses of Megatron's parallel linears that :func:`with_fp8_linears`
puts in a layer spec. What runs in FP8, and the seams: docs/fp8.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from nemo_rl_offload.config.fp8 import Fp8Settings
from nemo_rl_offload.models.fp8_math import BLOCK, Fp8Recipe, Quantized, matmul_nt, quantize
from nemo_rl_offload.models.grouped_linear import (
    LocalColumnParallelGroupedLinear,
    LocalRowParallelGroupedLinear,
)

_FORWARD_DTYPE = torch.float8_e4m3fn
# Per-tensor products need a contraction that is a multiple of 16 (fp8_math's kernels).
_TENSORWISE_MULTIPLE = 16


def recipe_for(settings: Fp8Settings) -> Fp8Recipe:
    """The arithmetic of checked ``fp8_cfg`` settings."""
    return Fp8Recipe(
        recipe=settings.recipe,  # type: ignore[arg-type]  # config.fp8 allows only RECIPES
        grad_dtype=torch.float8_e5m2 if settings.hybrid else _FORWARD_DTYPE,
        power_of_2_scales=settings.power_of_2_scales,
    )


def _contraction_multiple(recipe: Fp8Recipe) -> int:
    return BLOCK if recipe.recipe == "blockwise" else _TENSORWISE_MULTIPLE


def _weight(weight: torch.Tensor, recipe: Fp8Recipe) -> Quantized:
    return quantize(
        weight.detach(),
        recipe.weight_layout,
        _FORWARD_DTYPE,
        power_of_2=recipe.power_of_2_scales,
    )


# What a linear keeps for its weight gradient: nothing (no gradient wanted), its input quantized
# along the tokens (FP8 bytes), or its original input (the tensor it was given, sharing its
# storage: Megatron's ``save_original_input``, for inputs another module keeps or recomputes).
Keep = Literal["nothing", "quantized", "original"]


def keep_mode(weight: torch.Tensor, save_original_input: bool) -> Keep:
    """What this call keeps (see :data:`Keep`)."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return "nothing"
    return "original" if save_original_input else "quantized"


def _input_for_wgrad(x: torch.Tensor, recipe: Fp8Recipe) -> Quantized:
    """``x`` quantized along the tokens (the weight gradient's contraction)."""
    return quantize(
        x.t(),
        recipe.activation_layout,
        _FORWARD_DTYPE,
        power_of_2=recipe.power_of_2_scales,
        contraction_multiple=_contraction_multiple(recipe),
    )


def forward_product(
    x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, keep: Keep
) -> tuple[torch.Tensor, Quantized | torch.Tensor | None]:
    """``x @ weight.T`` in FP8 (``x`` is ``[tokens, in]``), and what ``keep`` says to keep for
    the weight gradient."""
    x_q = quantize(x, recipe.activation_layout, _FORWARD_DTYPE, power_of_2=recipe.power_of_2_scales)
    out = matmul_nt(x_q, _weight(weight, recipe), x.dtype)
    if keep == "nothing":
        return out, None
    return out, x if keep == "original" else _input_for_wgrad(x, recipe)


def backward_products(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    kept: Quantized | torch.Tensor | None,
    recipe: Fp8Recipe,
    *,
    input_dtype: torch.dtype,
    needs_input_grad: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input gradient ``dy @ weight`` and the weight gradient ``dy.T @ x`` in FP8, the
    gradient quantized in ``recipe.grad_dtype`` (1x128 blocks along each product's
    contraction); the weight gradient only when the forward kept its input (``kept``: the
    input quantized along the tokens, or the original input, quantized here)."""
    dx = dw = None
    if needs_input_grad:
        dy_q = quantize(
            grad_output,
            recipe.activation_layout,
            recipe.grad_dtype,
            power_of_2=recipe.power_of_2_scales,
        )
        dx = matmul_nt(dy_q, _weight(weight, recipe).transposed(), input_dtype)
    if kept is not None:
        x_t = kept if isinstance(kept, Quantized) else _input_for_wgrad(kept, recipe)
        dy_t = quantize(
            grad_output.t(),
            recipe.activation_layout,
            recipe.grad_dtype,
            power_of_2=recipe.power_of_2_scales,
            contraction_multiple=_contraction_multiple(recipe),
        )
        dw = matmul_nt(dy_t, x_t, weight.dtype)
    return dx, dw


def _save(ctx: Any, kept: Quantized | torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors to save for ``kept`` (noting its kind on ``ctx``)."""
    if isinstance(kept, Quantized):
        ctx.kept_layouts.append(kept.layout)
        return [kept.data, kept.scale_inv]
    ctx.kept_layouts.append(None if kept is None else "original")
    return [] if kept is None else [kept]


def _restore(ctx: Any, saved: Any) -> list[Quantized | torch.Tensor | None]:
    """What :func:`_save` saved, in order, from the iterator ``saved``."""
    kept: list[Quantized | torch.Tensor | None] = []
    for layout in ctx.kept_layouts:
        if layout is None:
            kept.append(None)
        elif layout == "original":
            kept.append(next(saved))
        else:
            kept.append(Quantized(next(saved), next(saved), layout))
    return kept


class _Fp8LinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with FP8 products; saves the weight Parameter (which the offload hooks
    skip) and what ``keep`` says: the input in FP8 along the tokens, or the input itself."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, keep: Keep
    ) -> torch.Tensor:
        out, kept = forward_product(x, weight, recipe, keep)
        ctx.recipe, ctx.input_dtype, ctx.kept_layouts = recipe, x.dtype, []
        ctx.save_for_backward(weight, *_save(ctx, kept))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, *rest = ctx.saved_tensors
        (kept,) = _restore(ctx, iter(rest))
        dx, dw = backward_products(
            grad_output.contiguous(),
            weight,
            kept,
            ctx.recipe,
            input_dtype=ctx.input_dtype,
            needs_input_grad=ctx.needs_input_grad[0],
        )
        return dx, dw, None, None


def fp8_linear(
    recipe: Fp8Recipe,
    save_original_input: bool,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    gtp_remat_size: int = 1,
) -> torch.Tensor:
    """What ``linear_with_grad_accumulation_and_async_allreduce`` does, with FP8 products: the
    sequence-parallel all-gather (its backward a reduce-scatter) or the input-gradient
    all-reduce through Megatron's own mappings, then the product and the bias.
    ``save_original_input``: keep the input itself for the weight gradient (see :data:`Keep`)."""
    if gradient_accumulation_fusion:
        raise ValueError(
            "FP8 linears leave ordinary .grad for Megatron's DDP; set "
            "gradient_accumulation_fusion to false"
        )
    if grad_output_buffer is not None or gtp_remat_size > 1:
        raise ValueError("FP8 linears do not defer weight gradients or rematerialize weights")
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    shape = input.shape
    keep = keep_mode(weight, save_original_input)
    out = _Fp8LinearFunction.apply(input.reshape(-1, shape[-1]), weight, recipe, keep)
    out = out.view(*shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


class _Fp8Linear:
    """What every FP8 linear adds to its Megatron (or local grouped) base: the recipe, and
    whether it keeps its original input for the weight gradient (:data:`Keep`)."""

    fp8_recipe: Fp8Recipe
    save_original_input: bool

    def __init__(
        self,
        *args: Any,
        fp8_recipe: Fp8Recipe,
        save_original_input: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fp8_recipe = fp8_recipe
        self.save_original_input = save_original_input


class _Fp8DenseProduct(_Fp8Linear):
    """Megatron's linears' ``_forward_impl`` seam with FP8 products (:func:`fp8_linear`)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any):
        return fp8_linear(self.fp8_recipe, self.save_original_input, input, weight, *args, **kwargs)


class Fp8ColumnParallelLinear(_Fp8DenseProduct, ColumnParallelLinear):
    """Megatron's ColumnParallelLinear with FP8 products."""


class Fp8RowParallelLinear(_Fp8DenseProduct, RowParallelLinear):
    """Megatron's RowParallelLinear with FP8 products."""


class _Fp8GroupedLinearFunction(torch.autograd.Function):
    """Per expert, ``x_e @ weight_e.T`` with FP8 products: each expert's tokens are quantized
    on their own (as Transformer Engine's grouped linear splits its input before quantizing).
    For the weight gradients it keeps each expert's input quantized along its tokens, or, with
    ``keep == "original"``, the whole input as one tensor (what the offload hooks then see)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        counts: tuple[int, ...],
        recipe: Fp8Recipe,
        keep: Keep,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        num_experts = len(counts)
        weights, biases = params[:num_experts], params[num_experts:]
        per_expert: Keep = "quantized" if keep == "quantized" else "nothing"
        outs, kept = [], []
        for chunk, weight in zip(x.split(counts), weights, strict=True):
            if chunk.shape[0] == 0:
                outs.append(x.new_empty(0, weight.shape[0]))
                kept.append(None)
                continue
            out, x_t = forward_product(chunk, weight, recipe, per_expert)
            outs.append(out)
            kept.append(x_t)
        out = torch.cat(outs)
        for b, out_chunk in zip(biases, out.split(counts), strict=False):
            out_chunk.add_(b)
        ctx.counts, ctx.recipe, ctx.input_dtype, ctx.kept_layouts = counts, recipe, x.dtype, []
        ctx.has_bias = bool(biases)
        ctx.original = keep == "original"
        saved = [t for q in kept for t in _save(ctx, q)]
        ctx.save_for_backward(*weights, *([x] if ctx.original else saved))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        counts: tuple[int, ...] = ctx.counts
        saved = ctx.saved_tensors
        weights, rest = saved[: len(counts)], saved[len(counts) :]
        kept: list[Quantized | torch.Tensor | None] = (
            list(rest[0].split(counts)) if ctx.original else _restore(ctx, iter(rest))
        )
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[4]
        dxs: list[torch.Tensor] = []
        dws: list[torch.Tensor | None] = []
        for dy, weight, x_kept in zip(
            grad_output.contiguous().split(counts), weights, kept, strict=True
        ):
            if dy.shape[0] == 0:  # an expert without tokens: zero weight gradient
                dxs.append(dy.new_empty(0, weight.shape[1], dtype=ctx.input_dtype))
                dws.append(torch.zeros_like(weight) if needs_dw else None)
                continue
            dx, dw = backward_products(
                dy.contiguous(),
                weight,
                x_kept if needs_dw else None,
                ctx.recipe,
                input_dtype=ctx.input_dtype,
                needs_input_grad=needs_dx,
            )
            if dx is not None:
                dxs.append(dx)
            dws.append(dw)
        dx_all = torch.cat(dxs) if needs_dx else None
        dbs = [dy.sum(0) for dy in grad_output.split(counts)] if ctx.has_bias else []
        return (dx_all, None, None, None, *dws, *dbs)


class _Fp8GroupedProducts(_Fp8Linear):
    """The local grouped linears' ``_products`` seam with FP8 products. Megatron's
    TEGroupedMLP sets ``save_original_input`` where the input is offloaded or recomputed."""

    def _products(
        self, x2d: torch.Tensor, counts: tuple[int, ...], params: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        keep = keep_mode(params[0], self.save_original_input)
        return _Fp8GroupedLinearFunction.apply(x2d, counts, self.fp8_recipe, keep, *params)


class Fp8LocalColumnParallelGroupedLinear(_Fp8GroupedProducts, LocalColumnParallelGroupedLinear):
    """The experts' grouped ``linear_fc1`` with FP8 products."""


class Fp8LocalRowParallelGroupedLinear(_Fp8GroupedProducts, LocalRowParallelGroupedLinear):
    """The experts' grouped ``linear_fc2`` with FP8 products."""


# Exactly these classes are replaced; a subclass (LoRA's adapters) is not an FP8 linear, and
# config.fp8 refuses the combinations that would build one.
_FP8_CLASSES: dict[type, type] = {
    ColumnParallelLinear: Fp8ColumnParallelLinear,
    RowParallelLinear: Fp8RowParallelLinear,
    LocalColumnParallelGroupedLinear: Fp8LocalColumnParallelGroupedLinear,
    LocalRowParallelGroupedLinear: Fp8LocalRowParallelGroupedLinear,
}


def linears_keeping_original_inputs(recompute_modules: frozenset[str]) -> frozenset[str]:
    """The linears that keep their original input for the weight gradient (Megatron's
    ``save_original_input``), as Megatron chooses them under Transformer Engine's FP8:

    * ``linear_proj``: the attention's output, which the attention kernel keeps for its own
      backward (one storage; a quantized copy would add half of it);
    * ``linear_qkv`` and ``linear_fc1`` when the norms are recomputed (``layernorm``), and
      ``linear_fc2`` when the activation is (``mlp_act``, ``moe_act``): the recompute discards
      the input and brings it back for the backward, which a quantized copy would defeat.
    """
    names = {"linear_proj"}
    if "layernorm" in recompute_modules:
        names |= {"linear_qkv", "linear_fc1"}
    if recompute_modules & {"mlp_act", "moe_act"}:
        names.add("linear_fc2")
    return frozenset(names)


def with_fp8_linears(
    spec: Any, recipe: Fp8Recipe, original_inputs: frozenset[str] = frozenset()
) -> Any:
    """``spec`` (a layer spec, a block spec or any part of one) with every linear of
    ``_FP8_CLASSES`` replaced by its FP8 class bound to ``recipe``, those in submodule fields
    named in ``original_inputs`` keeping their original inputs
    (:func:`linears_keeping_original_inputs`); nothing else changes."""

    def rewrite(node: Any, field: str | None = None) -> Any:
        if isinstance(node, type):
            fp8_class = _FP8_CLASSES.get(node)
            if fp8_class is None:
                return node
            return functools.partial(
                fp8_class, fp8_recipe=recipe, save_original_input=field in original_inputs
            )
        if isinstance(node, functools.partial):
            return functools.partial(
                rewrite(node.func, field),
                *(rewrite(a) for a in node.args),
                **{k: rewrite(v, k) for k, v in node.keywords.items()},
            )
        if isinstance(node, list | tuple):
            return type(node)(rewrite(item) for item in node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {
                f.name: rewrite(getattr(node, f.name), f.name)
                for f in dataclasses.fields(node)
                if f.init
            }
            return dataclasses.replace(node, **changes)
        return node

    return rewrite(spec)


def count_fp8_linears(model: torch.nn.Module) -> int:
    """How many of ``model``'s linears make FP8 products (telemetry and tests)."""
    return sum(isinstance(m, _Fp8Linear) for m in model.modules())
