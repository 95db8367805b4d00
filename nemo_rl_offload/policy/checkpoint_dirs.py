"""A run's checkpoint directory (``checkpointing.checkpoint_dir``) on disk: its step
directories, the newest complete one to resume from, and what is removed or refused.

Layout::

    step_000010/policy/          the workers' sharded checkpoint and layout.json
                                 (:mod:`nemo_rl_offload.policy.checkpoint`)
    step_000010/state.json       the driver's state: step, data position

A directory is written as ``.tmp_step_N`` and renamed to ``step_N`` only when complete, so a
stop mid-save leaves the previous checkpoint as the latest complete one; old ones are renamed
away before they are deleted. Resume takes the newest complete ``step_N`` (a damaged newer one
is passed over with a warning), warns about other entries and removes ``.tmp_*`` leftovers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from nemo_rl_offload.errors import UserInputError

STATE_FILE = "state.json"
# Directories being written or deleted: never read as checkpoints, removed at the next start.
TMP_PREFIX = ".tmp_"


def remove_dir(directory: Path) -> None:
    """Delete a checkpoint directory: renamed out of the ``step_*`` names first, so that a
    stop halfway through never leaves a partly deleted one that looks complete."""
    doomed = directory.with_name(f"{TMP_PREFIX}delete_{directory.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_incomplete(root: str | Path) -> list[Path]:
    """Remove what a stopped run left half-written or half-deleted under ``root``."""
    root = Path(root)
    leftovers = sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)
    return leftovers


STEP_DIR = re.compile(r"step_(\d+)")


def step_of(path: Path) -> int | None:
    """The step of a ``step_N`` directory's name; None for any other entry."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match[1]) if match and path.is_dir() else None


def _step_dirs(root: str | Path) -> list[Path]:
    """Every ``step_N`` directory under ``root`` (complete or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """Checkpoints under ``root`` with their ``state.json`` (written last), oldest first;
    entries that are not ``step_N`` directories are left alone (:func:`stray_entries`)."""
    return [p for p in _step_dirs(root) if (p / STATE_FILE).is_file()]


def stray_entries(root: str | Path) -> list[str]:
    """Names under ``root`` that are neither checkpoints nor this package's leftovers (a
    ``step_6.bak`` copy, notes): ignored, and named in a warning at the start."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if step_of(p) is None and not p.name.startswith(TMP_PREFIX)
    )


def read_state(step_dir: Path) -> dict[str, Any]:
    """A checkpoint's driver state (``state.json``); one line when it is missing or damaged."""
    path = step_dir / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserInputError(f"{path}: missing (a partial checkpoint)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserInputError(f"{path}: damaged ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or isinstance(state.get("step"), bool):
        raise UserInputError(f"{path}: damaged (not a checkpoint's driver state)")
    if not isinstance(state.get("step"), int):
        raise UserInputError(f"{path}: damaged (no step number)")
    return state


def checkpoint_problem(step_dir: Path) -> str | None:
    """Why ``step_dir`` cannot be resumed or loaded as it is (its state.json, its workers'
    files: :func:`policy.checkpoint.problem`, no tensor read), or None."""
    from nemo_rl_offload.policy.checkpoint import problem

    try:
        read_state(step_dir)
    except UserInputError as exc:
        return exc.problems[0]
    return problem(step_dir / "policy")


def latest_good(root: str | Path, where: str) -> Path | None:
    """The newest complete checkpoint under ``root`` (None when there is none at all). A
    damaged or partial newer one is passed over with one warning line each; when none is
    complete, one line refusing (a run must not silently start afresh over them)."""
    candidates = _step_dirs(root)
    for step_dir in reversed(candidates):
        trouble = checkpoint_problem(step_dir)
        if trouble is None:
            return step_dir
        print(
            f"warning: {where}: skipping the damaged checkpoint {step_dir.name}: {trouble}",
            file=sys.stderr,
        )
    if candidates:
        raise UserInputError(
            f"{where}: no complete checkpoint under {root} (each is damaged or partial, see "
            "the warnings above); move them away to start afresh, or restore one"
        )
    return None


def resolve_checkpoint(path: str, where: str) -> Path:
    """A checkpoint step directory, or the latest complete one under a checkpoint_dir."""
    candidate = Path(path)
    if (candidate / STATE_FILE).is_file():
        return candidate
    found = latest_good(candidate, where)
    if found is None:
        raise UserInputError(
            f"{where}: no checkpoint at '{path}' (expected a step_N directory with {STATE_FILE},"
            " or a checkpoint_dir that holds some); run the earlier stage first"
        )
    return found


def check_writable(root: str | Path) -> None:
    """Before the first step: the checkpoint directory can be created and written, so that
    a read-only one is found now, not at the first save after the steps before it ran."""
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=f"{TMP_PREFIX}write_check_"):
            pass
    except OSError as exc:
        raise UserInputError(
            f"checkpointing.checkpoint_dir: cannot write checkpoints to {root} "
            f"({exc.strerror or exc}); make it writable or set checkpointing.checkpoint_dir "
            "to a directory you can write"
        ) from None


def find_resume(root: str | Path) -> tuple[Path | None, dict[str, Any]]:
    """At the start of a run with checkpointing: check ``root`` writable, remove leftovers,
    warn about entries that are not checkpoints, and find the checkpoint to resume (the
    latest complete one) with its driver state; (None, {}) for a fresh start."""
    check_writable(root)
    for leftover in remove_incomplete(root):
        print(f"removed an incomplete checkpoint: {leftover}", file=sys.stderr)
    stray = stray_entries(root)
    if stray:
        print(
            f"warning: checkpointing.checkpoint_dir: ignoring {len(stray)} "
            f"entr{'y' if len(stray) == 1 else 'ies'} that {'is' if len(stray) == 1 else 'are'}"
            f" not a checkpoint (step_N): {', '.join(stray)}",
            file=sys.stderr,
        )
    resume_from = latest_good(root, "checkpointing.checkpoint_dir")
    if resume_from is None:
        return None, {}
    return resume_from, read_state(resume_from)
