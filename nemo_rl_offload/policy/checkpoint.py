"""A policy worker's training state on disk, through megatron-core's ``dist_checkpointing``.

Every rank writes its part of one sharded checkpoint into ``<step dir>/policy/``;
``layout.json`` records the format version and layout, so a layout that cannot be loaded is
refused before any rank reads tensors. Nothing is unpickled without an allowlist
(:mod:`checkpoint_safety`). What is stored and how it reloads: docs/training.md.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy import checkpoint_safety

FORMAT = "megatron_dist_checkpoint"
FORMAT_VERSION = 1
LAYOUT_FILE = "layout.json"
# The distributed optimizer's checkpoint format (Megatron-LM's default). The layout rules of
# DistributedOptimizer.sharded_state_dict's formats: 'dp_reshardable' stores the gradient
# buffers' buckets, whose contents depend on the model-parallel sizes, and reloads onto other
# data-parallel sizes only; 'fully_reshardable' gathers the state on data-parallel rank 0 in
# model space and reloads onto any layout; 'dp_zero_gather_scatter' also gathers on rank 0 but
# keeps a fixed tensor x pipeline structure (data-parallel changes only);
# 'fully_sharded_model_space' (flattened ShardedTensors) is refused by megatron-core 0.19's
# ShardedTensor ("flattened_range is not supported").
DISTRIBUTED_OPTIMIZER_FORMAT = "dp_reshardable"
LEGACY_SHARD = re.compile(r"model_tp(\d+)_pp(\d+)\.pt$")


@dataclass(frozen=True)
class Layout:
    """The parallel layout a checkpoint was saved with (or a run has)."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    context_parallel: int = 1
    expert_parallel: int = 1
    distributed_optimizer: bool = False

    @classmethod
    def current(cls, *, distributed_optimizer: bool) -> Layout:
        from megatron.core import parallel_state as ps

        return cls(
            tensor_parallel=ps.get_tensor_model_parallel_world_size(),
            pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
            data_parallel=ps.get_data_parallel_world_size(),
            context_parallel=ps.get_context_parallel_world_size(),
            expert_parallel=ps.get_expert_model_parallel_world_size(),
            distributed_optimizer=distributed_optimizer,
        )

    def describe(self) -> str:
        sizes = (
            f"tp={self.tensor_parallel} pp={self.pipeline_parallel} dp={self.data_parallel} "
            f"cp={self.context_parallel} ep={self.expert_parallel}"
        )
        return f"{sizes}, {'distributed' if self.distributed_optimizer else 'plain'} optimizer"

    def same_ranks(self, other: Layout) -> bool:
        """Whether every rank of ``other`` has the same place in the same process grid."""
        return (
            self.tensor_parallel,
            self.pipeline_parallel,
            self.data_parallel,
            self.context_parallel,
            self.expert_parallel,
        ) == (
            other.tensor_parallel,
            other.pipeline_parallel,
            other.data_parallel,
            other.context_parallel,
            other.expert_parallel,
        )


@dataclass(frozen=True)
class SavedCheckpoint:
    """What ``layout.json`` says about a checkpoint directory."""

    layout: Layout
    has_optimizer: bool
    optimizer_format: str | None  # None: weights only; "plain" or the distributed format
    step: int
    version: int = FORMAT_VERSION
    # policy.quant_cfg of the run that wrote it (models.quantization): only a model quantized
    # the same way reads its entries.
    quant_cfg: str | None = None


def is_legacy(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint of the first format (one file per shard)."""
    directory = Path(directory)
    return not (directory / LAYOUT_FILE).is_file() and bool(_legacy_shards(directory))


def _legacy_shards(directory: Path) -> set[tuple[int, int]]:
    """The (tensor, pipeline) coordinates of a first-format checkpoint's files."""
    found = set()
    for path in directory.glob("model_tp*_pp*.pt"):
        match = LEGACY_SHARD.search(path.name)
        if match:
            found.add((int(match[1]), int(match[2])))
    return found


def read_saved(directory: str | Path) -> SavedCheckpoint:
    """``layout.json`` of a checkpoint directory (``<step>/policy``); one line if it is not
    a checkpoint of this format."""
    path = Path(directory) / LAYOUT_FILE
    try:
        meta = json.loads(path.read_text())
        version = int(meta["version"])
        saved = SavedCheckpoint(
            Layout(**meta["layout"]),
            bool(meta["has_optimizer"]),
            meta.get("optimizer_format"),
            int(meta["step"]),
            version,
            meta.get("quant_cfg"),
        )
    except FileNotFoundError as exc:
        raise UserInputError(
            f"{directory}: no {LAYOUT_FILE}; not a policy checkpoint (give a step_N directory "
            "written by a training run, or a checkpoint_dir)"
        ) from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserInputError(f"{path}: not a readable checkpoint description ({exc})") from exc
    if version > FORMAT_VERSION:
        raise UserInputError(
            f"{directory}: checkpoint format version {version} is newer than this version "
            f"reads ({FORMAT_VERSION}); upgrade nemo_rl_offload"
        )
    return saved


def _fresh_start(directory: str | Path) -> str:
    """What to do instead of resuming: a new run from the checkpoint's weights."""
    step_dir = Path(directory).parent
    return (
        f"start a new run (another checkpointing.checkpoint_dir) from its weights with "
        f"policy.init_checkpoint={step_dir}"
    )


def check_resume(directory: str | Path, saved: SavedCheckpoint, current: Layout) -> None:
    """Refuse, in one line, a full-state load that the checkpoint cannot give this layout.

    Weights and the plain optimizer's state are stored as whole-model tensors, which
    dist_checkpointing reshards onto any tensor, pipeline and data-parallel sizes. The
    distributed optimizer's state (``dp_reshardable``) is stored as its gradient buffers'
    buckets, whose contents depend on every model-parallel size: it reloads onto another
    data-parallel size only.
    """
    fresh = _fresh_start(directory)
    if not saved.has_optimizer:
        raise UserInputError(
            f"{directory}: holds weights only (saved by workers without an optimizer); {fresh}"
        )
    was, now = saved.layout, current
    if was.distributed_optimizer != now.distributed_optimizer:
        setting = "true" if was.distributed_optimizer else "false"
        raise UserInputError(
            f"{directory}: saved with {was.describe()}, this run has {now.describe()}; the two "
            "optimizers store their state differently. Set policy.megatron_cfg.optimizer."
            f"use_distributed_optimizer={setting} to resume, or {fresh}"
        )
    model_parallel = ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")
    changed = [name for name in model_parallel if getattr(was, name) != getattr(now, name)]
    if was.distributed_optimizer and changed:
        keys = {
            "tensor_parallel": "tensor_model_parallel_size",
            "pipeline_parallel": "pipeline_model_parallel_size",
            "context_parallel": "context_parallel_size",
            "expert_parallel": "expert_model_parallel_size",
        }
        wanted = " ".join(f"{keys[name]}={getattr(was, name)}" for name in changed)
        raise UserInputError(
            f"{directory}: saved with {was.describe()}, this run has {now.describe()}; the "
            f"distributed optimizer's state ({saved.optimizer_format} format) reloads onto "
            f"another data-parallel size only. Resume with policy.megatron_cfg {wanted}, or "
            f"{fresh}"
        )


def check_resumable(directory: str | Path, current: Layout) -> list[str]:
    """Before workers load ``directory`` to resume: one line if they cannot; otherwise the
    notes worth showing (what the resume does not restore exactly)."""
    directory = Path(directory)
    if is_legacy(directory):
        found = _legacy_shards(directory)
        tp, pp = 1 + max(t for t, _ in found), 1 + max(p for _, p in found)
        if len(found) != tp * pp or (tp, pp) != (
            current.tensor_parallel,
            current.pipeline_parallel,
        ):
            raise UserInputError(
                f"{directory}: a checkpoint of the first format (one file per model-parallel "
                f"shard) with {len(found)} file(s) for tp={tp} pp={pp}, this run has "
                f"{current.describe()}; that format is read only with the sizes it was saved "
                "with: resume with them"
            )
        return [
            f"{directory}: a checkpoint of the first format: resuming with its weights, step, "
            "schedule and the plain optimizer's state it holds (none if it was saved with the "
            "distributed optimizer, none loaded into the distributed optimizer); it has no "
            "generator states, so the resumed run is not bitwise the uninterrupted one"
        ]
    saved = read_saved(directory)
    check_resume(directory, saved, current)
    if saved.layout.same_ranks(current):
        return []
    return [
        f"{directory}: saved with {saved.layout.describe()}, resuming with "
        f"{current.describe()}: weights and optimizer state are resharded; the random "
        "generators continue from this run's seeds (a generator state belongs to one rank)"
    ]


@contextlib.contextmanager
def _checkpoint_io(on_gpu: bool) -> Iterator[None]:
    """Megatron's checkpoint reads and writes, with two stand-ins while they run.

    On CPU workers, ``cpu_compat.cpu_checkpoint_io``: the writer synchronises CUDA and puts a
    flag on the GPU. Without psutil (megatron-core does not require it), the writer's
    per-write memory figure, used only in a debug log line, is 0 instead of an error that
    fails the save.
    """
    with contextlib.ExitStack() as stack:
        if not on_gpu:
            from nemo_rl_offload.models.cpu_compat import cpu_checkpoint_io

            stack.enter_context(cpu_checkpoint_io())
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if not filesystem_async.HAVE_PSUTIL:
            previous = filesystem_async._process_memory
            filesystem_async._process_memory = lambda: 0
            stack.callback(setattr, filesystem_async, "_process_memory", previous)
        yield


def _metadata() -> dict[str, Any]:
    from megatron.core import parallel_state

    return {
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
        "distrib_optim_sharding_type": DISTRIBUTED_OPTIMIZER_FORMAT,
        "chained_optim_avoid_prefix": True,
    }


def _rng_state(on_gpu: bool) -> dict[str, Any]:
    """This rank's generators; Megatron's tracker states as plain states (a CUDA-graph-safe
    tracker holds generator objects, whose identity its captured graphs depend on)."""
    import torch
    from megatron.core import tensor_parallel

    tracker = {}
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tracker[name] = state.get_state() if isinstance(state, torch.Generator) else state
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tracker,
    }
    if on_gpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any], on_gpu: bool) -> None:
    import torch
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if on_gpu and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    restored = dict(current)
    for name, saved in state["tracker"].items():
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(saved)  # in place: graphs keep their generator
        else:
            restored[name] = saved
    tracker.set_states(restored)


def _rng_object(state: dict[str, Any] | None) -> Any:
    """Each rank's generator states as one object of a ``world_size`` grid."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _reason(exc: BaseException) -> str:
    """One line of why a checkpoint read failed: for PyTorch's collective errors, the first
    failing rank's own error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        failure = next(iter(failures.values()))
        exc = failure[0] if isinstance(failure, tuple) else failure
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _allocate_optimizer_state(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped yet its state tensors, which the
    checkpoint's values are then read into: its sharded state dict for loading needs them
    (with torch's Adam it reads the step count from them), and it would otherwise allocate
    them on the current CUDA device. Megatron's own helper does it with one step on zero
    gradients; every value it touches is overwritten by the load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, DistributedOptimizer) and len(part.optimizer.state) == 0:
            part._init_optimizer_states_with_dummy_values()


def _restore_step_counts(optimizer: Any) -> None:
    """Set each parameter's Adam step count (torch's Adam: a tensor per parameter) to the
    checkpoint's, one tensor each.

    Megatron's distributed optimizer keeps the step of torch's Adam in its parameter groups in
    the checkpoint and loads it into every parameter's state as one shared tensor; its
    ``dp_reshardable`` state then copies into that tensor the step counts the optimizer had
    before the load (it does not store them). The count in the loaded parameter groups is the
    checkpoint's; each parameter gets its own tensor, since torch's Adam increments them in
    place."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, DistributedOptimizer):
            continue
        for group in part.optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = part.optimizer.state.get(param) or {}
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.full_like(state["step"], float(group["step"]))


def save(
    directory: str | Path,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    step: int,
    distributed_optimizer: bool,
    on_gpu: bool,
    quant_cfg: str | None = None,
) -> None:
    """Write this rank's part of the checkpoint (every rank of the group calls it together);
    rank 0 writes ``layout.json`` once all parts are written. ``quant_cfg``: the model's
    quantization (``policy.quant_cfg``), recorded for whoever reads it."""
    import torch
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = _metadata()
    state: dict[str, Any] = {"model": model.sharded_state_dict(metadata=metadata), "step": step}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=metadata)
        state["scheduler"] = scheduler.state_dict()
    state["rng_state"] = _rng_object(_rng_state(on_gpu))
    with _checkpoint_io(on_gpu):
        dist_checkpointing.save(state, str(directory))  # ends with a barrier: parts written
    if torch.distributed.get_rank() == 0:
        layout = Layout.current(distributed_optimizer=distributed_optimizer)
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "layout": asdict(layout),
            "has_optimizer": optimizer is not None,
            "optimizer_format": None
            if optimizer is None
            else DISTRIBUTED_OPTIMIZER_FORMAT
            if distributed_optimizer
            else "plain",
            "step": step,
            "quant_cfg": quant_cfg,
        }
        tmp = directory / (LAYOUT_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(directory / LAYOUT_FILE)


def load(
    directory: str | Path,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    distributed_optimizer: bool,
    on_gpu: bool,
    weights_only: bool,
) -> tuple[dict[str, Any], int]:
    """Read the checkpoint into this rank's model (and, unless ``weights_only``, its
    optimizer, scheduler and generators). Returns the model's loaded state dict (to copy into
    a reference model) and the saved step (0 with ``weights_only``)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    saved = read_saved(directory)
    # Before megatron or torch unpickles anything of it: its metadata through an allowlist,
    # its files complete.
    checkpoint_safety.check_distributed(directory)
    current = Layout.current(distributed_optimizer=distributed_optimizer)
    full = not weights_only and optimizer is not None
    if full:
        check_resume(directory, saved, current)
    metadata = _metadata()
    request: dict[str, Any] = {"model": model.sharded_state_dict(metadata=metadata)}
    restore_rng = full and saved.layout.same_ranks(current)
    if full:
        _allocate_optimizer_state(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(
            request["model"], is_loading=True, metadata=metadata
        )
        if restore_rng:
            request["rng_state"] = _rng_object(None)
    try:
        with _checkpoint_io(on_gpu), checkpoint_safety.restricted_bytes():
            state = dist_checkpointing.load(request, str(directory))
    except (
        CheckpointingException,
        CheckpointException,
        OSError,
        RuntimeError,
        checkpoint_safety.RefusedPickle,
    ) as exc:
        refused = checkpoint_safety.refusal(exc)
        if refused is not None:
            raise UserInputError(f"{directory}: refused: {refused}") from None
        raise UserInputError(
            f"{directory}: cannot be read into this model on {current.describe()} (saved "
            f"with {saved.layout.describe()}): {_reason(exc)}; check that the recipe's model "
            "is the one that wrote it and that its files are complete"
        ) from exc
    model.load_state_dict(state["model"], strict=True)
    if not full:
        if optimizer is not None:
            # Mixed precision and the distributed optimizer step float32 copies of the
            # weights, made when it was built: refresh them, or its first step would bring
            # the old weights back.
            optimizer.reload_model_params()
        return state["model"], 0
    with torch.no_grad():  # float32 weights are the optimizer's own: copied into in place
        optimizer.load_state_dict(state["optimizer"])
    _restore_step_counts(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state["rng_state"], on_gpu)
    return state["model"], int(state["step"])


def legacy_shard_path(directory: str | Path) -> Path:
    """This rank's file of a first-format checkpoint; one line when the checkpoint has no
    file for this rank's tensor/pipeline coordinates (it was saved with another layout)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_rank()
    pp = ps.get_pipeline_model_parallel_rank()
    path = Path(directory) / f"model_tp{tp}_pp{pp}.pt"
    if not path.is_file():
        raise UserInputError(
            f"{directory}: a checkpoint of the first format (one file per model-parallel "
            f"shard) without {path.name}: it was saved with other tensor/pipeline-parallel "
            "sizes, and that format is read only with the sizes it was saved with"
        )
    return path


def read_legacy_shard(path: str | Path) -> dict[str, Any]:
    """One shard file of the first format: ``model`` (its state dict) and, when it was
    saved with them, ``optimizer``, ``scheduler`` and ``step``; read weights-only, so a file
    that holds anything but tensors and plain data is refused in one line."""
    return checkpoint_safety.load_legacy(path)


def problem(directory: str | Path) -> str | None:
    """Why the policy checkpoint in ``directory`` cannot be loaded as it is (missing, damaged
    or truncated files, a refused pickle), without reading its tensors; None when complete."""
    directory = Path(directory)
    try:
        if is_legacy(directory):
            checkpoint_safety.check_legacy(sorted(directory.glob("model_tp*_pp*.pt")))
        else:
            read_saved(directory)
            checkpoint_safety.check_distributed(directory)
    except UserInputError as exc:
        return exc.problems[0]
    return None
