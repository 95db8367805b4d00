"""Checkpoint files read without running code from them, and checked complete before a load.

A checkpoint is a directory a user hands in, and Python's pickle runs whatever a file names, so
nothing of one is unpickled without an allowlist. :func:`problem` also says whether a
checkpoint is complete without reading its tensors. What is read how: docs/training.md.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nemo_rl_offload.errors import UserInputError

METADATA_FILE = ".metadata"
# (module, name) of every class a distributed checkpoint's .metadata holds (listed from real
# checkpoints of this package with pickletools: dense and MoE, plain and distributed optimizer,
# float32 and bfloat16); torch's dtypes are added by name below.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.planner", "SavePlan"),
        ("torch.distributed.checkpoint.planner", "WriteItem"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.distributed.checkpoint.planner", "TensorWriteData"),
        ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
        # torch's own writer records the checkpoint's path in StorageMeta (building a path
        # touches no file).
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    ]
)
_CODE = "unpickling it could run code"


class RefusedPickle(pickle.UnpicklingError):
    """A pickle that names a global outside the allowlist; the message is the refusal."""


class MetadataUnpickler(pickle.Unpickler):
    """pickle's unpickler that finds only :data:`METADATA_GLOBALS` and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise RefusedPickle(f"{module}.{name}")


def read_metadata(directory: str | Path) -> Any:
    """The distributed checkpoint's metadata in ``directory``, unpickled through
    :class:`MetadataUnpickler`; one line naming the file when it is missing, damaged or
    names anything else."""
    path = Path(directory) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            return MetadataUnpickler(f).load()
    except RefusedPickle as exc:
        raise UserInputError(
            f"{path}: refused: it names {exc}, which a checkpoint's metadata never holds "
            f"({_CODE}); use a checkpoint written by this package's training commands"
        ) from None
    except FileNotFoundError:
        raise UserInputError(
            f"{path}: missing; the checkpoint is incomplete (a save that stopped midway?)"
        ) from None
    except OSError as exc:
        raise UserInputError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except Exception as exc:  # truncated or not a pickle at all
        raise UserInputError(
            f"{path}: damaged, not a checkpoint's metadata ({type(exc).__name__}: {exc})"
        ) from None


def check_distributed(directory: str | Path) -> None:
    """Refuse, in one line, a current-format checkpoint directory whose ``.metadata`` names
    anything outside the allowlist or whose data files are missing or shorter than the
    metadata says (truncated). Reads no tensor."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise UserInputError(f"{directory / METADATA_FILE}: damaged: it lists no data files")
    needed: dict[str, int] = {}
    for info in storage.values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        path = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not path.is_file():
            raise UserInputError(f"{path}: missing; the checkpoint is incomplete")
        size = path.stat().st_size
        if size < end:
            raise UserInputError(
                f"{path}: {size} bytes, the checkpoint's metadata needs {end}: the file is "
                "truncated (a save or copy that stopped midway?)"
            )


def check_legacy(paths: list[Path]) -> None:
    """A first-format checkpoint's shard files are complete zip archives (torch.save's
    format; a truncated one has lost its directory at the end). Reads no tensor."""
    for path in paths:
        try:
            with zipfile.ZipFile(path):
                pass
        except (OSError, zipfile.BadZipFile) as exc:
            raise UserInputError(f"{path}: damaged or truncated ({exc})") from None


def load_legacy(path: str | Path) -> dict[str, Any]:
    """One first-format shard file, weights-only: tensors and plain data, nothing that runs
    code; a file naming anything else is one line."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = named.group(1) if named else "an object that is not a tensor or plain data"
        raise UserInputError(
            f"{path}: refused: it holds {what}, which a checkpoint of the first format never "
            f"holds ({_CODE})"
        ) from None
    except Exception as exc:  # a truncated or foreign file
        raise UserInputError(f"{path}: not readable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise UserInputError(f"{path}: not a checkpoint shard (it holds no model weights)")
    return state


def _numpy_array_globals() -> list[Any]:
    """What a pickled numpy array names (numpy's generator state is one)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


@contextlib.contextmanager
def restricted_bytes() -> Iterator[None]:
    """For the duration: torch's distributed-checkpoint planner unpickles the objects stored
    as bytes weights-only (numpy arrays added), not with ``weights_only=False``; an object
    outside that raises :class:`RefusedPickle` naming it."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    allowed = _numpy_array_globals()
    original = DefaultLoadPlanner.load_bytes

    def load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
        try:
            with torch.serialization.safe_globals(allowed):
                loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            named = re.search(r"GLOBAL ([\w.]+)", str(exc))
            raise RefusedPickle(
                f"its entry {read_item.dest_index.fqn} holds "
                f"{named.group(1) if named else 'an object that is not plain data'}, which "
                f"this package's checkpoints never hold ({_CODE})"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint.default_planner import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    DefaultLoadPlanner.load_bytes = load_bytes  # type: ignore[method-assign]
    try:
        with _restricted_metadata_reads():
            yield
    finally:
        DefaultLoadPlanner.load_bytes = original  # type: ignore[method-assign]


class _MetadataPickle:
    """What torch's filesystem reader sees as ``pickle`` while a load runs: ``load`` through
    :class:`MetadataUnpickler`, everything else pickle's own."""

    @staticmethod
    def load(file: Any) -> Any:
        try:
            return MetadataUnpickler(file).load()
        except RefusedPickle as exc:
            raise RefusedPickle(
                f"its {METADATA_FILE} names {exc}, which a checkpoint's metadata never holds "
                f"({_CODE})"
            ) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


@contextlib.contextmanager
def _restricted_metadata_reads() -> Iterator[None]:
    """Torch's reader unpickles ``.metadata`` through the allowlist too (the directory was
    checked by :func:`check_distributed` before; this covers a file changed since)."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.pickle
    filesystem.pickle = _MetadataPickle()  # type: ignore[assignment]
    try:
        yield
    finally:
        filesystem.pickle = original


def refusal(exc: BaseException) -> RefusedPickle | None:
    """The :class:`RefusedPickle` behind a failed distributed load (torch wraps each rank's
    error in a CheckpointException, or quotes it in another error), or None."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, RefusedPickle):
            return current
        # torch reports a failed metadata read as text inside another error.
        quoted = re.search(r"(its \S+ names [^;]*?\(" + re.escape(_CODE) + r"\))", str(current))
        if quoted:
            return RefusedPickle(quoted.group(1))
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending += [current.__cause__, current.__context__]
    return None
