"""Checkpoint files are read without running code from them (policy.checkpoint_safety).

A crafted pickle payload (it would create a marker file) is refused in one line naming the
file, for a first-format shard, for a distributed checkpoint's ``.metadata`` and for an object
stored as bytes inside a ``.distcp`` file; the payload never runs. What real checkpoints hold
still loads: a first-format shard's tensors and optimizer state, numpy generator states. A
truncated data file or a missing ``.metadata`` is found without reading tensors. The real
checkpoints' round trips are tests/unit/models/test_checkpoint.py.
"""

from __future__ import annotations

import io
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy import checkpoint, checkpoint_safety


class Payload:
    """Unpickling this creates ``marker``: what an attacker's file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def one_line(caught: pytest.ExceptionInfo[UserInputError]) -> str:
    (line,) = caught.value.problems
    assert "\n" not in line
    return line


def test_a_first_format_shard_with_a_payload_is_refused(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "model_tp0_pp0.pt"
    torch.save({"model": {"w": torch.ones(2)}, "step": Payload(marker)}, path)
    with pytest.raises(UserInputError) as caught:
        checkpoint.read_legacy_shard(path)
    line = one_line(caught)
    assert line.startswith(f"{path}: refused: it holds _io.open, which")
    assert not marker.exists()


def test_a_first_format_shard_of_tensors_and_plain_data_loads(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": {"decay_style": "cosine", "num_steps": 3, "max_lr": 1e-3},
        "step": 3,
    }
    path = tmp_path / "model_tp0_pp0.pt"
    torch.save(state, path)
    loaded = checkpoint.read_legacy_shard(path)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["weight"], model.weight)
    assert loaded["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]
    checkpoint_safety.check_legacy([path])

    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(UserInputError, match="damaged or truncated"):
        checkpoint_safety.check_legacy([path])
    with pytest.raises(UserInputError, match="not readable"):
        checkpoint.read_legacy_shard(path)


def _saved(directory: Path, **entries: object) -> Path:
    """A distributed checkpoint of ``entries`` (tensors; any other object torch.save'd as
    bytes into the data file, as megatron stores its step, schedule and generator states),
    and the layout.json beside it."""
    dcp.save(entries, checkpoint_id=str(directory), no_dist=True)
    layout = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1}
    meta = {"version": 1, "layout": layout, "has_optimizer": False, "step": 0}
    (directory / checkpoint.LAYOUT_FILE).write_text(__import__("json").dumps(meta))
    return directory


def _load(directory: Path, request: dict) -> dict:
    """``request`` read from ``directory`` as megatron reads it (torch's planner, unflattened;
    objects stored as bytes unpickled by the planner), under :func:`restricted_bytes`."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner(flatten_state_dict=False)
    with checkpoint_safety.restricted_bytes():
        dcp.load(request, checkpoint_id=str(directory), planner=planner, no_dist=True)
    return planner.state_dict


def test_a_real_distributed_checkpoint_passes_and_its_objects_load(tmp_path):
    rng = [random.getstate(), np.random.get_state(), 4]  # one object (a list)
    directory = _saved(tmp_path / "ckpt", weight=torch.arange(6.0), rng=rng)
    assert checkpoint.problem(directory) is None
    metadata = checkpoint_safety.read_metadata(directory)
    assert set(metadata.state_dict_metadata) == {"weight", "rng"}

    state = _load(directory, {"weight": torch.zeros(6), "rng": io.BytesIO()})
    assert torch.equal(state["weight"], torch.arange(6.0))
    assert state["rng"][2] == 4 and state["rng"][0] == rng[0]
    np.testing.assert_array_equal(state["rng"][1][1], rng[1][1])


def test_metadata_with_a_payload_is_refused_before_anything_reads_it(tmp_path):
    marker = tmp_path / "ran"
    directory = _saved(tmp_path / "ckpt", weight=torch.arange(6.0))
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    for check in (checkpoint_safety.check_distributed, checkpoint_safety.read_metadata):
        with pytest.raises(UserInputError) as caught:
            check(directory)
        line = one_line(caught)
        assert line.startswith(f"{directory / '.metadata'}: refused: it names _io.open, which")
    assert checkpoint.problem(directory).startswith(f"{directory / '.metadata'}: refused")
    assert not marker.exists()


def test_an_object_with_a_payload_inside_a_data_file_is_refused(tmp_path):
    marker = tmp_path / "ran"
    directory = _saved(tmp_path / "ckpt", rng=[Payload(marker)])
    assert checkpoint.problem(directory) is None  # its metadata is plain
    with pytest.raises(BaseException) as caught:  # torch's CheckpointException is one
        _load(directory, {"rng": io.BytesIO()})
    refused = checkpoint_safety.refusal(caught.value)
    assert refused is not None and "entry rng holds _io.open" in str(refused)
    assert not marker.exists()
    # The planner is torch's own again afterwards.
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    assert DefaultLoadPlanner.load_bytes.__module__ == DefaultLoadPlanner.__module__


def test_missing_or_truncated_files_are_one_line_without_reading_tensors(tmp_path):
    directory = _saved(tmp_path / "ckpt", weight=torch.arange(1000.0))
    (part,) = directory.glob("*.distcp")
    part.write_bytes(part.read_bytes()[:100])
    assert "the file is truncated" in checkpoint.problem(directory)
    part.unlink()
    assert checkpoint.problem(directory) == f"{part}: missing; the checkpoint is incomplete"
    (directory / ".metadata").write_bytes(b"\x80\x04")
    assert "damaged, not a checkpoint's metadata" in checkpoint.problem(directory)
    (directory / ".metadata").unlink()
    assert "missing; the checkpoint is incomplete" in checkpoint.problem(directory)


def test_export_hf_of_a_crafted_checkpoint_prints_one_line_and_runs_nothing(tmp_path):
    """``export-hf --checkpoint`` (the probe's route): exit 2, one line, no payload run."""
    from io import StringIO

    from nemo_rl_offload.cli import main

    marker = tmp_path / "ran"
    recipe = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny" / "sft.yaml"
    step_dir = tmp_path / "ckpt" / "step_000001"
    (step_dir / "policy").mkdir(parents=True)
    (step_dir / "state.json").write_text('{"step": 1}')
    shard = step_dir / "policy" / "model_tp0_pp0.pt"
    torch.save({"model": {"w": torch.ones(2)}, "step": Payload(marker)}, shard)
    out, err = StringIO(), StringIO()
    args = ["export-hf", "--config", str(recipe), "--checkpoint", str(step_dir)]
    assert main([*args, "--out", str(tmp_path / "hf")], out=out, err=err) == 2
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert lines == [
        f"{shard}: refused: it holds _io.open, which a checkpoint of the first format never "
        "holds (unpickling it could run code)"
    ]
    assert not marker.exists()


def test_torchs_own_metadata_read_is_restricted_during_a_load(tmp_path):
    """A .metadata changed after the check (or read by a path that skipped it) is refused by
    torch's reader too while a load runs; torch's reader is its own again afterwards."""
    from torch.distributed.checkpoint import filesystem

    marker = tmp_path / "ran"
    directory = _saved(tmp_path / "ckpt", weight=torch.arange(6.0))
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(BaseException) as caught:
        _load(directory, {"weight": torch.zeros(6)})
    refused = checkpoint_safety.refusal(caught.value)
    assert refused is not None and str(refused).startswith("its .metadata names _io.open")
    assert not marker.exists()
    assert filesystem.pickle is pickle
