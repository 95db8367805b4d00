"""On-policy distillation inside GRPO (``grpo.adv_estimator.name: opd``) through the CLI, on two
CPU workers: the student samples, each response token's advantage is the teacher's
log-probability minus the student's, and the student moves towards the teacher.

Student and teacher are tiny random Llamas written by examples/make_hf_model.py with the same
character tokenizer; the teacher's output layer is scaled up, so its distribution is sharp
where the student's is nearly flat. The gap NeMo-RL logs
(``on_policy_distillation/teacher_student_logprob_gap_mean``: the mean over sampled tokens of
log teacher - log student, minus the student-to-teacher KL on the student's own samples) is far
below 0 at the start and must rise as the student learns the teacher's tokens. With the option
ignored (GRPO's reward advantages), nothing pulls the student towards the teacher, and the gap
is not even logged.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
import transformers
from support.training_cli import REPO, cli

TINY_GRPO = REPO / "examples" / "configs" / "tiny" / "grpo.yaml"
sys.path.insert(0, str(REPO / "examples"))

from make_hf_model import make_model_dir  # noqa: E402

GAP = "on_policy_distillation/teacher_student_logprob_gap_mean"
# How much of the starting gap the student must close in the run's steps (the tiny run closed
# far more: benchmarks/results/2026-11-27_cpu_on_policy_distillation.md).
MIN_GAP_CLOSED = 0.3


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("opd")
    student = make_model_dir(root / "student", layers=2, hidden=64, seed=0)
    teacher = make_model_dir(root / "teacher", layers=2, hidden=64, seed=1)
    sharp = transformers.AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(8.0)
    sharp.save_pretrained(teacher)
    return student, teacher


def _overrides(student: Path, teacher: Path, root: Path) -> list[str]:
    return [
        f"policy.model_name={student}",
        "policy.init_checkpoint=null",
        "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=8",
        "grpo.max_num_steps=8",
        "grpo.val_period=1000",
        "grpo.val_at_start=false",
        "policy.train_global_batch_size=64",
        "policy.train_micro_batch_size=16",
        "policy.logprob_batch_size=16",
        "policy.megatron_cfg.optimizer.lr=3.0e-3",
        "policy.megatron_cfg.optimizer.min_lr=3.0e-3",
        "policy.megatron_cfg.scheduler.lr_warmup_init=3.0e-3",
        "loss_fn.reference_policy_kl_penalty=0.0",
        # NeMo-RL's MOPD recipe's loss: REINFORCE with ICE-POP truncated importance sampling.
        "++loss_fn.disable_ppo_ratio=true",
        "loss_fn.use_importance_sampling_correction=true",
        "++loss_fn.truncated_importance_sampling_type=icepop",
        "++loss_fn.truncated_importance_sampling_ratio=5.0",
        "++loss_fn.truncated_importance_sampling_ratio_min=0.2",
        "++grpo.adv_estimator={name: opd}",
        "++on_policy_distillation={enabled: true, default_teacher_alias: math_agent, "
        # the teacher's forward-only micro-batches: 8 rows (the policy's are 16)
        "non_colocated_teachers: {default_teacher_cfg: {micro_batch_size: 8}}, "
        f"teacher_model_by_agent_name: {{math_agent: {teacher}}}}}",
        f"checkpointing.checkpoint_dir={root / 'ckpt'}",
        f"logger.log_dir={root / 'logs'}",
    ]


def test_the_student_closes_its_gap_to_the_teacher(models, tmp_path):
    student, teacher = models
    done = cli("grpo", "--config", str(TINY_GRPO), *_overrides(student, teacher, tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["phase"] == "train"]
    gaps = [r[GAP] for r in train]
    assert len(gaps) == 8, train[-1]
    assert all(r["on_policy_distillation/teacher_model_unique"] == 1.0 for r in train)
    first, last = statistics.mean(gaps[:2]), statistics.mean(gaps[-2:])
    assert first < 0, gaps  # the student's own samples are less likely under the teacher
    assert last > first + MIN_GAP_CLOSED * abs(first), gaps


def test_a_teacher_of_another_vocabulary_is_refused_before_any_worker(models, tmp_path):
    student, _ = models
    other = make_model_dir(tmp_path / "other", layers=1, hidden=32)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(config))
    done = cli("validate", "--config", str(TINY_GRPO), *_overrides(student, other, tmp_path))
    assert done.returncode != 0
    assert (
        "on_policy_distillation.teacher_model_by_agent_name.math_agent: " in done.stderr
        and "vocabulary" in done.stderr
    ), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
