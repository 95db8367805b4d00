"""torch's FP8 kernels against the emulated products (models.fp8_math) on the GPU: the same
values up to float32 accumulation order, for every operand pairing a linear makes, a decode
step's few rows included, and a linear's forward and both gradients."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.models import fp8_linear, fp8_math
from nemo_rl_offload.models.fp8_math import Fp8Recipe, Quantized, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_the_compiled_quantizer_is_the_eager_one():
    torch.manual_seed(3)
    for t, layout in ((_spread(300, 3072), "1x128"), (_spread(1024, 384), "128x128")):
        for view in (t, t.t()):
            got = quantize(view, layout, E4M3, power_of_2=False, contraction_multiple=128)
            data, scale_inv = fp8_math._quantize(view, layout, E4M3, False, 128)
            assert torch.equal(got.data.view(torch.uint8), data.view(torch.uint8))
            # 1/scale: the compiled division may differ from torch's in the last bit
            torch.testing.assert_close(got.scale_inv, scale_inv, rtol=3e-7, atol=0)


def _emulated(a: Quantized, b: Quantized, dtype: torch.dtype) -> torch.Tensor:
    return (a.dequantized() @ b.dequantized().t()).to(dtype)


def _spread(rows: int, cols: int) -> torch.Tensor:
    """Values whose 128-blocks differ in size by orders of magnitude (rows and columns
    scaled), so that a scale applied to the wrong block shows."""
    row = torch.logspace(-2, 2, rows, device="cuda")[torch.randperm(rows, device="cuda")]
    col = torch.logspace(-2, 2, -(-cols // 128), device="cuda").repeat_interleave(128)[:cols]
    return torch.randn(rows, cols, device="cuda") * row[:, None] * col[None, :]


def _agree(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Equal up to float32 accumulation order: relative to the product's own size."""
    assert ((got - want).norm() / want.norm()).item() < rel
    assert ((got - want).abs().max() / want.abs().max()).item() < rel


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("rows", [4096, 5], ids=["tokens", "decode-rows"])
@pytest.mark.parametrize(
    ("a_layout", "b_layout", "a_dtype"),
    [
        ("1x128", "128x128", E4M3),  # forward, input gradient
        ("1x128", "1x128", E4M3),  # weight gradient
        ("tensor", "tensor", E4M3),
        ("tensor", "tensor", E5M2),  # hybrid gradients
    ],
)
def test_the_kernel_computes_the_emulated_product(rows, a_layout, b_layout, a_dtype):
    if a_layout != "tensor" and not _hopper():
        pytest.skip("block-scaled FP8 kernels exist on SM 9.x only")
    torch.manual_seed(0)
    a = quantize(_spread(rows, 3072), a_layout, a_dtype, power_of_2=True)
    b = quantize(_spread(1024, 3072), b_layout, E4M3, power_of_2=True)
    assert fp8_math.kernel_for(a, b)
    got = fp8_math.matmul_nt(a, b, torch.float32)
    want = _emulated(a, b, torch.float32)
    assert got.shape == (rows, 1024)
    _agree(got, want, 5e-3)
    # A transposed view quantizes to row-major data, as the kernels read it.
    at = quantize(_spread(3072, rows).t(), a_layout, a_dtype, power_of_2=True)
    assert at.data.is_contiguous()
    _agree(fp8_math.matmul_nt(at, b, torch.float32), _emulated(at, b, torch.float32), 5e-3)


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_a_linear_on_the_kernels_matches_its_emulation(recipe, monkeypatch):
    if recipe == "blockwise" and not _hopper():
        pytest.skip("block-scaled FP8 kernels exist on SM 9.x only")
    torch.manual_seed(1)
    r = Fp8Recipe(recipe)  # type: ignore[arg-type]
    x0 = _spread(2048, 1024).bfloat16()
    w0 = (_spread(3072, 1024) * 0.03).bfloat16()
    dy = _spread(2048, 3072).bfloat16()

    def run() -> tuple[torch.Tensor, ...]:
        x = x0.clone().requires_grad_()
        w = torch.nn.Parameter(w0.clone())
        y = fp8_linear._Fp8LinearFunction.apply(x, w, r, "quantized")
        y.backward(dy)
        return y.float(), x.grad.float(), w.grad.float()

    on_kernels = run()
    monkeypatch.setattr(fp8_math, "kernel_for", lambda a, b: False)
    emulated = run()
    for got, want in zip(on_kernels, emulated, strict=True):
        _agree(got, want, 1e-2)  # bfloat16 outputs
