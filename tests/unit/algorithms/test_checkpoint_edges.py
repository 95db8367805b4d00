"""Where a run resumes from, and what it refuses before its first step (algorithms.common):
a damaged or partial latest checkpoint is passed over with one warning line and the previous
complete one used; none complete is one line; a truncated state.json, a stray ``step_N.bak``
and a checkpoint directory that cannot be written are each one line or warning, never a
traceback. The checkpoints are small real ones (tests/support/tiny_checkpoints.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.loop_runs import stand_in_run
from support.tiny_checkpoints import write_policy

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy.checkpoint_dirs import (
    STATE_FILE,
    check_writable,
    find_resume,
    latest_good,
    read_state,
    resolve_checkpoint,
)

WHERE = "checkpointing.checkpoint_dir"


def checkpoint(root: Path, step: int) -> Path:
    step_dir = root / f"step_{step:06d}"
    write_policy(step_dir / "policy")
    (step_dir / STATE_FILE).write_text(json.dumps({"step": step, "position": 32 * step}))
    return step_dir


def warnings_of(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def test_the_latest_complete_checkpoint_is_resumed(tmp_path, capsys):
    for step in (3, 6):
        checkpoint(tmp_path, step)
    assert find_resume(tmp_path) == (tmp_path / "step_000006", {"step": 6, "position": 192})
    assert warnings_of(capsys) == []


@pytest.mark.parametrize("damage", ["state_truncated", "state_missing", "data_truncated",
                                    "metadata_missing", "layout_missing"])  # fmt: skip
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, damage):
    checkpoint(tmp_path, 3)
    latest = checkpoint(tmp_path, 6)
    state = latest / STATE_FILE
    if damage == "state_truncated":
        state.write_text(state.read_text()[:9])
    elif damage == "state_missing":
        state.unlink()
    elif damage == "data_truncated":
        (part,) = (latest / "policy").glob("*.distcp")
        part.write_bytes(part.read_bytes()[:10])
    elif damage == "metadata_missing":
        (latest / "policy" / ".metadata").unlink()
    else:
        (latest / "policy" / "layout.json").unlink()
    resume_from, state_read = find_resume(tmp_path)
    assert (resume_from, state_read["step"]) == (tmp_path / "step_000003", 3)
    (line,) = warnings_of(capsys)
    assert line.startswith(f"warning: {WHERE}: skipping the damaged checkpoint step_000006: ")


def test_no_complete_checkpoint_is_one_line(tmp_path, capsys):
    for step in (3, 6):
        (checkpoint(tmp_path, step) / STATE_FILE).write_text('{"step": ')
    with pytest.raises(UserInputError) as caught:
        find_resume(tmp_path)
    (line,) = caught.value.problems
    assert line.startswith(f"{WHERE}: no complete checkpoint under {tmp_path}")
    assert len(warnings_of(capsys)) == 2  # one each, newest first


def test_a_truncated_state_json_is_one_line(tmp_path):
    step_dir = checkpoint(tmp_path, 3)
    (step_dir / STATE_FILE).write_text('{"step": 3, "posi')
    with pytest.raises(UserInputError) as caught:
        read_state(step_dir)
    (line,) = caught.value.problems
    assert line.startswith(f"{step_dir / STATE_FILE}: damaged (JSONDecodeError: ")
    (step_dir / STATE_FILE).write_text('["step"]')
    with pytest.raises(UserInputError, match="damaged .not a checkpoint's driver state"):
        read_state(step_dir)


def test_stray_entries_are_ignored_with_one_warning(tmp_path, capsys):
    checkpoint(tmp_path, 3)
    (tmp_path / "step_000006.bak").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "step_x").mkdir()
    assert find_resume(tmp_path)[0] == tmp_path / "step_000003"
    (line,) = warnings_of(capsys)
    assert line == (
        f"warning: {WHERE}: ignoring 3 entries that are not a checkpoint (step_N): "
        "notes.txt, step_000006.bak, step_x"
    )
    assert resolve_checkpoint(str(tmp_path), "policy.init_checkpoint") == tmp_path / "step_000003"


def test_keep_top_k_reads_past_a_damaged_state_json(tmp_path):
    class Policy:
        def save(self, directory: str) -> None:
            write_policy(directory)

    run = stand_in_run("sft", checkpointing={"checkpoint_dir": str(tmp_path), "keep_top_k": 2})
    run.save(Policy(), 3, {"position": 96})
    (tmp_path / "step_000003" / STATE_FILE).write_text("{")
    (tmp_path / "step_000004.bak").mkdir()
    run.save(Policy(), 6, {"position": 192})
    run.save(Policy(), 9, {"position": 288})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000004.bak", "step_000006", "step_000009"
    ]  # fmt: skip


def test_a_fresh_directory_is_created_and_a_fresh_start_found(tmp_path):
    root = tmp_path / "new" / "ckpt"
    assert find_resume(root) == (None, {})
    assert root.is_dir() and list(root.iterdir()) == []  # the write check left nothing


def test_a_checkpoint_dir_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError) as caught:
        check_writable(tmp_path / "file" / "ckpt")
    (line,) = caught.value.problems
    assert line.startswith(f"{WHERE}: cannot write checkpoints to {tmp_path / 'file' / 'ckpt'} (")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkpoint_dir_is_refused_before_the_first_step(tmp_path):
    root = tmp_path / "ckpt"
    checkpoint(root, 3)
    root.chmod(0o555)
    try:
        with pytest.raises(UserInputError) as caught:
            find_resume(root)
    finally:
        root.chmod(0o755)
    (line,) = caught.value.problems
    assert line == (
        f"{WHERE}: cannot write checkpoints to {root} (Permission denied); make it writable "
        "or set checkpointing.checkpoint_dir to a directory you can write"
    )


def test_a_read_only_checkpoint_dir_is_refused_as_root_too(tmp_path, monkeypatch):
    """As root, permission bits do not stop writes: the refusal is the OSError's, whatever
    raised it (here the probe file's creation)."""
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(UserInputError) as caught:
        find_resume(tmp_path)
    (line,) = caught.value.problems
    assert line.startswith(f"{WHERE}: cannot write checkpoints to {tmp_path} (Permission denied)")


def test_latest_good_of_an_empty_or_missing_directory_is_none(tmp_path):
    assert latest_good(tmp_path, WHERE) is None
    assert latest_good(tmp_path / "missing", WHERE) is None
