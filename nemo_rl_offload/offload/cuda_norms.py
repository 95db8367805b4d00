"""An RMSNorm that keeps for backward what CUDA's kernel keeps, for measuring on the CPU.

Why: the ledger is measured on the CPU, but it describes a GPU step. On CUDA, torch's
``rms_norm`` runs its fused kernel, which keeps the input (in its own dtype) and one float32
reciprocal RMS per token. On the CPU it runs a composite that keeps float32 copies of a
bfloat16 input and of its normalised value: three times the bytes of the input, which no GPU
step holds. :func:`with_cuda_rms_norms` swaps the RMSNorm modules of a model built for the
ledger (that model only) for :class:`CudaLikeRMSNorm`, whose forward computes the same values
and keeps what the fused kernel keeps. LayerNorm keeps the same tensors on both devices and is
left as it is.
"""

from __future__ import annotations

from typing import Any

import torch


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * weight, keeping x and the float32 reciprocal RMS (the fused kernel's
    saved tensors); the backward recomputes the normalised value from them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normalised = x.float() * rstd
        g = grad.float()
        grad_weight = (g * normalised).reshape(-1, x.size(-1)).sum(0)
        scaled = g * weight.float()
        dot = (scaled * normalised).mean(-1, keepdim=True)
        grad_x = rstd * (scaled - normalised * dot)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class CudaLikeRMSNorm(torch.nn.Module):
    """The RMSNorm ``norm`` (its weight, its eps) through :class:`_RMSNorm`."""

    def __init__(self, norm: torch.nn.RMSNorm) -> None:
        super().__init__()
        if norm.weight is None:
            raise ValueError("CudaLikeRMSNorm: an RMSNorm without a weight")
        self.weight = norm.weight
        self.eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


def with_cuda_rms_norms(model: torch.nn.Module) -> int:
    """Swap every ``torch.nn.RMSNorm`` of ``model`` for :class:`CudaLikeRMSNorm` under the same
    name; returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.RMSNorm):
                setattr(parent, name, CudaLikeRMSNorm(child))
                swapped += 1
    return swapped
