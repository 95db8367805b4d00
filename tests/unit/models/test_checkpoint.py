"""The workers' checkpoints (policy.checkpoint) with real dist_checkpointing on gloo ranks.

Layout changes: a checkpoint saved on one layout is resumed on another and the next step must
land where the saving run's next step did (within float rounding: another layout sums in
another order), which needs the weights, the Adam moments and step counts, and the schedule.
Refusals: what a checkpoint cannot give a layout is one line naming the checkpoint, both
layouts and what to do. The first format (one torch.save file per shard) still loads, and
export-hf reads both formats to the same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import worker_ranks
from support.worker_ranks import run_ranks, section

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy import checkpoint
from nemo_rl_offload.policy.checkpoint import Layout, SavedCheckpoint

REPO = Path(__file__).resolve().parents[3]


def _reported(results: list[dict]) -> tuple[float, float, np.ndarray]:
    """The step's loss summed over data-parallel groups, its gradient norm, and the probe."""
    reporters = [r for r in results if r["reports"]]
    loss = sum(r["loss"] for r in reporters)
    return loss, reporters[0]["grad_norm"], np.array(reporters[0]["probe"])


def _assert_same_step(saved: list[dict], resumed: list[dict]) -> None:
    loss, grad_norm, after = _reported(saved)
    loss2, grad_norm2, after2 = _reported(resumed)
    assert all(r["step"] == 2 for r in resumed)
    assert loss2 == pytest.approx(loss, rel=1e-5)
    assert grad_norm2 == pytest.approx(grad_norm, rel=1e-4)
    before = np.array(saved[0]["probe_before"])
    # The step moved the weights far more than the layouts' rounding differs.
    assert np.abs(after - before).max() > 100 * np.abs(after2 - after).max()
    np.testing.assert_allclose(after2, after, rtol=0, atol=2e-5)


def test_plain_optimizer_checkpoint_resumes_on_other_tensor_and_data_parallel_sizes(tmp_path):
    saved = run_ranks(worker_ranks.train_save_and_step, 2, tmp_path / "tp1_dp2", policy=section())
    resumed = run_ranks(
        worker_ranks.load_and_step,
        2,
        tmp_path / "tp2_dp1",
        policy=section(tensor_model_parallel_size=2),
        ckpt=str(tmp_path / "tp1_dp2" / "ckpt"),
    )
    _assert_same_step(saved, resumed)


@pytest.mark.parametrize("overlap_param_gather", [False, True], ids=["gathered", "overlapped"])
def test_distributed_optimizer_checkpoint_resumes_on_another_data_parallel_size(
    tmp_path, overlap_param_gather
):
    """``overlap_param_gather`` (the exemplar recipes' setting, in bfloat16 as they are) leaves
    each rank's copy of the other ranks' shards as they were before the last step until the
    next forward gathers them; the checkpoint saved right after a step must hold the stepped
    weights anyway (in float32 the optimizer's loaded shards are the weights themselves, so
    only mixed precision shows it)."""
    policy = section(
        optimizer={"use_distributed_optimizer": True},
        distributed_data_parallel_config={"overlap_param_gather": overlap_param_gather},
    )
    if overlap_param_gather:
        policy["precision"] = "bfloat16"
    saved = run_ranks(worker_ranks.train_save_and_step, 2, tmp_path / "dp2", policy=policy)
    meta = json.loads((tmp_path / "dp2" / "ckpt" / checkpoint.LAYOUT_FILE).read_text())
    assert meta["layout"]["distributed_optimizer"] and meta["layout"]["data_parallel"] == 2
    assert meta["optimizer_format"] == "dp_reshardable" and meta["step"] == 2
    resumed = run_ranks(
        worker_ranks.load_and_step,
        1,
        tmp_path / "dp1",
        policy=policy,
        ckpt=str(tmp_path / "dp2" / "ckpt"),
    )
    _assert_same_step(saved, resumed)


# ------------------------------------------------------------------ layout rules (no ranks)
def _layout(tp: int = 1, pp: int = 1, dp: int = 2, distributed: bool = False) -> Layout:
    return Layout(tp, pp, dp, 1, 1, distributed)


def _saved(layout: Layout, has_optimizer: bool = True) -> SavedCheckpoint:
    optimizer_format = "dp_reshardable" if layout.distributed_optimizer else "plain"
    return SavedCheckpoint(layout, has_optimizer, optimizer_format if has_optimizer else None, 4)


@pytest.mark.parametrize(
    "saved,current",
    [
        (_layout(dp=2), _layout(tp=2, pp=2, dp=1)),
        (_layout(dp=4, distributed=True), _layout(dp=1, distributed=True)),
    ],
    ids=["plain_any_layout", "distributed_other_dp"],
)
def test_layouts_a_checkpoint_can_give(saved, current):
    checkpoint.check_resume("ckpt/step_000004/policy", _saved(saved), current)


@pytest.mark.parametrize(
    "saved,current,expected",
    [
        (
            _saved(_layout(tp=1, dp=2, distributed=True)),
            _layout(tp=2, dp=1, distributed=True),
            "ckpt/step_000004/policy: saved with tp=1 pp=1 dp=2 cp=1 ep=1, distributed "
            "optimizer, this run has tp=2 pp=1 dp=1 cp=1 ep=1, distributed optimizer; the "
            "distributed optimizer's state (dp_reshardable format) reloads onto another "
            "data-parallel size only. Resume with policy.megatron_cfg "
            "tensor_model_parallel_size=1, or start a new run (another "
            "checkpointing.checkpoint_dir) from its weights with "
            "policy.init_checkpoint=ckpt/step_000004",
        ),
        (
            _saved(_layout(distributed=True)),
            _layout(distributed=False),
            "optimizer.use_distributed_optimizer=true to resume",
        ),
        (_saved(_layout(), has_optimizer=False), _layout(), "holds weights only"),
    ],
    ids=["distributed_other_tp", "optimizer_kind_changed", "weights_only"],
)
def test_a_layout_the_checkpoint_cannot_give_is_refused_in_one_line(saved, current, expected):
    with pytest.raises(UserInputError) as caught:
        checkpoint.check_resume("ckpt/step_000004/policy", saved, current)
    (line,) = caught.value.problems
    assert line.startswith("ckpt/step_000004/policy: ") and expected in line


def test_layout_descriptions_that_cannot_be_read_are_one_line(tmp_path):
    with pytest.raises(UserInputError, match="no layout.json; not a policy checkpoint"):
        checkpoint.read_saved(tmp_path)
    (tmp_path / checkpoint.LAYOUT_FILE).write_text("{")
    with pytest.raises(UserInputError, match="not a readable checkpoint description"):
        checkpoint.read_saved(tmp_path)
    meta = {"version": 99, "layout": {"tensor_parallel": 1, "pipeline_parallel": 1,
            "data_parallel": 1}, "has_optimizer": True, "step": 1}  # fmt: skip
    (tmp_path / checkpoint.LAYOUT_FILE).write_text(json.dumps(meta))
    with pytest.raises(UserInputError, match="version 99 is newer"):
        checkpoint.read_saved(tmp_path)


# ------------------------------------------------------------- the first format (one rank)
def _worker(**kwargs):
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    worker = PolicyWorker(
        settings=resolve_policy(section()), rank=0, world_size=1, seed=7, on_gpu=False, **kwargs
    )
    worker.setup(*worker.node_address())  # joins the fixture's process group
    return worker


def _write_first_format(worker, step_dir: Path) -> None:
    """A checkpoint as the first format's writer (before dist_checkpointing) saved one."""
    (step_dir / "policy").mkdir(parents=True)
    state = {
        "model": worker._unwrapped().state_dict(),
        "step": worker.step,
        "optimizer": worker.optimizer.state_dict(),
        "scheduler": worker.scheduler.state_dict(),
    }
    torch.save(state, step_dir / "policy" / "model_tp0_pp0.pt")
    (step_dir / "state.json").write_text(json.dumps({"step": worker.step, "position": 0}))


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if "extra" not in k)


def test_a_first_format_checkpoint_loads_weights_and_resumes(megatron_cpu, tmp_path):
    trained = _worker()
    for step in (1, 2):
        trained.train(worker_ranks.step_batches(step), worker_ranks.LOSS)
    _write_first_format(trained, tmp_path / "step_000002")
    policy_dir = str(tmp_path / "step_000002" / "policy")
    assert checkpoint.is_legacy(policy_dir)
    notes = checkpoint.check_resumable(policy_dir, _layout(dp=1))
    assert len(notes) == 1 and "no generator states" in notes[0]
    with pytest.raises(UserInputError, match="read only with the sizes it was saved with"):
        checkpoint.check_resumable(policy_dir, _layout(tp=2, dp=1))

    weights = _worker(with_reference=True)
    assert weights.load_checkpoint(policy_dir, weights_only=True) == 0
    want = trained._unwrapped().state_dict()
    assert _state_equal(weights._unwrapped().state_dict(), want)
    assert _state_equal(weights.reference.state_dict(), want)

    resumed = _worker()
    assert resumed.load_checkpoint(policy_dir) == 2
    expected = trained.train(worker_ranks.step_batches(3), worker_ranks.LOSS)
    got = resumed.train(worker_ranks.step_batches(3), worker_ranks.LOSS)
    assert (got["loss"], got["grad_norm"]) == (expected["loss"], expected["grad_norm"])
    assert _state_equal(resumed._unwrapped().state_dict(), trained._unwrapped().state_dict())
    for worker in (trained, weights, resumed):
        worker.close()


def _export(step_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    done = subprocess.run(
        [sys.executable, "-m", "nemo_rl_offload.cli", "export-hf", "--config",
         str(REPO / "examples" / "configs" / "tiny" / "sft.yaml"),
         "--checkpoint", str(step_dir), "--out", str(out)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))


def test_export_reads_both_formats_to_the_same_weights(megatron_cpu, tmp_path):
    worker = _worker()
    worker.train(worker_ranks.step_batches(1), worker_ranks.LOSS)
    _write_first_format(worker, tmp_path / "first" / "step_000001")
    current = tmp_path / "current" / "step_000001"
    worker.save_checkpoint(str(current / "policy"))
    (current / "state.json").write_text(json.dumps({"step": 1, "position": 0}))
    worker.close()
    first = _export(tmp_path / "first" / "step_000001", tmp_path / "hf_first")
    new = _export(tmp_path / "current", tmp_path / "hf_current")  # its latest step
    assert first.keys() == new.keys() and len(new) > 10
    assert all(torch.equal(first[name], new[name]) for name in first)


def test_a_checkpoint_of_another_model_or_with_damaged_files_is_one_line(
    megatron_cpu, moe_globals_restored, tmp_path
):
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    dense = _worker()
    dense.save_checkpoint(str(tmp_path / "dense"))
    moe = PolicyWorker(
        settings=resolve_policy({**section(), "model_name": "tiny-moe"}),
        rank=0,
        world_size=1,
        seed=7,
        on_gpu=False,
    )
    moe.setup(*moe.node_address())
    with pytest.raises(UserInputError) as caught:
        moe.load_checkpoint(str(tmp_path / "dense"), weights_only=True)
    (line,) = caught.value.problems
    assert line.startswith(f"{tmp_path / 'dense'}: cannot be read into this model")
    assert "Global shape mismatch" in line

    shutil.copytree(tmp_path / "dense", tmp_path / "damaged")
    for part in (tmp_path / "damaged").glob("*.distcp"):
        part.write_bytes(part.read_bytes()[:1000])
    with pytest.raises(UserInputError, match=r"__0_0.distcp: 1000 bytes, .* truncated"):
        dense.load_checkpoint(str(tmp_path / "damaged"))
    for worker in (dense, moe):
        worker.close()


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_bfloat16_training_resumes_bitwise(megatron_cpu, tmp_path, distributed):
    """Mixed precision: the optimizer steps float32 main weights beside the bfloat16 model,
    both in the checkpoint; a resumed worker's next step is bitwise the saving worker's."""

    policy = {
        **section(optimizer={"use_distributed_optimizer": distributed}),
        "precision": "bfloat16",
    }

    trained = worker_ranks.single_worker(policy)
    for step in (1, 2):
        trained.train(worker_ranks.step_batches(step), worker_ranks.LOSS)
    resumed = worker_ranks.resumes_exactly(trained, policy, tmp_path / "ckpt", (3, 4))
    assert _state_equal(resumed._unwrapped().state_dict(), trained._unwrapped().state_dict())
    for made in (trained, resumed):
        made.close()


# ------------------------------------------------------- crafted files run no code
class _Payload:
    """Unpickling this creates ``marker``: what a crafted checkpoint file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_crafted_checkpoint_files_are_refused_in_one_line_and_run_nothing(
    megatron_cpu, tmp_path, monkeypatch
):
    """The first format's shard (policy.init_checkpoint, export-hf), the current format's
    .metadata and an object stored inside its data file: each one line naming the file or
    entry; the payload never runs. The same worker still loads a real checkpoint."""
    import pickle

    marker = tmp_path / "ran"
    worker = _worker()
    worker.train(worker_ranks.step_batches(1), worker_ranks.LOSS)  # Adam's state exists
    worker.save_checkpoint(str(tmp_path / "real"))

    legacy = tmp_path / "legacy" / "policy"
    legacy.mkdir(parents=True)
    state = {"model": worker._unwrapped().state_dict(), "step": _Payload(marker)}
    torch.save(state, legacy / "model_tp0_pp0.pt")
    with pytest.raises(UserInputError) as caught:
        worker.load_checkpoint(str(legacy), weights_only=True)
    (line,) = caught.value.problems
    assert line.startswith(f"{legacy / 'model_tp0_pp0.pt'}: refused: it holds _io.open")

    crafted = tmp_path / "metadata"
    shutil.copytree(tmp_path / "real", crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UserInputError) as caught:
        worker.load_checkpoint(str(crafted))
    (line,) = caught.value.problems
    assert line.startswith(f"{crafted / '.metadata'}: refused: it names _io.open")

    monkeypatch.setattr(checkpoint, "_rng_state", lambda on_gpu: {"x": _Payload(marker)})
    worker.save_checkpoint(str(tmp_path / "object"))
    monkeypatch.undo()
    with pytest.raises(UserInputError) as caught:
        worker.load_checkpoint(str(tmp_path / "object"))
    (line,) = caught.value.problems
    assert line.startswith(f"{tmp_path / 'object'}: refused: its entry rng_state"), line
    assert "holds _io.open" in line
    assert not marker.exists()

    assert worker.load_checkpoint(str(tmp_path / "real")) == 1
    worker.close()
