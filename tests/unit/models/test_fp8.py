"""FP8 training without Transformer Engine (``megatron_cfg.fp8_cfg``; models.fp8_math and
models.fp8_linear): the quantizers' blocks and scales, the three products of a linear on the
operands Transformer Engine's recipes quantize, the layer spec's FP8 linears (dense and
experts), and a worker that trains with them. On CPU the products are the emulated ones; the
GPU test (test_fp8_gpu.py) checks torch's kernels against them."""

from __future__ import annotations

import pytest
import torch
from support import worker_ranks
from support.worker_ranks import section

from nemo_rl_offload.models import fp8_linear
from nemo_rl_offload.models.fp8_math import Fp8Recipe, Quantized, matmul_nt, quantize

E4M3 = torch.float8_e4m3fn
BLOCKWISE = Fp8Recipe("blockwise")
FP8_CFG = {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": False}
IDS = torch.tensor([[5, 17, 3, 9, 41, 2, 8, 30]])
POSITIONS = torch.arange(IDS.shape[1])[None]


def _blocks_of(t: torch.Tensor, rows: int, cols: int) -> list[torch.Tensor]:
    return [b for strip in t.split(rows, 0) for b in strip.split(cols, 1)]


@pytest.mark.parametrize("power_of_2", [True, False], ids=["pow2", "fp32"])
@pytest.mark.parametrize("layout,rows", [("1x128", 1), ("128x128", 128)])
def test_each_block_is_scaled_by_its_own_maximum(layout, rows, power_of_2):
    torch.manual_seed(0)
    t = torch.randn(200, 300) * torch.logspace(-3, 2, 300)  # columns of very different sizes
    t[:, 256:] = 0.0  # a whole all-zero block column (and a partial edge block)
    q = quantize(t, layout, E4M3, power_of_2=power_of_2)
    assert q.data.shape == t.shape and q.data.dtype == E4M3
    assert q.scale_inv.shape == (-(-200 // rows), 3)
    for block, data, scale_inv in zip(
        _blocks_of(t, rows, 128),
        _blocks_of(q.data.float(), rows, 128),
        q.scale_inv.flatten(),
        strict=True,
    ):
        amax = block.abs().max()
        if amax == 0:
            assert scale_inv == 1 and not data.any()
            continue
        largest = data.abs().max() * 1.0
        if power_of_2:  # rounded down: the block's maximum lands in [224, 448]
            assert torch.log2(scale_inv) == torch.round(torch.log2(scale_inv))
            assert 224 <= largest <= 448
        else:  # the block's maximum is exactly the format's maximum
            assert largest == 448
        # e4m3 keeps 3 mantissa bits: each value within half a step of 2^-3 relative (normals)
        restored = data * scale_inv
        normal = block.abs() * (1 / scale_inv) >= 2**-6
        err = (restored - block).abs()[normal] / block.abs()[normal]
        assert err.max() <= 2**-4 + 1e-6


def test_a_128x128_block_transposes_with_its_values():
    torch.manual_seed(1)
    w = torch.randn(256, 384)
    q = quantize(w, "128x128", E4M3, power_of_2=True)
    torch.testing.assert_close(q.transposed().dequantized(), q.dequantized().t(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="no transpose"):
        quantize(w, "1x128", E4M3, power_of_2=True).transposed()


def test_padding_the_contraction_adds_zeros_only():
    x = torch.randn(64, 200)
    padded = quantize(x, "1x128", E4M3, power_of_2=True, contraction_multiple=128)
    plain = quantize(x, "1x128", E4M3, power_of_2=True)
    assert padded.data.shape == (64, 256)
    assert torch.equal(padded.data[:, :200].float(), plain.data.float())
    assert not padded.data[:, 200:].float().any()
    assert torch.equal(padded.scale_inv, plain.scale_inv)


@pytest.mark.parametrize("keep", ["quantized", "original"])
@pytest.mark.parametrize(
    "recipe",
    [
        BLOCKWISE,
        Fp8Recipe("blockwise", power_of_2_scales=False),
        Fp8Recipe("tensorwise"),
        Fp8Recipe("tensorwise", grad_dtype=torch.float8_e5m2),
    ],
    ids=["blockwise", "blockwise-fp32-scales", "tensorwise", "tensorwise-hybrid"],
)
def test_the_three_products_use_the_operands_the_recipe_quantizes(recipe, keep):
    """Forward x·wᵀ, input gradient dy·w and weight gradient dyᵀ·x, each on the operands
    quantized along its own contraction (1x128 blocks of x and dy along the features for the
    first two, along the tokens for the third; 128x128 blocks of w), and not the unquantized
    product."""
    torch.manual_seed(2)
    x = torch.randn(200, 256, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(384, 256) * 0.05)
    dy = torch.randn(200, 384)
    y = fp8_linear._Fp8LinearFunction.apply(x, w, recipe, keep)
    y.backward(dy)

    act, wl, grad = recipe.activation_layout, recipe.weight_layout, recipe.grad_dtype
    p2 = recipe.power_of_2_scales

    def deq(t: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
        return quantize(t, layout, dtype, power_of_2=p2).dequantized()

    want_y = deq(x.detach(), act, E4M3) @ deq(w.detach(), wl, E4M3).t()
    want_dx = deq(dy, act, grad) @ deq(w.detach(), wl, E4M3)
    want_dw = deq(dy.t(), act, grad) @ deq(x.detach().t(), act, E4M3).t()
    for got, want, exact in (
        (y, want_y, x.detach() @ w.detach().t()),
        (x.grad, want_dx, dy @ w.detach()),
        (w.grad, want_dw, dy.t() @ x.detach()),
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 sum order
        assert not torch.allclose(got, exact, rtol=1e-3, atol=1e-3)  # it is not the plain one
        assert (got - exact).norm() / exact.norm() < 0.08  # but close to it


def test_what_a_linear_keeps_for_its_weight_gradient():
    x = torch.randn(16, 128)
    w = torch.randn(128, 128)
    _, kept = fp8_linear.forward_product(x, w, BLOCKWISE, "nothing")
    assert kept is None
    _, kept = fp8_linear.forward_product(x, w, BLOCKWISE, "quantized")
    assert isinstance(kept, Quantized) and kept.data.dtype == E4M3
    assert kept.data.shape == (128, 128)  # the tokens padded to a whole block
    _, kept = fp8_linear.forward_product(x, w, BLOCKWISE, "original")
    assert kept is x  # the input itself: its storage, which a recompute may discard
    assert fp8_linear.keep_mode(torch.nn.Parameter(w), save_original_input=True) == "original"
    assert fp8_linear.keep_mode(torch.nn.Parameter(w), save_original_input=False) == "quantized"
    assert fp8_linear.keep_mode(w, save_original_input=True) == "nothing"  # frozen
    with torch.no_grad():
        assert fp8_linear.keep_mode(torch.nn.Parameter(w), save_original_input=True) == "nothing"


def test_a_linear_keeping_its_original_input_saves_that_tensor_and_no_fp8_copy():
    x = torch.randn(32, 128, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(256, 128))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8_linear._Fp8LinearFunction.apply(x, w, BLOCKWISE, "original")
    assert [t.dtype for t in saved] == [w.dtype, x.dtype]
    assert saved[1].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8_linear._Fp8LinearFunction.apply(x, w, BLOCKWISE, "quantized")
    assert [t.dtype for t in saved] == [w.dtype, E4M3, torch.float32]


def test_no_product_takes_128x128_blocks_on_both_sides():
    q = quantize(torch.randn(128, 128), "128x128", E4M3, power_of_2=True)
    with pytest.raises(ValueError, match="both sides"):
        matmul_nt(q, q, torch.float32)
    bad = Quantized(q.data[:, :64], q.scale_inv, "1x128")
    with pytest.raises(ValueError, match="contraction sizes differ"):
        matmul_nt(bad, q, torch.float32)


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS, POSITIONS, attention_mask=None)


def test_the_layers_linears_and_only_they_are_fp8(build_tiny):
    plain, _ = build_tiny("tiny-dense", seed=3)
    fp8, _ = build_tiny("tiny-dense", seed=3, fp8_cfg=FP8_CFG)
    fp8.load_state_dict(plain.state_dict())
    layers = len(fp8.decoder.layers)
    assert fp8_linear.count_fp8_linears(fp8) == 4 * layers
    assert fp8_linear.count_fp8_linears(plain) == 0
    assert not isinstance(fp8.output_layer, fp8_linear.Fp8ColumnParallelLinear)
    for layer in fp8.decoder.layers:
        assert isinstance(layer.self_attention.linear_qkv, fp8_linear.Fp8ColumnParallelLinear)
        assert isinstance(layer.mlp.linear_fc2, fp8_linear.Fp8RowParallelLinear)
    got, want = _logits(fp8), _logits(plain)
    assert not torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (got - want).norm() / want.norm() < 0.1


def test_the_experts_linears_are_fp8_and_an_idle_expert_gets_a_zero_gradient(
    build_tiny, moe_globals_restored
):
    model, _ = build_tiny(
        "tiny-moe", seed=4, fp8_cfg=FP8_CFG, model_overrides={"moe_grouped_gemm": True}
    )
    experts = [layer.mlp.experts for layer in model.decoder.layers]
    assert all(
        isinstance(e.linear_fc1, fp8_linear.Fp8LocalColumnParallelGroupedLinear)
        and isinstance(e.linear_fc2, fp8_linear.Fp8LocalRowParallelGroupedLinear)
        for e in experts
    )
    linear = experts[0].linear_fc1
    x = torch.randn(6, linear.in_features, requires_grad=True)
    out, _ = linear(x, [4, 0, 2, 0])
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert not linear.weight1.grad.any() and linear.weight0.grad.any()
    # Each expert's tokens are quantized on their own: the first expert's output is what the
    # dense FP8 product gives for its rows alone.
    alone, _ = fp8_linear.forward_product(x[:4].detach(), linear.weight0, BLOCKWISE, "nothing")
    torch.testing.assert_close(out[:4].detach(), alone, rtol=0, atol=0)
    model.train()
    model(IDS, POSITIONS, attention_mask=None).sum().backward()  # the whole model, both ways


@pytest.mark.parametrize("recompute", [None, ["layernorm", "mlp_act"]], ids=["plain", "recompute"])
def test_linears_whose_input_is_kept_or_recomputed_keep_the_original(build_tiny, recompute):
    """As Megatron chooses under Transformer Engine's FP8: the projection always (the attention
    keeps its output), the norms' and the activation's consumers when those are recomputed."""
    settings = {"fp8_cfg": FP8_CFG}
    if recompute:
        settings.update(
            activation_checkpointing=True,
            recompute_granularity="selective",
            recompute_modules=recompute,
        )
    model, _ = build_tiny("tiny-dense", seed=5, **settings)
    layer = model.decoder.layers[0]
    keeps = {
        name: linear.save_original_input
        for name, linear in (
            ("linear_qkv", layer.self_attention.linear_qkv),
            ("linear_proj", layer.self_attention.linear_proj),
            ("linear_fc1", layer.mlp.linear_fc1),
            ("linear_fc2", layer.mlp.linear_fc2),
        )
    }
    assert keeps == {
        "linear_qkv": bool(recompute),
        "linear_proj": True,
        "linear_fc1": bool(recompute),
        "linear_fc2": bool(recompute),
    }
    model.train()
    model(IDS, POSITIONS, attention_mask=None).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_grouped_experts_keeping_the_original_input_save_it_once():
    linear = fp8_linear.Fp8LocalColumnParallelGroupedLinear.__new__(
        fp8_linear.Fp8LocalColumnParallelGroupedLinear
    )
    torch.nn.Module.__init__(linear)
    linear.fp8_recipe, linear.save_original_input = BLOCKWISE, True
    weights = [torch.nn.Parameter(torch.randn(64, 128)) for _ in range(3)]
    x = torch.randn(10, 128, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = linear._products(x, (6, 0, 4), weights)
    # The three weights and the input itself (its storage), once; no FP8 copy.
    assert [t.data_ptr() for t in saved] == [w.data_ptr() for w in weights] + [x.data_ptr()]
    assert not any(t.dtype == E4M3 for t in saved)
    out.sum().backward()
    quantized = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    linear.save_original_input = False
    x2 = x.detach().clone().requires_grad_()
    linear._products(x2, (6, 0, 4), quantized).sum().backward()
    for a, b in zip(weights, quantized, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)  # the same FP8 gradients
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_sequential_experts_are_fp8_too(build_tiny, moe_globals_restored):
    model, _ = build_tiny("tiny-moe", seed=4, fp8_cfg=FP8_CFG)
    for layer in model.decoder.layers:
        for expert in layer.mlp.experts.local_experts:
            assert isinstance(expert.linear_fc1, fp8_linear.Fp8ColumnParallelLinear)
    assert fp8_linear.count_fp8_linears(model) == 2 * (2 + 2 * 4)


def test_a_worker_trains_in_fp8_and_resumes_exactly(megatron_cpu, tmp_path):
    plain = worker_ranks.single_worker(section())
    trained = worker_ranks.single_worker(section(fp8_cfg=FP8_CFG))
    try:
        assert fp8_linear.count_fp8_linears(trained._unwrapped()) > 0
        batches = [worker_ranks.step_batches(step) for step in range(4)]
        plain_losses = [plain.train(b, worker_ranks.LOSS)["loss"] for b in batches]
        losses = [trained.train(b, worker_ranks.LOSS)["loss"] for b in batches]
        assert losses[0] == pytest.approx(plain_losses[0], rel=0.02)  # the same weights
        assert losses != plain_losses  # but FP8 products
        assert losses[-1] < losses[0]
        resumed = worker_ranks.resumes_exactly(
            trained, section(fp8_cfg=FP8_CFG), tmp_path / "ckpt", (5, 6)
        )
        resumed.close()
    finally:
        trained.close()
        plain.close()


def test_a_worker_started_without_validate_refuses_what_validate_refuses(megatron_cpu):
    from nemo_rl_offload.errors import UserInputError

    with pytest.raises(UserInputError, match="fp8_cfg.fp8_recipe: 'delayed'"):
        worker_ranks.single_worker(section(fp8_cfg={**FP8_CFG, "fp8_recipe": "delayed"}))
