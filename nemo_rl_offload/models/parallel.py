"""Megatron-core's parallel state (TP/PP/CP/EP process groups) and model-parallel RNG seeds.

A worker first initialises ``torch.distributed`` itself (nccl on GPU workers, gloo on CPU ones:
that choice belongs to whoever knows the device), then calls
:func:`initialize_megatron_parallel` once before building a model, and
:func:`destroy_megatron_parallel` at teardown.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)


def initialize_megatron_parallel(
    megatron_cfg: dict[str, Any], *, seed: int, on_gpu: bool, cudagraphable_rng: bool = False
) -> None:
    """Create Megatron's process groups from ``megatron_cfg`` and seed every RNG with ``seed``.

    Sizes default to 1; ``expert_tensor_parallel_size`` None means "same as tensor parallel"
    (Megatron's rule). Python's and torch's CPU generators get ``seed`` on every rank, because
    CPU-initialised weights are drawn whole and then sliced per tensor-parallel rank, so all
    ranks must draw the same numbers. Megatron's model-parallel tracker then derives its
    per-rank streams from the same seed: CUDA generator states on GPU; on CPU the tracker of
    :mod:`nemo_rl_offload.models.cpu_compat` (enabled here), where every draw uses the CPU
    generator. ``cudagraphable_rng`` keeps the tracker's states as generators a CUDA graph can
    register (needed when training steps are captured: Megatron does the same).
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError(
            "initialize_megatron_parallel: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (nccl on GPU workers, gloo on CPU)"
        )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    sizes = {name: int(megatron_cfg.get(name) or 1) for name in _PARALLEL_SIZES}
    expert_tp = megatron_cfg.get("expert_tensor_parallel_size")
    if not on_gpu:
        from nemo_rl_offload.models.cpu_compat import enable_cpu_execution

        enable_cpu_execution()
    if parallel_state.model_parallel_is_initialized():
        # A second model in this process (e.g. a copy trained side by side in a test) joins
        # the existing groups, which must be the ones it asks for.
        current = {
            "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "context_parallel_size": parallel_state.get_context_parallel_world_size(),
            "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        }
        wanted = {name: sizes[name] for name in current}
        if current != wanted:
            raise RuntimeError(
                f"initialize_megatron_parallel: this process already has parallel groups "
                f"{current}; a second model cannot ask for {wanted}"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes["tensor_model_parallel_size"],
            pipeline_model_parallel_size=sizes["pipeline_model_parallel_size"],
            context_parallel_size=sizes["context_parallel_size"],
            expert_model_parallel_size=sizes["expert_model_parallel_size"],
            expert_tensor_parallel_size=None if expert_tp is None else int(expert_tp),
        )
    random.seed(seed)
    torch.manual_seed(seed)
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = getattr(megatron_random, "_CUDA_RNG_STATE_TRACKER", None)
    # A second model in this process that wants the other kind of tracker replaces it.
    switch = (
        tracker is not None
        and getattr(tracker, "use_cudagraphable_rng", False) != cudagraphable_rng
    )
    model_parallel_cuda_manual_seed(
        seed, use_cudagraphable_rng=cudagraphable_rng, force_reset_rng=switch
    )


def destroy_megatron_parallel() -> None:
    """Tear down Megatron's process groups (torch.distributed itself stays up: its owner ends
    it). The RNG tracker and the CPU patches stay too; tests undo the latter with
    ``cpu_compat.disable_cpu_execution``."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def single_rank_megatron(seed: int = 1234) -> Iterator[None]:
    """torch.distributed (one gloo rank) and Megatron's parallel state (all sizes 1, CPU
    execution) for building models on the CPU in this process; what this started is torn
    down after, what was there already is used as it is."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_rl_offload.models.cpu_compat import disable_cpu_execution

    own_dist = not dist.is_initialized()
    own_groups = not parallel_state.model_parallel_is_initialized()
    with tempfile.TemporaryDirectory() as folder:
        if own_dist:
            store = dist.FileStore(str(Path(folder) / "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            if own_groups:
                initialize_megatron_parallel({}, seed=seed, on_gpu=False)
            yield
        finally:
            if own_groups:
                destroy_megatron_parallel()
                disable_cpu_execution()
            if own_dist:
                dist.destroy_process_group()
