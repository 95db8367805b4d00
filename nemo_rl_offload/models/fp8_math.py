"""FP8 quantization and scaled matrix products without Transformer Engine (``fp8_cfg``; the
layers that use them are :mod:`models.fp8_linear`, the rules :mod:`config.fp8`).

The ``blockwise`` and ``tensorwise`` recipes, with Transformer Engine's meaning.
:func:`matmul_nt` uses torch's FP8 kernels where this GPU and torch have them, and otherwise
computes the same product in float32 (:func:`kernel_for` says which). Details: docs/fp8.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F

_LOG = logging.getLogger(__name__)
BLOCK = 128
# cuBLAS's FP8 products need each dimension a multiple of 16.
_KERNEL_ALIGNMENT = 16
# The block-scaled kernels take their weight scales in groups of 4 along the contraction.
_SCALE_GROUP = 4

Layout = Literal["1x128", "128x128", "tensor"]
RecipeName = Literal["blockwise", "tensorwise"]


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """What the FP8 layers quantize and how (``models.fp8_linear.recipe_for`` makes it from the
    checked ``config.fp8.Fp8Settings``)."""

    recipe: RecipeName
    # Forward operands (activations, weights): e4m3. Gradients: e4m3, or e5m2 for "hybrid".
    grad_dtype: torch.dtype = torch.float8_e4m3fn
    # Block scales rounded down to powers of two (Transformer Engine's default for blockwise).
    power_of_2_scales: bool = True

    @property
    def activation_layout(self) -> Layout:
        return "1x128" if self.recipe == "blockwise" else "tensor"

    @property
    def weight_layout(self) -> Layout:
        return "128x128" if self.recipe == "blockwise" else "tensor"


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A 2-D operand ``[rows, cols]`` in FP8, contracted along ``cols`` by :func:`matmul_nt`.

    ``scale_inv`` is float32: ``[rows, ceil(cols/128)]`` for 1x128 blocks,
    ``[ceil(rows/128), ceil(cols/128)]`` for 128x128 blocks, a single element per tensor."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    layout: Layout

    def transposed(self) -> Quantized:
        """The same values as ``[cols, rows]``: only 128x128 blocks and per-tensor scales stay
        blocks of the transpose (a 1x128 block would become 128x1)."""
        if self.layout == "1x128":
            raise ValueError("a 1x128-scaled operand has no transpose in the same blocks")
        scale_inv = self.scale_inv.t() if self.layout == "128x128" else self.scale_inv
        return Quantized(self.data.t().contiguous(), scale_inv.contiguous(), self.layout)

    def dequantized(self) -> torch.Tensor:
        """The real values this operand stands for, in float32."""
        values = self.data.float()
        if self.layout == "tensor":
            return values * self.scale_inv
        rows, cols = values.shape
        per_row = 1 if self.layout == "1x128" else BLOCK
        scales = self.scale_inv.repeat_interleave(per_row, 0)[:rows]
        return values * scales.repeat_interleave(BLOCK, 1)[:, :cols]


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _scales(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """Quantization scales (FP8 maximum / absolute maximum) in float32: 1 for an all-zero block,
    never infinite; rounded down to a power of two when asked (so that no scaled value can
    exceed the format's maximum)."""
    amax = amax.float()
    scale = torch.where(amax > 0, fp8_max(dtype) / amax, torch.ones_like(amax))
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(
    t: torch.Tensor,
    layout: Layout,
    dtype: torch.dtype,
    *,
    power_of_2: bool,
    contraction_multiple: int = 1,
) -> Quantized:
    """``t`` (2-D, contracted along its last dimension) in ``dtype`` with ``layout``'s scales.

    Partial blocks at the edges are scaled by their own elements (as if padded with zeros).
    ``contraction_multiple``: the result's last dimension padded with zeros to a multiple of
    it (zeros add nothing to a product; the weight gradient's token dimension is padded so that
    torch's kernels can take it). On a GPU it runs compiled (:class:`_CompiledQuantize`)."""
    if t.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(t.shape)}")
    core = _COMPILED if t.is_cuda else _quantize
    data, scale_inv = core(t.detach(), layout, dtype, power_of_2, contraction_multiple)
    return Quantized(data, scale_inv, layout)


def _quantize(
    t: torch.Tensor,
    layout: Layout,
    dtype: torch.dtype,
    power_of_2: bool,
    contraction_multiple: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize`'s arithmetic: (FP8 data, float32 dequantization factors)."""
    # Row-major, as the kernels read an operand: elementwise results keep their input's
    # strides, so a transposed view would otherwise give column-major FP8 data.
    t = t.contiguous()
    if t.shape[1] % contraction_multiple:
        extra = contraction_multiple - t.shape[1] % contraction_multiple
        t = F.pad(t, (0, extra))
    limit = fp8_max(dtype)
    if layout == "tensor":
        scale = _scales(t.abs().amax(), dtype, power_of_2=False)
        data = (t.float() * scale).clamp(-limit, limit).to(dtype)
        return data, scale.reciprocal().reshape(())
    rows, cols = t.shape
    block_rows = 1 if layout == "1x128" else BLOCK
    padded_rows = -(-rows // block_rows) * block_rows
    padded_cols = -(-cols // BLOCK) * BLOCK
    if (padded_rows, padded_cols) != (rows, cols):
        t = F.pad(t, (0, padded_cols - cols, 0, padded_rows - rows))
    blocks = t.reshape(padded_rows // block_rows, block_rows, padded_cols // BLOCK, BLOCK)
    scale = _scales(blocks.abs().amax(dim=(1, 3)), dtype, power_of_2)
    data = (blocks.float() * scale[:, None, :, None]).clamp(-limit, limit).to(dtype)
    data = data.reshape(padded_rows, padded_cols)
    if (padded_rows, padded_cols) != (rows, cols):
        data = data[:rows, :cols].contiguous()
    return data, scale.reciprocal()


class _CompiledQuantize:
    """:func:`_quantize` under torch.compile, for GPU tensors: eagerly each quantization is
    several kernels over float32 copies, slower than the products it feeds (both forms timed
    on an H100; see docs/fp8.md). Shapes are dynamic.
    Where compiling fails (no triton), the eager form runs, with one warning."""

    def __init__(self) -> None:
        self._compiled: Any = None
        self.eager = False  # benchmarks/fp8_linear_benchmark.py's comparison

    def __call__(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.eager:
            if self._compiled is None:
                self._compiled = torch.compile(_quantize, dynamic=True)
            try:
                return self._compiled(*args)
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back
                _LOG.warning("FP8 quantizers run eagerly (slower): torch.compile failed: %s", err)
                self.eager = True
        return _quantize(*args)


_COMPILED = _CompiledQuantize()


@functools.cache
def _scaling_types() -> dict[Layout, object] | None:
    """torch's names for the three layouts (``ScalingType``; spelled differently across torch
    versions), or None where torch has no ``scaled_mm``."""
    scaled_mm = getattr(F, "scaled_mm", None)
    scaling = getattr(F, "ScalingType", None)
    if scaled_mm is None or scaling is None:
        return None

    def named(*names: str) -> object | None:
        return next((getattr(scaling, n) for n in names if hasattr(scaling, n)), None)

    types = {
        "1x128": named("BlockWise1x128", "Blockwise_1x128"),
        "128x128": named("BlockWise128x128", "Blockwise_128x128"),
        "tensor": named("TensorWise", "Tensorwise"),
    }
    return None if any(v is None for v in types.values()) else types  # type: ignore[misc]


@functools.cache
def _device_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def kernel_for(a: Quantized, b: Quantized) -> bool:
    """Whether torch's FP8 kernel computes ``a @ b.T`` here (else :func:`matmul_nt` emulates).

    Block scales: an SM 9.x GPU (cuBLAS's DeepSeek-style kernels exist only there), e4m3 on
    both sides, whole 128-blocks along the contraction and ``b``'s rows (and a 128x128 ``a``'s
    rows).
    Per-tensor scales: SM 8.9+, not e5m2 on both sides. The contraction and ``b``'s rows a
    multiple of 16 (``a``'s rows are padded to one)."""
    if not a.data.is_cuda or _scaling_types() is None:
        return False
    major_minor = _device_capability(a.data.device.index or 0)
    (m, k), n = a.data.shape, b.data.shape[0]
    if k % _KERNEL_ALIGNMENT or n % _KERNEL_ALIGNMENT:  # rows are padded (_rows_padded)
        return False
    if a.layout == "tensor":
        both_e5m2 = a.data.dtype == b.data.dtype == torch.float8_e5m2
        return major_minor >= (8, 9) and not both_e5m2
    e4m3 = a.data.dtype == b.data.dtype == torch.float8_e4m3fn
    whole_blocks = k % BLOCK == 0 and n % BLOCK == 0
    if a.layout == "128x128" and m % BLOCK:
        return False
    return major_minor[0] == 9 and e4m3 and whole_blocks


def _kernel_scale(q: Quantized, k: int) -> torch.Tensor:
    """``q.scale_inv`` laid out as torch's block-scaled kernels read it for an operand
    contracted over ``k``: 1x128 scales column-major ``[rows, k/128]``; 128x128 scales
    ``[round_up(k/128, 4), rows/128]`` column-major (the weight side's transposed layout)."""
    if q.layout == "tensor":
        return q.scale_inv.reshape(())
    if q.layout == "1x128":
        return q.scale_inv.t().contiguous().t()
    k_blocks = k // BLOCK
    padded = -(-k_blocks // _SCALE_GROUP) * _SCALE_GROUP
    scale = q.scale_inv
    if padded != k_blocks:
        scale = F.pad(scale, (0, padded - k_blocks))
    return scale.contiguous().t()


def matmul_nt(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` (``a`` is ``[m, k]``, ``b`` is ``[n, k]``) in ``out_dtype``, accumulated in
    float32: torch's FP8 kernel where :func:`kernel_for` allows, else the same product of the
    dequantized operands."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"contraction sizes differ: {a.data.shape} and {b.data.shape}")
    if a.layout == b.layout == "128x128":
        raise ValueError("no FP8 product takes 128x128 blocks on both sides")
    if not kernel_for(a, b):
        if a.data.is_cuda:
            _say_emulated(a, b)
        return (a.dequantized() @ b.dequantized().t()).to(out_dtype)
    types = _scaling_types()
    assert types is not None  # kernel_for checked
    rows = a.data.shape[0]
    a = _rows_padded(a, _KERNEL_ALIGNMENT)
    k = a.data.shape[1]
    out = F.scaled_mm(  # type: ignore[attr-defined]
        a.data,
        b.data.t(),
        _kernel_scale(a, k),
        types[a.layout],
        _kernel_scale(b, k),
        types[b.layout],
        output_dtype=out_dtype,
    )
    return out if out.shape[0] == rows else out[:rows]


_said: set[tuple[object, ...]] = set()


def _say_emulated(a: Quantized, b: Quantized) -> None:
    """One warning per kind of product a GPU emulates (slower than its bfloat16 product)."""
    kind = (a.layout, b.layout, a.data.dtype, b.data.dtype, a.data.shape[1], b.data.shape[0])
    if kind not in _said:
        _said.add(kind)
        _LOG.warning(
            "FP8 product %s x %s (%s x %s, contraction %d, %d outputs) is emulated on this GPU: "
            "torch %s has no FP8 kernel for it here (fp8_math.kernel_for says why)",
            *kind[:2], a.data.dtype, b.data.dtype, kind[4], kind[5], torch.__version__,
        )  # fmt: skip


def _rows_padded(q: Quantized, multiple: int) -> Quantized:
    """``q`` with zero rows added up to a multiple of ``multiple`` (their scales 1): a decode
    step's few tokens become a shape the kernels take, and the extra output rows are dropped."""
    rows = q.data.shape[0]
    if rows % multiple == 0 or q.layout == "128x128":
        return q
    extra = multiple - rows % multiple
    data = F.pad(q.data.view(torch.uint8), (0, 0, 0, extra)).view(q.data.dtype)
    scale_inv = q.scale_inv
    if q.layout == "1x128":
        scale_inv = F.pad(scale_inv, (0, 0, 0, extra), value=1.0)
    return Quantized(data, scale_inv, q.layout)
