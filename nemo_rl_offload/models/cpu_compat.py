"""Run Megatron-core's local layer spec on CPU workers (tests, functional runs, laptops).

Megatron-core 0.19 assumes CUDA in a handful of places; rather than replacing ``torch.cuda`` for
the whole process, the patches replace names inside the Megatron modules that need them.
:func:`enable_cpu_execution` applies them (idempotent) and :func:`disable_cpu_execution`
restores what was there. The patches and why: docs/design/local_layer_spec.md.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator
from typing import Any

import torch

_TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
# Modules whose module-global ``torch`` is replaced by the CPU stand-in (patch 1).
CUDA_DEVICE_MODULES: tuple[str, ...] = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq placement
    "megatron.core.transformer.dot_product_attention",  # softmax offset (non-vanilla softmax)
    "megatron.core.transformer.moe.router",  # router weights and aux-loss counters
    _TOKEN_DISPATCHER,  # all-to-all D2H side stream (cached on the class)
    "megatron.core.distributed.param_and_grad_buffer",  # DDP's gradient buffers
    "megatron.core.distributed.distributed_data_parallel",  # DDP's communication stream
    "megatron.core.pipeline_parallel.p2p_communication",  # pipeline stages' receive buffers
    "megatron.core.tensor_parallel.mappings",  # all-gather outputs (vocabulary, experts)
    "megatron.core.tensor_parallel.layers",  # sequence-parallel gradient reduce-scatter outputs
)
# Modules whose module-global ``torch`` also moves ``device="cuda"`` allocations to the CPU
# (patch 5).
CUDA_ALLOCATION_MODULES: tuple[str, ...] = (
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor, the local multi-tensor L2 norm
    "megatron.core.optimizer.optimizer",  # loss scale, found-inf flag
    "megatron.core.optimizer.clip_grads",  # gradient-norm accumulators
)
_OPTIMIZER = "megatron.core.optimizer.optimizer"
# ModelOpt's megatron plugin (patch 8, enable_cpu_modelopt).
_MODELOPT_STATE_MODULE = "modelopt.torch.opt.plugins.megatron"
_FUSED_SOFTMAX = "megatron.core.fusions.fused_softmax"
_RANDOM = "megatron.core.tensor_parallel.random"
# Modules that import get_pos_emb_on_this_cp_rank by name (patch 7).
_ROTARY_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
# Megatron modules a schedule call runs that allocate on "cuda" by name (cpu_schedule_allocations).
_SCHEDULE_CALL_MODULES = (_SCHEDULES, "megatron.core.transformer.multi_token_prediction")

# (module or class, attribute) -> the original value, while the patches are on.
_saved: dict[tuple[Any, str], Any] = {}


class _CpuEvent:
    """A CUDA event stand-in: on one CPU stream everything has already happened."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """The one CPU "stream": waiting on it or recording into it is a no-op."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


class _CpuCuda:
    """``torch.cuda`` as the patched modules see it: the CPU is the current device and its only
    stream; every other attribute is the real ``torch.cuda``."""

    Event = _CpuEvent

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 (mirrors torch.cuda)
        return _CPU_STREAM

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _CpuStream:
        return _CPU_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


class _CpuTorch(types.ModuleType):
    """``torch`` with :class:`_CpuCuda` as its ``cuda``; everything else is the real torch."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _on_cpu(device: Any) -> Any:
    """``device`` with "cuda" replaced by "cpu" (anything else unchanged)."""
    if device is not None and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _CpuAllocTorch(_CpuTorch):
    """``torch`` for modules that allocate on ``device="cuda"`` by name (the pipeline
    schedules' token counter, the optimizer's loss scale and found-inf flags, the
    gradient-norm buffers): those tensors land on the CPU."""

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def ones(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.ones(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def empty(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, device=_on_cpu(device), **kwargs)


def _cpu_clip_grad_by_total_norm(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Megatron's clip_grad_by_total_norm_fp32 without its CUDA-tensor assertion: scale every
    gradient by max_norm / total_norm when that is below 1 (the same arithmetic)."""
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (float(total_norm) + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for param in [parameters] if isinstance(parameters, torch.Tensor) else parameters:
        grad = getattr(param, attribute, None)
        if grad is not None:
            grad.detach().mul_(clip_coeff)


class CpuRngTracker:
    """Megatron's model-parallel RNG tracker for CPU workers (patch 3): names and seeds are
    recorded (so a duplicate seed still fails loudly, as upstream), ``fork`` draws from torch's
    CPU generator."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seeds_: set[int] = set()
        self.states_: dict[str, Any] = {}
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = seed
        self._is_initialized = True

    def get_states(self) -> dict[str, Any]:
        return dict(self.states_)

    def set_states(self, states: dict[str, Any]) -> None:
        self.states_ = dict(states)
        self._is_initialized = True

    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """True above the diagonal: the positions a query may not attend to (Megatron's convention)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_split_sizes(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """The all-to-all dispatcher's ``maybe_move_tensor_to_cpu`` for CPU tensors: its split
    sizes become numpy arrays as they do after the device-to-host copy on GPU (the collective
    takes a sequence of ints, not a tensor); there is nothing to copy."""
    if as_numpy and isinstance(tensor, torch.Tensor):
        return tensor.numpy()
    return tensor


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> Any:
    """Megatron's ``get_pos_emb_on_this_cp_rank`` with the index on ``pos_emb``'s device."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    chunks = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1 :])
    chunks = chunks.index_select(seq_dim, index)
    return chunks.view(*shape[:seq_dim], -1, *shape[seq_dim + 1 :])


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def _patch(owner: Any, attribute: str, value: Any) -> None:
    """Set ``owner.attribute`` (owner: a module name or a class), remembering the original."""
    target = importlib.import_module(owner) if isinstance(owner, str) else owner
    _saved[(target, attribute)] = getattr(target, attribute)
    setattr(target, attribute, value)


def cpu_execution_enabled() -> bool:
    """Whether :func:`enable_cpu_execution` is in force."""
    return bool(_saved)


def enable_cpu_execution() -> None:
    """Apply the CPU patches (numbered in docs/design/local_layer_spec.md; idempotent)."""
    if _saved:
        return
    cpu_torch = _CpuTorch()
    for module_name in CUDA_DEVICE_MODULES:
        _patch(module_name, "torch", cpu_torch)
    alloc_torch = _CpuAllocTorch()
    for module_name in CUDA_ALLOCATION_MODULES:
        _patch(module_name, "torch", alloc_torch)
    _patch(_OPTIMIZER, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm)
    # The all-to-all dispatcher caches its side stream on the class: start without one, so CPU
    # models get the stand-in, and give a GPU model in the same process its CUDA stream back.
    dispatcher = importlib.import_module(_TOKEN_DISPATCHER).MoEAlltoAllTokenDispatcher
    _patch(dispatcher, "cuda_dtoh_stream", None)
    _patch(_TOKEN_DISPATCHER, "maybe_move_tensor_to_cpu", _cpu_split_sizes)
    _patch(_FUSED_SOFTMAX, "get_default_causal_mask", _cpu_causal_mask)
    for module_name in _ROTARY_MODULES:
        _patch(module_name, "get_pos_emb_on_this_cp_rank", _cpu_pos_emb_on_this_cp_rank)
    _patch(_RANDOM, "_CUDA_RNG_STATE_TRACKER", CpuRngTracker())
    _patch(_RANDOM, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    _patch(_RANDOM, "_get_cuda_rng_state", _no_cuda_rng_state)
    _patch(_RANDOM, "_set_cuda_rng_state", _no_cuda_rng_state)


def enable_cpu_modelopt() -> None:
    """Patch 8 (with the CPU patches in force; undone with them): ModelOpt's megatron plugin
    sees the CPU stand-in ``torch`` of patch 1, so that a quantized model's state dict (which
    serialises each quantizer's state after ``torch.cuda.synchronize``) is made on CPU
    workers. Idempotent."""
    if not _saved:
        raise RuntimeError("enable_cpu_modelopt needs enable_cpu_execution first")
    target = importlib.import_module(_MODELOPT_STATE_MODULE)
    if (target, "torch") not in _saved:
        _patch(_MODELOPT_STATE_MODULE, "torch", _CpuTorch())


def disable_cpu_execution() -> None:
    """Undo :func:`enable_cpu_execution`, restoring every patched name (for tests)."""
    for (target, attribute), original in reversed(list(_saved.items())):
        setattr(target, attribute, original)
    _saved.clear()


@contextlib.contextmanager
def cpu_schedule_allocations() -> Iterator[None]:
    """While active, Megatron's pipeline schedules and its multi-token prediction see a
    ``torch`` whose ``zeros`` puts ``device="cuda"`` tensors on the CPU (and whose
    ``torch.cuda`` is the CPU stand-in).

    The schedules allocate their token counter (``total_num_tokens``) on "cuda"
    unconditionally; nothing else in the no-pipelining schedule needs a GPU. Multi-token
    prediction (``mtp_num_layers``) makes its metrics' buffers and, under context parallelism,
    the boundary tokens it exchanges between ranks on the current CUDA device. Scoped to one
    call so that a GPU run in the same process never sees it.
    """
    modules = [importlib.import_module(name) for name in _SCHEDULE_CALL_MODULES]
    previous = [module.torch for module in modules]
    stand_in = _CpuAllocTorch()
    for module in modules:
        module.torch = stand_in
    try:
        yield
    finally:
        for module, torch_module in zip(modules, previous, strict=True):
            module.torch = torch_module


_CHECKPOINT_IO_MODULES: tuple[str, ...] = (
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # synchronize after D2H
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # failure flag on "cuda"
)


@contextlib.contextmanager
def cpu_checkpoint_io() -> Iterator[None]:
    """While active, Megatron's distributed-checkpoint writer sees the CPU stand-in ``torch``
    (``torch.cuda.synchronize`` a no-op, ``device="cuda"`` allocations on the CPU).

    Its torch_dist save waits for the device-to-host copies of the tensors it writes
    (``torch.cuda.synchronize``) and broadcasts its failure flag as a tensor on the current
    CUDA device: on CPU workers there is nothing to wait for and the CPU is the device. Scoped
    to one save or load, so a GPU model in the same process never sees it.
    """
    modules = [importlib.import_module(name) for name in _CHECKPOINT_IO_MODULES]
    previous = [module.torch for module in modules]
    stand_in = _CpuAllocTorch()
    for module in modules:
        module.torch = stand_in
    try:
        yield
    finally:
        for module, original in zip(modules, previous, strict=True):
            module.torch = original


@contextlib.contextmanager
def params_typed_as_cuda(params: Any) -> Iterator[None]:
    """While active, each of ``params`` answers ``.type()`` with the CUDA tensor type name of
    its dtype (``torch.cuda.FloatTensor`` for a CPU float32 tensor); ``.type(dtype)`` casts
    as usual.

    Megatron's DistributedOptimizer sorts the parameters it shards into float16 and float32
    groups by their type names and refuses any that are not CUDA tensors; nothing else in it
    needs a GPU (its gradient reduce-scatter and parameter all-gather run on gloo). The
    answer is set on the parameter objects themselves, for the optimizer's construction only:
    no Megatron or torch name is replaced.
    """
    params = list(params)

    def cuda_type(param: torch.Tensor) -> Any:
        def type_(*args: Any, **kwargs: Any) -> Any:
            if args or kwargs:
                return torch.Tensor.type(param, *args, **kwargs)
            return torch.Tensor.type(param).replace("torch.", "torch.cuda.", 1)

        return type_

    for param in params:
        param.type = cuda_type(param)
    try:
        yield
    finally:
        for param in params:
            del param.type
