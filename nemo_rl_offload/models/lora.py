"""LoRA adapters on the local layer spec's linears (``policy.megatron_cfg.peft``).

Each adapted linear is a subclass of Megatron's parallel linear that the layer spec places
(:func:`with_lora`): ``base(x) + scale * B(A(dropout(x)))``, the adapter split like its linear.
:func:`prepare` freezes every other parameter, and :func:`merged_state_dict` folds the adapters
into the base weights for export. How it runs under tensor parallelism: docs/lora.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from nemo_rl_offload.config.peft import COLUMN_PARALLEL, LINEARS, LoraSettings

ADAPTER_PARAMS = ("lora_a", "lora_b")
MLP_LINEARS = ("linear_fc1", "linear_fc2")


class _Adapter:
    """What both adapted linears share: the adapter's weights, its dropout and its scale."""

    lora: LoraSettings
    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    lora_name: str

    def _add_adapter(
        self,
        settings: LoraSettings,
        name: str,
        a_shape: tuple,
        b_shape: tuple,
        split: tuple[str, int],
    ) -> None:
        """Make A (``a_shape``) and B (``b_shape``), the one named in ``split`` marked as
        split over tensor-parallel ranks along that dimension (Megatron counts such a weight
        on every rank in the gradient norm, a replicated one on the first rank only)."""
        config = self.config  # type: ignore[attr-defined]
        self.lora = settings
        self.lora_name = name
        kwargs = {"dtype": config.params_dtype, "device": _init_device(config)}
        self.lora_a = torch.nn.Parameter(torch.zeros(a_shape, **kwargs))
        self.lora_b = torch.nn.Parameter(torch.zeros(b_shape, **kwargs))
        for param_name in ADAPTER_PARAMS:
            param = getattr(self, param_name)
            parallel = param_name == split[0]
            set_tensor_model_parallel_attributes(param, parallel, split[1] if parallel else -1, 1)
        self.lora_dropout = torch.nn.Dropout(settings.dropout)  # type: ignore[attr-defined]

    def _dropout(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        """Dropout of ``x``; where ``x`` is this rank's part of a tensor (``split``), from the
        tensor-parallel generator, so ranks drop different elements (as Megatron's attention
        dropout does)."""
        if self.lora.dropout == 0 or not self.training:  # type: ignore[attr-defined]
            return x
        if split and x.is_cuda and parallel_state.get_tensor_model_parallel_world_size() > 1:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.lora_dropout(x)  # type: ignore[attr-defined]
        return self.lora_dropout(x)  # type: ignore[attr-defined]

    def _update(
        self, input_: torch.Tensor, collective: Any, input_split: bool, output_split: bool
    ) -> torch.Tensor:
        """``scale * B(collective(A(x)))`` with the dropout on ``x`` or on the result: the
        adapter's path beside the base linear. ``collective`` joins A's output over the
        tensor-parallel group as the linear's split needs; ``input_split``/``output_split``:
        whether ``x``/the result are this rank's part (dropout from the tensor-parallel
        generator)."""
        pre = self.lora.dropout_position == "pre"
        x = self._dropout(input_, split=input_split) if pre else input_
        low = collective(torch.nn.functional.linear(x, self.lora_a), group=self.tp_group)  # type: ignore[attr-defined]
        update = torch.nn.functional.linear(low, self.lora_b) * self.lora.scale
        return update if pre else self._dropout(update, split=output_split)


def _init_device(config: Any) -> Any:
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


class LoraColumnParallelLinear(_Adapter, ColumnParallelLinear):
    """A column-parallel linear (qkv, fc1) with a LoRA adapter: A whole, B split."""

    def __init__(self, *args: Any, lora: LoraSettings, lora_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.gather_output:
            raise ValueError(f"{lora_name}: an adapted column-parallel linear keeps its split")
        self._add_adapter(
            lora,
            lora_name,
            (lora.dim, self.input_size),
            (self.output_size_per_partition, lora.dim),
            split=("lora_b", 0),
        )
        if self.sequence_parallel:
            self.lora_a.sequence_parallel = True

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(input_, *args, **kwargs)
        if self.sequence_parallel:
            collective = mappings.gather_from_sequence_parallel_region
        else:
            collective = mappings.copy_to_tensor_model_parallel_region
        update = self._update(input_, collective, self.sequence_parallel, output_split=True)
        return output + update.to(output.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):  # noqa: ANN001, ANN201
        """Megatron's (weight and bias split along the output) with B split likewise. A gated
        fc1's rows are [gate; up], each split over ranks (Megatron's MLP re-shards its weight
        so with its swiglu factory); B's rows follow the weight's, so B gets the same."""
        sharded = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0, "bias": 0, "lora_b": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.lora_name == "linear_fc1" and self.config.gated_linear_unit:
            key = f"{prefix}lora_b"
            sharded[key] = apply_swiglu_sharded_factory(
                sharded[key],
                sharded_offsets,
                metadata.get("singleton_local_shards", False),
                tp_group=self.tp_group,
                dp_group=metadata["dp_cp_group"],
            )
        return sharded


class LoraRowParallelLinear(_Adapter, RowParallelLinear):
    """A row-parallel linear (proj, fc2) with a LoRA adapter: A split, B whole."""

    def __init__(self, *args: Any, lora: LoraSettings, lora_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._add_adapter(
            lora,
            lora_name,
            (lora.dim, self.input_size_per_partition),
            (self.output_size, lora.dim),
            split=("lora_a", 1),
        )
        if self.sequence_parallel:
            self.lora_b.sequence_parallel = True

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(input_, *args, **kwargs)
        if self.sequence_parallel:
            collective = mappings.reduce_scatter_to_sequence_parallel_region
        else:
            collective = mappings.reduce_from_tensor_model_parallel_region
        update = self._update(input_, collective, True, output_split=self.sequence_parallel)
        return output + update.to(output.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):  # noqa: ANN001, ANN201
        """Megatron's (weight split along the input) with A split likewise."""
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 1, "lora_a": 1},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


def _adapted(module: Any, name: str, settings: LoraSettings) -> Any:
    """The spec entry for linear ``name`` (Megatron's class ``module``): the adapted subclass
    with its settings, or ``module`` as it was when ``name`` carries no adapter."""
    if name not in settings.targets:
        return module
    expected = ColumnParallelLinear if name in COLUMN_PARALLEL else RowParallelLinear
    if module is not expected:
        raise ValueError(f"{name}: the layer spec builds {module}, not {expected.__name__}")
    cls = LoraColumnParallelLinear if name in COLUMN_PARALLEL else LoraRowParallelLinear
    return ModuleSpec(module=cls, params={"lora": settings, "lora_name": name})


def with_lora(spec: Any, settings: LoraSettings) -> Any:
    """The layer spec ``spec`` (a dense local-spec layer, before this package's MLP subclasses
    wrap its MLP builder) with adapters on ``settings.targets``."""
    attention = spec.submodules.self_attention.submodules
    for name in ("linear_qkv", "linear_proj"):
        setattr(attention, name, _adapted(getattr(attention, name), name, settings))
    mlp = spec.submodules.mlp  # functools.partial(MLP.as_mlp_submodule, submodules=...)
    submodules = mlp.keywords["submodules"]
    adapted = dataclasses.replace(
        submodules,
        **{name: _adapted(getattr(submodules, name), name, settings) for name in MLP_LINEARS},
    )
    spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, submodules=adapted)
    return spec


def adapted_linears(model: Any) -> Iterator[tuple[int, Any]]:
    """Every adapted linear of ``model`` with its layer's global number."""
    for layer in model.decoder.layers:
        for module in layer.modules():
            if isinstance(module, _Adapter):
                yield layer.layer_number, module


def prepare(model: Any) -> None:
    """Freeze every parameter of ``model`` but the adapters', and initialise the adapters: A
    xavier-uniform (Megatron-Bridge's ``xavier``) from a generator seeded by torch's seed, the
    layer and the linear (the same whole A on every layout, this rank taking its part), B
    zero."""
    for name, param in model.named_parameters():
        param.requires_grad = name.rsplit(".", 1)[-1] in ADAPTER_PARAMS
    seed = torch.initial_seed()
    for number, linear in adapted_linears(model):
        generator = torch.Generator().manual_seed(
            (seed * 1009 + number * 17 + LINEARS.index(linear.lora_name)) % 2**63
        )
        whole_in = linear.input_size
        whole = torch.empty(linear.lora.dim, whole_in)
        limit = math.sqrt(6.0 / (whole_in + linear.lora.dim))  # xavier (Glorot) uniform
        whole.uniform_(-limit, limit, generator=generator)
        if isinstance(linear, LoraRowParallelLinear):
            part = linear.input_size_per_partition
            rank = parallel_state.get_tensor_model_parallel_rank()
            whole = whole[:, rank * part : (rank + 1) * part]
        with torch.no_grad():
            linear.lora_a.copy_(whole)
            linear.lora_b.zero_()


def is_adapter_key(key: str) -> bool:
    """A state-dict key of an adapter weight (not in a Hugging Face checkpoint)."""
    return key.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def merged_state_dict(model: Any) -> dict[str, Any]:
    """``model``'s state dict (one rank, no tensor parallelism) with each adapter folded into
    its linear's weight (``W + scale * B A``) and the adapter keys left out: the weights of
    the plain model that computes what the adapted one does (without dropout)."""
    state = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}
    for prefix, module in model.named_modules():
        if isinstance(module, _Adapter):
            weight = state[f"{prefix}.weight"]
            delta = module.lora_b.detach().float() @ module.lora_a.detach().float()
            state[f"{prefix}.weight"] = (weight.float() + module.lora.scale * delta).to(
                weight.dtype
            )
    return state
