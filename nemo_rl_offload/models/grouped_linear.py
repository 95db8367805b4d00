"""Pure-PyTorch grouped expert linears, so that Megatron's TEGroupedMLP runs without Transformer
Engine, and with it the fine-grained offloading of the expert activations.

megatron-core offloads ``expert_fc1`` and ``moe_act`` only inside TEGroupedMLP, which needs only
builders for its two grouped linears: this module provides them, and
:func:`local_grouped_experts` the experts builder for the local spec. How the linears follow
Transformer Engine's: docs/design/local_layer_spec.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide, get_pg_rank, get_pg_size

from nemo_rl_offload.models.discard_checkpoint import OwnCheckpoint

# torch._grouped_mm's kernels need every matrix's leading stride to be a multiple of 16 bytes
# (8 bfloat16 elements); see the checks in torch/_meta_registrations.py.
_GROUPED_MM_ALIGNMENT = 8


def _use_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can do this call: bfloat16 on an SM 8.0+ CUDA device, with
    16-byte aligned strides. Everything else (CPU, float32, odd sizes) takes the loop."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.shape[0] > 0
        and x.shape[1] % _GROUPED_MM_ALIGNMENT == 0
        and weight.shape[0] % _GROUPED_MM_ALIGNMENT == 0
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned (a copy only when it is not)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """End row of each expert's chunk, as ``torch._grouped_mm`` wants them (int32).

    Equal counts (drop-and-pad dispatch: every expert takes exactly its capacity) are made on
    the device by a kernel, not copied from the host: a host-to-device copy of a Python list
    synchronises, which a CUDA graph capture cannot hold."""
    if counts and all(n == counts[0] for n in counts):
        ends = torch.arange(1, len(counts) + 1, dtype=torch.int32, device=device)
        return ends.mul_(counts[0])
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _grouped_mm_forward(
    x: torch.Tensor, weights: Sequence[torch.Tensor], offs: torch.Tensor
) -> torch.Tensor:
    """[T, in] x per-expert [out, in] -> [T, out]; mat_b is [E, in, out] (the transposed,
    column-major view of the stacked weights)."""
    return torch._grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs=offs)


def _grouped_mm_dgrad(
    dy: torch.Tensor, weights: Sequence[torch.Tensor], offs: torch.Tensor
) -> torch.Tensor:
    """[T, out] x per-expert [out, in] -> [T, in]; mat_b is the stacked weights [E, out, in]."""
    return torch._grouped_mm(dy, torch.stack(weights), offs=offs)


def _grouped_mm_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per expert dy_e^T @ x_e -> [E, out, in]: both operands 2-D, the token dimension (mat_a's
    columns, mat_b's rows) split by ``offs``."""
    return torch._grouped_mm(dy.t(), x, offs=offs)


class _GroupedLinearFunction(torch.autograd.Function):
    """out[rows of expert e] = x[rows of expert e] @ weight_e^T (+ bias_e).

    Saves exactly the whole input ``x`` and the weight Parameters (which the offload hooks skip),
    so the activation offloading sees one tensor: not per-expert views, not stacked weights.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        counts: tuple[int, ...],
        grouped_mm: bool,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        num_experts = len(counts)
        weights, biases = params[:num_experts], params[num_experts:]
        # A plain attribute, not save_for_backward: a few bytes the offload hooks need not see.
        ctx.offs = _offsets(counts, x.device) if grouped_mm else None
        if grouped_mm:
            out = _grouped_mm_forward(_aligned(x), weights, ctx.offs)
        else:
            out = x.new_empty(x.shape[0], weights[0].shape[0])
            for chunk, w, out_chunk in zip(
                x.split(counts), weights, out.split(counts), strict=True
            ):
                torch.mm(chunk, w.t(), out=out_chunk)
        if biases:
            for b, out_chunk in zip(biases, out.split(counts), strict=True):
                out_chunk.add_(b)
        ctx.counts = counts
        ctx.grouped_mm = grouped_mm
        ctx.has_bias = bool(biases)
        ctx.save_for_backward(x, *weights)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        counts: tuple[int, ...] = ctx.counts
        needs_dx, needs_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:])
        dx = None
        dws: list[torch.Tensor | None] = [None] * len(weights)
        if ctx.grouped_mm:
            dy, offs = _aligned(grad_output), ctx.offs
            if needs_dx:
                dx = _grouped_mm_dgrad(dy, weights, offs)
            if needs_dw:
                dw = _grouped_mm_wgrad(dy, _aligned(x), offs)
                for e, n in enumerate(counts):
                    if n == 0:  # do not rely on the kernel writing empty groups
                        dw[e].zero_()
                dws = list(dw.unbind(0))
        else:
            dy = grad_output
            if needs_dx:
                dx = x.new_empty(x.shape)
                for dy_chunk, w, dx_chunk in zip(
                    dy.split(counts), weights, dx.split(counts), strict=True
                ):
                    torch.mm(dy_chunk, w, out=dx_chunk)
            if needs_dw:  # a zero-token expert gets [out, 0] @ [0, in] = zeros
                dws = [
                    dy_chunk.t().mm(x_chunk)
                    for dy_chunk, x_chunk in zip(dy.split(counts), x.split(counts), strict=True)
                ]
        dbs: list[torch.Tensor] = []
        if ctx.has_bias:
            dbs = [dy_chunk.sum(0) for dy_chunk in grad_output.split(counts)]
        return (dx, None, None, *dws, *dbs)


class _LocalGroupedLinear(torch.nn.Module):
    """Shared body of the column- and row-parallel local grouped linears (see the module
    docstring). ``partition_dim`` 0 splits the output features over the expert-TP group
    (column-parallel), 1 the input features (row-parallel)."""

    partition_dim: int

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        pg_collection: ProcessGroupCollection | None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if not is_expert:
            raise ValueError(f"{type(self).__name__} is for MoE experts only (is_expert=True)")
        if config.gradient_accumulation_fusion:
            raise ValueError(
                f"{type(self).__name__} does not support gradient_accumulation_fusion (it "
                "leaves ordinary .grad for Megatron's DDP to copy); set "
                "gradient_accumulation_fusion=False"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.config = config
        self.name = name
        self.is_expert = True
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.skip_bias_add = skip_bias_add
        self.use_bias = bias
        self.num_gemms = num_local_experts
        # Megatron sets it True to keep TE from saving quantized inputs; unused here (the
        # input is always saved as it came), but TEGroupedMLP needs the attribute to exist.
        self.save_original_input = False
        tp_group = pg_collection.expt_tp
        tp_size, tp_rank = get_pg_size(tp_group), get_pg_rank(tp_group)
        self.tp_size = tp_size
        if self.partition_dim == 0:
            self.in_features, self.out_features = input_size, divide(output_size, tp_size)
        else:
            self.in_features, self.out_features = divide(input_size, tp_size), output_size
        # Gradients go to the expert data-parallel group exactly as for Megatron's own expert
        # linears (ColumnParallelLinear/RowParallelLinear with is_expert=True, TEGroupedLinear).
        use_expert_pgs = self.expert_parallel or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        # Megatron's MLP builds a gated fc1 with stride 2: each rank holds its [gate, up] rows.
        stride = 2 if self.partition_dim == 0 and config.gated_linear_unit else 1
        device = None if config.use_cpu_initialization else torch.cuda.current_device()

        for e in range(num_local_experts):
            weight = torch.nn.Parameter(
                torch.empty(
                    self.out_features, self.in_features, device=device, dtype=config.params_dtype
                )
            )
            if not config.perform_initialization:
                set_tensor_model_parallel_attributes(weight, True, self.partition_dim, stride)
            elif config.use_cpu_initialization:
                # Each expert's full [output_size, input_size] master weight, then this rank's
                # shard, as ColumnParallelLinear/RowParallelLinear do (no RNG fork on the CPU).
                _initialize_affine_weight_cpu(
                    weight,
                    output_size,
                    input_size,
                    self.out_features if self.partition_dim == 0 else self.in_features,
                    self.partition_dim,
                    init_method,
                    stride=stride,
                    params_dtype=config.params_dtype,
                    rank=tp_rank,
                    world_size=tp_size,
                )
            else:  # the local shard, drawn from the expert-parallel RNG tracker
                _initialize_affine_weight_gpu(
                    weight, init_method, self.partition_dim, stride=stride, is_expert=True
                )
            weight.allreduce = not use_expert_pgs
            self.register_parameter(f"weight{e}", weight)

        for e in range(num_local_experts if bias else 0):
            b = torch.nn.Parameter(
                torch.zeros(self.out_features, device=device, dtype=config.params_dtype)
            )
            if self.partition_dim == 0:  # column-parallel bias is sharded with the output
                set_tensor_model_parallel_attributes(b, True, 0, stride)
            b.allreduce = not use_expert_pgs
            self.register_parameter(f"bias{e}", b)

    @property
    def weights(self) -> list[torch.Tensor]:
        """The experts' weights, in expert order."""
        return [getattr(self, f"weight{e}") for e in range(self.num_gemms)]

    @property
    def biases(self) -> list[torch.Tensor]:
        """The experts' biases, in expert order (empty without bias)."""
        return [getattr(self, f"bias{e}") for e in range(self.num_gemms)] if self.use_bias else []

    def forward(
        self, x: torch.Tensor, tokens_per_expert: Sequence[int] | torch.Tensor, /
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Rows of ``x`` grouped by expert (``tokens_per_expert`` rows each, in order) ->
        (output, None), or (output, per-expert biases) with ``skip_bias_add`` and bias; the
        caller adds those (TEGroupedMLP._apply_bias), as with TE's GroupedLinear."""
        if isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = tokens_per_expert.tolist()
        counts = tuple(int(n) for n in tokens_per_expert)
        if len(counts) != self.num_gemms:
            raise ValueError(f"tokens_per_expert has {len(counts)} entries, not {self.num_gemms}")
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if sum(counts) != x2d.shape[0]:
            raise ValueError(
                f"tokens_per_expert sums to {sum(counts)} but the input has {x2d.shape[0]} rows"
            )
        weights = self.weights
        add_bias = self.use_bias and not self.skip_bias_add
        params = weights + (self.biases if add_bias else [])
        out = self._products(x2d, counts, params)
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        if self.use_bias and self.skip_bias_add:
            return out, self.biases
        return out, None

    def _products(
        self, x2d: torch.Tensor, counts: tuple[int, ...], params: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """The experts' products (the seam models.fp8_linear overrides with FP8 ones)."""
        return _GroupedLinearFunction.apply(x2d, counts, _use_grouped_mm(x2d, params[0]), *params)

    def backward_dw(self) -> None:
        """No-op: weight gradients are computed in the backward pass, never delayed."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> Any:
        """Not implemented: refuse rather than write a checkpoint without expert sharding."""
        raise NotImplementedError(
            f"{type(self).__name__}: distributed checkpointing (sharded_state_dict) is not "
            "implemented for the local grouped linears; use state_dict()"
        )

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_gemms}, in={self.in_features}, out={self.out_features}, "
            f"bias={self.use_bias}, expert_tp={self.tp_size}"
        )


class LocalColumnParallelGroupedLinear(_LocalGroupedLinear):
    """Grouped ``linear_fc1`` of TEGroupedMLP: output features split over expert TP."""

    partition_dim = 0


class LocalRowParallelGroupedLinear(_LocalGroupedLinear):
    """Grouped ``linear_fc2`` of TEGroupedMLP: input features split over expert TP."""

    partition_dim = 1


class LocalGroupedMLP(TEGroupedMLP):
    """Megatron's TEGroupedMLP whose ``moe_act`` recompute runs without Transformer Engine:
    its forward assigns a ``CheckpointWithoutOutput`` to ``activation_checkpoint``, which
    cannot run without TE in megatron-core 0.19 (models/discard_checkpoint.py says why); this
    attribute holds the package's output-discarding checkpoint in its place. Megatron's forward
    runs unchanged (fingerprinted: owned.RECOMPUTE_FINGERPRINTS["moe_act"])."""

    activation_checkpoint = OwnCheckpoint()


def local_grouped_experts() -> functools.partial:
    """The experts builder for the local spec: :class:`LocalGroupedMLP` with the local grouped
    linears."""
    return functools.partial(
        LocalGroupedMLP,
        submodules=GroupedMLPSubmodules(
            linear_fc1=LocalColumnParallelGroupedLinear,
            linear_fc2=LocalRowParallelGroupedLinear,
        ),
    )


def with_local_grouped_experts(moe_spec: functools.partial) -> functools.partial:
    """``moe_spec`` (``partial(MoELayer, submodules=MoESubmodules(...))``, Megatron's MoE spec)
    with its experts replaced by :func:`local_grouped_experts`; the rest is unchanged."""
    submodules = dataclasses.replace(
        moe_spec.keywords["submodules"], experts=local_grouped_experts()
    )
    return functools.partial(
        moe_spec.func, *moe_spec.args, **{**moe_spec.keywords, "submodules": submodules}
    )
