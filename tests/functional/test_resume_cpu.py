"""A run that stops resumes exactly, through the CLI on 2 CPU workers (real Ray, gloo and
megatron dist_checkpointing).

One uninterrupted run of 6 steps (checkpoints at steps 3 and 6) is the reference. The stopped
run is what a crash in the middle of saving step 6 leaves: the checkpoint of step 3, a
half-written ``.tmp_step_000006`` directory, and metrics records for steps 4 to 6 that the
crashed run logged. Run again, it must resume from step 3, remove the half-written directory,
replace the records after step 3, and log per-step losses and gradient norms bitwise equal to
the uninterrupted run's.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from support.training_cli import TINY, metrics, outputs
from support.training_cli import cli as run_cli

EXACT_KEYS = ("loss", "grad_norm", "lr")
cli = functools.partial(run_cli, timeout=600)


def run(algorithm: str, overrides: list[str], root: Path) -> subprocess.CompletedProcess:
    config = TINY / f"{algorithm}.yaml"
    done = cli(algorithm, "--config", str(config), *overrides, *outputs(root))
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def stopped_while_saving(done: Path, stopped: Path, saved: int, saving: int) -> None:
    """``stopped``: what a run leaves that crashed halfway through writing the checkpoint of
    step ``saving``, its checkpoint of step ``saved`` complete; made from the uninterrupted run
    ``done``."""
    (stopped / "ckpt").mkdir(parents=True)
    shutil.copytree(done / "ckpt" / f"step_{saved:06d}", stopped / "ckpt" / f"step_{saved:06d}")
    partial = stopped / "ckpt" / f".tmp_step_{saving:06d}" / "policy"
    partial.mkdir(parents=True)
    for part in sorted((done / "ckpt" / f"step_{saving:06d}" / "policy").glob("*.distcp"))[:1]:
        shutil.copy(part, partial / part.name)  # one rank's data; no metadata, no state.json
    (stopped / "logs").mkdir()
    with (stopped / "logs" / "metrics.jsonl").open("w") as out:
        for record in metrics(done, "train"):
            if record["step"] > saved:  # logged by the crashed run before it saved
                record = {**record, **dict.fromkeys(EXACT_KEYS, -1.0)}
            out.write(json.dumps(record) + "\n")


def assert_resumes_exactly(
    algorithm: str, overrides: list[str], done: Path, stopped: Path, saved: int, steps: int
) -> None:
    """Run ``stopped`` (the run ``done`` crashed while saving its last step) again: it resumes
    from step ``saved`` and logs bitwise what ``done`` logged."""
    stopped_while_saving(done, stopped, saved, steps)
    again = run(algorithm, overrides, stopped)
    assert f"resumed from {stopped / 'ckpt' / f'step_{saved:06d}'} (step {saved})" in again.stderr
    assert "removed an incomplete checkpoint" in again.stderr
    names = sorted(p.name for p in (stopped / "ckpt").iterdir())
    assert names == [f"step_{saved:06d}", f"step_{steps:06d}"]
    expected, resumed = metrics(done, "train"), metrics(stopped, "train")
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    for want, got in zip(expected, resumed, strict=True):
        for key in EXACT_KEYS:
            assert got[key] == want[key], (got["step"], key, got[key], want[key])


SFT = [
    "sft.max_num_steps=6",
    "sft.val_period=0",
    "sft.val_at_start=false",
    "checkpointing.save_period=3",
    "checkpointing.keep_top_k=2",
]


@pytest.fixture(scope="module")
def sft_done(tmp_path_factory) -> Path:
    """The uninterrupted SFT run (plain optimizer): 6 steps, checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("sft") / "uninterrupted"
    run("sft", SFT, root)
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["step_000003", "step_000006"]
    return root


def test_sft_stopped_mid_save_resumes_bitwise(sft_done, tmp_path):
    assert_resumes_exactly("sft", SFT, sft_done, tmp_path / "stopped", saved=3, steps=6)


# The GRPO resume tests' step: 4 prompts x 4 generations in 2 micro-batches, checkpoints every
# 2 steps, no validation.
GRPO_STEPS = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "checkpointing.save_period=2",
    "checkpointing.keep_top_k=2",
]


def test_grpo_with_distributed_optimizer_resumes_bitwise(sft_done, tmp_path):
    """GRPO samples (its seeds derive from the step number) and holds a reference model for
    its KL penalty, which a resume gives back the init_checkpoint's weights; its workers use
    the distributed optimizer (its reduce-scatter and all-gather on gloo). Its forward-only
    passes run in micro-batches of policy.logprob_batch_size 4 (training: 8), and
    data.max_input_seq_length 14 cuts about half the prompts (kept with loss multiplier 0)."""
    grpo = [
        f"policy.init_checkpoint={sft_done / 'ckpt' / 'step_000003'}",
        "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
        "grpo.max_num_steps=4",
        *GRPO_STEPS,
        "policy.logprob_batch_size=4",
        "data.max_input_seq_length=14",
    ]
    done = tmp_path / "uninterrupted"
    first = run("grpo", grpo, done)
    assert (
        "data.max_input_seq_length: " in first.stderr and "train examples reach 14" in first.stderr
    )
    truncated = [r["prompts_truncated"] for r in metrics(done, "train")]
    assert all(0 <= n <= 4 for n in truncated) and sum(truncated) > 0, truncated
    assert_resumes_exactly("grpo", grpo, done, tmp_path / "stopped", saved=2, steps=4)


def test_sft_stopped_by_its_deadline_resumes_to_the_same_losses(sft_done, tmp_path):
    """checkpointing.checkpoint_must_save_by: a deadline of one second has passed when the
    first step ends (Ray's start alone takes longer), so the run saves step 1 and stops with
    exit 0 and a line saying how to go on; the same command without the deadline then runs
    steps 2 to 6, logging bitwise what the uninterrupted run logged. The cut prompts of
    data.max_input_seq_length are counted as examples_truncated (0 here: the limit is the
    total length, which every example is below)."""
    stopped = tmp_path / "stopped"
    first = run("sft", [*SFT, "checkpointing.checkpoint_must_save_by=00:00:00:01"], stopped)
    assert "checkpointing.checkpoint_must_save_by: stopped after step 1 of 6" in first.stderr
    assert "run the same command again" in first.stderr
    assert [r["step"] for r in metrics(stopped, "train")] == [1]
    assert sorted(p.name for p in (stopped / "ckpt").iterdir()) == ["step_000001"]
    again = run("sft", SFT, stopped)
    assert f"resumed from {stopped / 'ckpt' / 'step_000001'} (step 1)" in again.stderr
    expected, resumed = metrics(sft_done, "train"), metrics(stopped, "train")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for want, got in zip(expected, resumed, strict=True):
        for key in EXACT_KEYS:
            assert got[key] == want[key], (got["step"], key, got[key], want[key])
    assert all(r["examples_truncated"] == 0 for r in resumed)


def test_async_grpo_trains_on_older_rollouts_and_resumes_bitwise(sft_done, tmp_path):
    """grpo.async_grpo with max_trajectory_age_steps 1 (algorithms/async_rollouts.py): step 1
    trains on rollouts of the first weights, as the synchronous loop does; every later step on
    rollouts sampled by the weights of the step before (NeMo-RL's avg_trajectory_age 0, 1, 1),
    so from step 2 the sampler's log-probabilities are not the training pass's (the
    synchronous loop's agree to float rounding). A run stopped while saving step 3 resumes
    from step 2 with the rollouts that waited for step 3, and logs bitwise what the
    uninterrupted run logged. (DAPO's overlong penalty gives the tiny model's responses
    rewards that vary with their length, so that step 1 changes the weights.)"""
    grpo = [
        f"policy.init_checkpoint={sft_done / 'ckpt' / 'step_000003'}",
        "+grpo.reward_shaping={enabled: true, overlong_buffer_length: 6, "
        "overlong_buffer_penalty: 1, max_response_length: 8}",
        "grpo.max_num_steps=3",
        *GRPO_STEPS,
        "++loss_fn.use_importance_sampling_correction=true",
    ]
    asynchronous = [*grpo, "++grpo.async_grpo.enabled=true"]
    done = tmp_path / "uninterrupted"
    run("grpo", asynchronous, done)
    records = metrics(done, "train")
    assert [r["avg_trajectory_age"] for r in records] == [0.0, 1.0, 1.0]
    assert records[0]["grad_norm"] > 0
    # sampler against training log-probabilities: the same weights at step 1 (rounding only),
    # the weights of the step before after it
    errors = [r["token_mult_prob_error"] for r in records]
    assert abs(errors[0] - 1) < 1e-5 and all(e > 1.001 for e in errors[1:]), errors
    state = json.loads((done / "ckpt" / "step_000002" / "state.json").read_text())
    assert [(r["target"], r["generated_at"]) for r in state["async_rollouts"]] == [(3, 2)]
    assert_resumes_exactly("grpo", asynchronous, done, tmp_path / "stopped", saved=2, steps=3)
