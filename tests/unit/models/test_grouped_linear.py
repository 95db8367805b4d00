"""The local grouped expert linears: per-expert products forward and backward, TEGroupedMLP over
them equals Megatron's SequentialMLP, the builder uses them for moe_grouped_gemm without TE, and
the whole expert input is saved as one tensor (what expert_fc1 offloading moves)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import experts as megatron_experts
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_rl_offload.models.grouped_linear import (
    LocalColumnParallelGroupedLinear,
    LocalRowParallelGroupedLinear,
    _GroupedLinearFunction,
    _offsets,
    local_grouped_experts,
)

HIDDEN, FFN, EXPERTS = 32, 48, 4
COUNTS = [5, 0, 7, 3]  # expert 1 gets no tokens
TOKENS = sum(COUNTS)


def _config(**overrides: Any) -> TransformerConfig:
    """A one-layer MoE config like the presets' (SwiGLU, no bias), float32 on the CPU."""
    kwargs: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=EXPERTS,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _pg_collection() -> Any:
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _linear(cls: type, input_size: int, output_size: int, config: TransformerConfig, **kw: Any):
    args = dict(
        config=config,
        init_method=config.init_method,
        bias=config.add_bias_linear,
        skip_bias_add=False,
        is_expert=True,
        tp_comm_buffer_name=None,
        pg_collection=_pg_collection(),
    )
    args.update(kw)
    return cls(EXPERTS, input_size, output_size, **args)


def _weights(linear: torch.nn.Module, name: str = "weight") -> list[torch.Tensor]:
    return [getattr(linear, f"{name}{e}") for e in range(EXPERTS)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_grouped_linear_equals_per_expert_products(megatron_cpu, bias, skip_bias_add):
    config = _config(add_bias_linear=bias)
    linear = _linear(
        LocalColumnParallelGroupedLinear, HIDDEN, FFN, config, skip_bias_add=skip_bias_add
    )
    assert [tuple(w.shape) for w in _weights(linear)] == [(FFN, HIDDEN)] * EXPERTS
    if bias:
        with torch.no_grad():
            for b in _weights(linear, "bias"):
                b.normal_()
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    out, out_bias = linear(x, COUNTS)

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = [w.detach().clone().requires_grad_(True) for w in _weights(linear)]
    b_ref = (
        [b.detach().clone().requires_grad_(True) for b in _weights(linear, "bias")] if bias else []
    )
    chunks = [c @ w.T for c, w in zip(x_ref.split(COUNTS), w_ref, strict=True)]
    if bias:
        chunks = [c + b for c, b in zip(chunks, b_ref, strict=True)]
    ref = torch.cat(chunks)

    if bias and skip_bias_add:  # the caller adds the biases (TEGroupedMLP._apply_bias)
        assert out_bias == _weights(linear, "bias")
        out = torch.cat([c + b for c, b in zip(out.split(COUNTS), out_bias, strict=True)])
    else:
        assert out_bias is None
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for w, r in zip(_weights(linear), w_ref, strict=True):
        torch.testing.assert_close(w.grad, r.grad)
    assert torch.equal(linear.weight1.grad, torch.zeros(FFN, HIDDEN))  # the zero-token expert
    for b, r in zip(_weights(linear, "bias") if bias else [], b_ref, strict=True):
        torch.testing.assert_close(b.grad, r.grad)


def test_tokens_per_expert_must_match_the_input(megatron_cpu):
    linear = _linear(LocalRowParallelGroupedLinear, FFN, HIDDEN, _config(), skip_bias_add=True)
    with pytest.raises(ValueError, match="sums to 14 but the input has 15 rows"):
        linear(torch.randn(TOKENS, FFN), [5, 0, 6, 3])
    assert linear(torch.randn(0, FFN), torch.tensor([0, 0, 0, 0]))[0].shape == (0, HIDDEN)


def test_gradient_accumulation_fusion_is_refused(megatron_cpu):
    config = _config(gradient_accumulation_fusion=False)
    config.gradient_accumulation_fusion = True  # the config itself refuses it without Apex
    with pytest.raises(ValueError, match="does not support gradient_accumulation_fusion"):
        _linear(LocalColumnParallelGroupedLinear, HIDDEN, FFN, config)


def _sequential_and_grouped(config: TransformerConfig) -> tuple[SequentialMLP, TEGroupedMLP]:
    """Megatron's SequentialMLP and TEGroupedMLP over the local linears, with the same weights."""
    pg = _pg_collection()
    sequential = SequentialMLP(
        EXPERTS,
        config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        pg_collection=pg,
    )
    grouped = local_grouped_experts()(EXPERTS, config, pg_collection=pg)
    with torch.no_grad():
        for e, expert in enumerate(sequential.local_experts):
            for name in ("linear_fc1", "linear_fc2"):
                getattr(getattr(grouped, name), f"weight{e}").copy_(
                    getattr(expert, name).weight.normal_(std=0.2)
                )
                if config.add_bias_linear:
                    getattr(getattr(grouped, name), f"bias{e}").copy_(
                        getattr(expert, name).bias.normal_()
                    )
    return sequential, grouped


def _run(module: torch.nn.Module, x: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor):
    """(output, input grad, probs grad) of an experts module on the COUNTS routing."""
    xi, pi = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, out_bias = module(xi, torch.tensor(COUNTS), pi)
    assert out_bias is None
    out.backward(grad)
    return out, xi.grad, pi.grad


def test_te_grouped_mlp_with_local_linears_equals_sequential_mlp(megatron_cpu):
    sequential, grouped = _sequential_and_grouped(_config())
    assert isinstance(grouped.linear_fc1, LocalColumnParallelGroupedLinear)
    assert isinstance(grouped.linear_fc2, LocalRowParallelGroupedLinear)
    x, probs, grad = torch.randn(TOKENS, HIDDEN), torch.rand(TOKENS), torch.randn(TOKENS, HIDDEN)
    for got, expected in zip(
        _run(grouped, x, probs, grad), _run(sequential, x, probs, grad), strict=True
    ):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    for e, expert in enumerate(sequential.local_experts):
        for name in ("linear_fc1", "linear_fc2"):
            torch.testing.assert_close(
                getattr(getattr(grouped, name), f"weight{e}").grad,
                getattr(expert, name).weight.grad,
                atol=1e-6,
                rtol=1e-6,
                msg=f"{name}.weight{e}",
            )


def test_te_grouped_mlp_adds_expert_biases(megatron_cpu):
    """With add_bias_linear, fc1 adds its biases and fc2 hands them to TEGroupedMLP, which adds
    them scaled by the router probabilities, as Megatron's expert MLP does (SequentialMLP itself
    fails in megatron-core 0.19 with expert biases at TP=1: an in-place add on a custom
    Function's view)."""
    _, grouped = _sequential_and_grouped(_config(add_bias_linear=True))
    x, probs, grad = torch.randn(TOKENS, HIDDEN), torch.rand(TOKENS), torch.randn(TOKENS, HIDDEN)
    fc1, fc2 = grouped.linear_fc1, grouped.linear_fc2

    def reference(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        out = []
        for e, (xe, pe) in enumerate(zip(x.split(COUNTS), probs.split(COUNTS), strict=True)):
            gate, up = (
                xe @ fc1.get_parameter(f"weight{e}").T + fc1.get_parameter(f"bias{e}")
            ).chunk(2, -1)
            act = F.silu(gate) * up * pe[:, None]
            b2 = fc2.get_parameter(f"bias{e}")
            out.append(act @ fc2.get_parameter(f"weight{e}").T + b2 * pe[:, None])
        return torch.cat(out)

    got = _run(grouped, x, probs, grad)
    grads = {n: p.grad.clone() for n, p in grouped.named_parameters()}
    grouped.zero_grad(set_to_none=True)
    xr, pr = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    ref = reference(xr, pr)
    ref.backward(grad)
    for a, b in zip(got, (ref, xr.grad, pr.grad), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for name, param in grouped.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("parallel", [{}, {"expert_model_parallel_size": 2}])
def test_parameter_attributes_match_megatron_expert_linears(megatron_cpu, parallel):
    config = _config(add_bias_linear=True, **parallel)
    sequential, grouped = _sequential_and_grouped(config)
    reference = sequential.local_experts[0]
    for name in ("linear_fc1", "linear_fc2"):
        local, megatron = getattr(grouped, name), getattr(reference, name)
        assert local.is_expert and megatron.is_expert
        for attribute in (
            "allreduce",
            "tensor_model_parallel",
            "partition_dim",
            "partition_stride",
        ):
            for e in range(EXPERTS):
                assert getattr(getattr(local, f"weight{e}"), attribute) == getattr(
                    megatron.weight, attribute
                ), (name, attribute)
        for e in range(EXPERTS):
            assert getattr(local, f"bias{e}").allreduce == megatron.bias.allreduce
    assert grouped.linear_fc1.weight0.allreduce is not bool(parallel)
    assert sorted(grouped.state_dict()) == sorted(
        f"linear_fc{i}.{p}{e}" for i in (1, 2) for p in ("weight", "bias") for e in range(EXPERTS)
    )


class _RecordingOffload:
    """Stands in for Megatron's offload interface (GPU-only) in TEGroupedMLP: records, per
    offload group, the tensors autograd saves inside it, which is what the real hooks move."""

    saved: dict[str, list[torch.Tensor]] = {}

    def __init__(self, offload: bool, tensor: torch.Tensor, name: str) -> None:
        self.offload, self.tensor, self.name = offload, tensor, name
        self._hooks: contextlib.AbstractContextManager[None] = contextlib.nullcontext()

    def __enter__(self) -> torch.Tensor:
        if self.offload:
            group = self.saved.setdefault(self.name, [])
            self._hooks = torch.autograd.graph.saved_tensors_hooks(
                lambda t: group.append(t) or t, lambda t: t
            )
            self._hooks.__enter__()
        return self.tensor

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def group_offload(self, tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return tensor


@pytest.fixture
def recording_offload(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[torch.Tensor]]]:
    monkeypatch.setattr(megatron_experts, "off_interface", _RecordingOffload)
    _RecordingOffload.saved = {}
    yield _RecordingOffload.saved


def test_expert_input_is_saved_whole_under_the_offload_hooks(megatron_cpu, recording_offload):
    _, grouped = _sequential_and_grouped(_config())
    grouped.offload_expert_fc1 = grouped.offload_moe_act = True  # FGO itself is GPU-only
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    out, _ = grouped(x, torch.tensor(COUNTS), torch.rand(TOKENS))
    out.sum().backward()

    fc1_saved = recording_offload["expert_fc1"]
    activations = [t for t in fc1_saved if not isinstance(t, torch.nn.Parameter)]
    # One activation: the whole input (same storage), no per-expert slices; the weights are
    # saved as the Parameters themselves, which the offload hooks skip.
    assert len(activations) == 1
    assert activations[0].shape == x.shape and activations[0].data_ptr() == x.data_ptr()
    weights = _weights(grouped.linear_fc1)
    assert [t for t in fc1_saved if isinstance(t, torch.nn.Parameter)] == weights
    # moe_act saves the fc1 output (or its GLU halves) whole, never one expert's rows.
    assert recording_offload["moe_act"]
    assert all(t.shape[0] == TOKENS for t in recording_offload["moe_act"])


def _expert_names() -> dict[str, str]:
    """TEGroupedMLP parameter name -> the SequentialMLP one holding the same expert weight."""
    names = {}
    for layer in range(2):
        prefix = f"decoder.layers.{layer}.mlp.experts."
        for e in range(4):
            for fc in ("linear_fc1", "linear_fc2"):
                names[f"{prefix}{fc}.weight{e}"] = f"{prefix}local_experts.{e}.{fc}.weight"
    return names


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_builder_uses_grouped_experts_for_moe_grouped_gemm(build_tiny, grouped_gemm):
    overrides = {"moe_grouped_gemm": True} if grouped_gemm else {}
    model, warnings = build_tiny("tiny-moe", seed=3, model_overrides=overrides)
    assert warnings == [] and model.config.moe_grouped_gemm is grouped_gemm
    for layer in model.decoder.layers:
        experts = layer.mlp.experts
        if grouped_gemm:
            assert isinstance(experts, TEGroupedMLP)
            assert isinstance(experts.linear_fc1, LocalColumnParallelGroupedLinear)
            assert isinstance(experts.linear_fc2, LocalRowParallelGroupedLinear)
        else:
            assert isinstance(experts, SequentialMLP)


def test_grouped_tiny_moe_matches_sequential_forward_and_backward(build_tiny, moe_globals_restored):
    grouped, _ = build_tiny("tiny-moe", seed=3, model_overrides={"moe_grouped_gemm": True})
    sequential, _ = build_tiny("tiny-moe", seed=3)
    names = _expert_names()
    state = grouped.state_dict()
    sequential.load_state_dict({names.get(k, k): v for k, v in state.items()})

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, grouped.vocab_size, (2, 24), generator=g)
    pos = torch.arange(24).expand(2, 24)
    losses = []
    for model in (grouped, sequential):
        per_token = model(ids, pos, None, labels=torch.roll(ids, -1, 1))
        per_token.sum().backward()
        losses.append(per_token)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    seq_params = dict(sequential.named_parameters())
    for name, param in grouped.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(
            param.grad, seq_params[names.get(name, name)].grad, atol=1e-5, rtol=1e-4, msg=name
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mm_path_equals_the_loop_on_gpu():
    """The torch._grouped_mm path (bfloat16 on CUDA) against the per-expert loop."""
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = (37, 0, 64, 5, 0, 150, 1, 63)
    x = torch.randn(sum(counts), 128, device="cuda", dtype=torch.bfloat16, generator=g)
    weights = [
        torch.randn(192, 128, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        for _ in counts
    ]
    grad = torch.randn(sum(counts), 192, device="cuda", dtype=torch.bfloat16, generator=g)
    results = []
    for grouped_mm in (True, False):
        xi = x.clone().requires_grad_(True)
        ws = [torch.nn.Parameter(w.clone()) for w in weights]
        out = _GroupedLinearFunction.apply(xi, counts, grouped_mm, *ws)
        out.backward(grad)
        results.append([out, xi.grad, *(w.grad for w in ws)])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert results[0][2 + 1].abs().max() == 0  # expert 1 had no tokens


@pytest.mark.parametrize("counts", [(6, 6, 6, 6), (5, 0, 7, 3), (9,), (0, 0)])
def test_offsets_are_the_end_rows_whether_made_on_the_device_or_copied(counts):
    """Equal counts (drop-and-pad) take the device-side path; both give the same end rows."""
    ends = _offsets(counts, torch.device("cpu"))
    expected = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    assert ends.dtype == torch.int32 and torch.equal(ends, expected)


def test_drop_and_pad_gives_the_experts_host_counts_of_their_capacity(
    build_tiny, moe_globals_restored
):
    """Drop-and-pad dispatch hands the grouped experts a host tensor of equal counts (nothing
    copied from the device, what a CUDA graph needs), and the step trains."""
    overrides = {
        "moe_grouped_gemm": True,
        "moe_expert_capacity_factor": 1.0,
        "moe_pad_expert_input_to_capacity": True,
    }
    model, _ = build_tiny("tiny-moe", seed=3, model_overrides=overrides)
    seen: list[torch.Tensor] = []
    for layer in model.decoder.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda _module, args: seen.append(args[1]))
    ids = torch.randint(0, model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).expand(2, 24)
    model(ids, pos, None, labels=torch.roll(ids, -1, 1)).sum().backward()
    assert len(seen) == len(model.decoder.layers)
    capacity = 2 * 24 * model.config.moe_router_topk // model.config.num_moe_experts
    for counts in seen:
        assert counts.device.type == "cpu"
        assert counts.tolist() == [capacity] * model.config.num_moe_experts
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mm_with_equal_counts_replays_in_a_cuda_graph():
    """Equal counts (drop-and-pad) let the grouped linear be captured: forward and backward
    replayed from a CUDA graph equal the eager pass."""
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = (64,) * 8
    x = torch.randn(sum(counts), 128, device="cuda", dtype=torch.bfloat16, generator=g)
    weights = [
        torch.nn.Parameter(torch.randn(192, 128, device="cuda", dtype=torch.bfloat16) * 0.1)
        for _ in counts
    ]
    grad = torch.randn(sum(counts), 192, device="cuda", dtype=torch.bfloat16, generator=g)
    static_x = x.clone().requires_grad_(True)

    def step() -> list[torch.Tensor]:
        static_x.grad = None
        for w in weights:
            w.grad = None
        out = _GroupedLinearFunction.apply(static_x, counts, True, *weights)
        out.backward(grad)
        return [out, static_x.grad, *(w.grad for w in weights)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = [t.clone() for t in step()]  # warm-up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, expected in zip(captured, eager, strict=True):
        assert torch.equal(got, expected)
