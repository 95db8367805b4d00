"""What autograd saves, per module (nemo_rl_offload/offload/saved_tensors.py), and the RMSNorm
that keeps what CUDA's kernel keeps (nemo_rl_offload/offload/cuda_norms.py)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.offload.cuda_norms import CudaLikeRMSNorm, with_cuda_rms_norms
from nemo_rl_offload.offload.saved_tensors import ROOT, saved_bytes


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 16, bias=False)
        self.second = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        return self.second(torch.relu(hidden)) * hidden[..., :4]


def test_each_storage_is_charged_once_to_the_innermost_module_and_weights_are_left_out():
    model = _Block()
    x = torch.randn(3, 8, requires_grad=True)
    saved = saved_bytes(model, lambda: model(x).sum()).saved
    owners = [(item.owner, item.shape, item.nbytes, item.also) for item in saved]
    # first keeps its input; the block's relu keeps its output, which second keeps again as
    # its input; the multiply keeps a view of first's output (its whole storage counts) and
    # second's output.
    assert owners == [
        ("first", (3, 8), 3 * 8 * 4, []),
        (ROOT, (3, 16), 3 * 16 * 4, ["second"]),
        (ROOT, (3, 4), 3 * 16 * 4, []),
        (ROOT, (3, 4), 3 * 4 * 4, []),
    ]
    assert all(item.dtype == "float32" for item in saved)


def test_a_storage_saved_by_two_modules_names_the_second():
    inner = torch.nn.Linear(4, 4, bias=False)
    outer = torch.nn.Sequential(torch.nn.Identity(), inner)
    x = torch.randn(2, 4, requires_grad=True)
    model = torch.nn.ModuleDict({"a": outer, "b": torch.nn.Linear(4, 4, bias=False)})

    def forward() -> torch.Tensor:
        return (model["a"](x) + model["b"](x)).sum()

    (item,) = saved_bytes(model, forward).saved
    assert (item.owner, item.also) == ("a.1", ["b"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_like_norm_computes_what_torch_rmsnorm_computes(dtype):
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 2, 32, dtype=dtype, requires_grad=True)
    grad = torch.randn(5, 2, 32, dtype=dtype)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    want = norm(x)
    want.backward(grad)
    want_x, want_w = x.grad.clone(), norm.weight.grad.clone()
    x.grad = None
    norm.weight.grad = None
    like = CudaLikeRMSNorm(norm)
    got = like(x)
    got.backward(grad)
    torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(x.grad, want_x, **tolerance)
    torch.testing.assert_close(norm.weight.grad, want_w, **tolerance)
    # It keeps the input and one float32 value per row, nothing else.
    saved = saved_bytes(like, lambda: like(x).sum()).saved
    assert [(s.dtype, s.shape) for s in saved] == [
        (str(dtype).removeprefix("torch."), (5, 2, 32)),
        ("float32", (5, 2, 1)),
    ]


def test_only_rms_norms_are_swapped_under_their_names():
    model = torch.nn.Sequential(torch.nn.RMSNorm(8), torch.nn.LayerNorm(8))
    assert with_cuda_rms_norms(model) == 1
    assert isinstance(model[0], CudaLikeRMSNorm) and isinstance(model[1], torch.nn.LayerNorm)
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "1.weight", "1.bias"]


class _Releasing(torch.nn.Module):
    """sin keeps ``doubled``, then (when asked) the forward releases that storage, as
    output-discarding recompute does with a norm's output after the next linear saved it."""

    def __init__(self, release: bool) -> None:
        super().__init__()
        self.release = release

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        doubled = x * 2
        out = doubled.sin()
        if self.release:
            doubled.untyped_storage().resize_(0)
        return out * 3  # keeps nothing: a scalar factor


@pytest.mark.parametrize("release", [False, True])
def test_what_the_forward_released_is_not_held(release):
    x = torch.randn(4, 8, requires_grad=True)
    model = _Releasing(release)
    saved = saved_bytes(model, lambda: model(x).sum()).saved
    assert [item.nbytes for item in saved] == ([] if release else [4 * 8 * 4])
