"""The training loop's one data seam (algorithms/common.Run.examples) on NeMo-RL's recipes with
their own data sections: rows loaded from local copies, NeMo-RL's processors with its prompt
file and the policy's chat template, ground truths for the math environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl_offload.algorithms.common import prepare, token_sequence
from nemo_rl_offload.preflight import load_and_check

REPO = Path(__file__).resolve().parents[3]
RUNS = REPO / "tests" / "data" / "nemo_rl" / "runs"


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str, *overrides: str):
    monkeypatch.chdir(REPO)  # NeMo-RL reads data_path relative to the working directory
    report = load_and_check(
        RUNS / f"{recipe}.yaml",
        [f"logger.log_dir={tmp_path / 'logs'}", "checkpointing.enabled=false", *overrides],
        starting=True,
    )
    assert report.ok, report.errors
    return prepare(report, report.algorithm)


def test_grpo_prompts_are_nemo_rls_processed_rows(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, "grpo", "policy.model_name=tiny-dense")
    rows = [
        json.loads(line)
        for line in (REPO / "tests/data/nemo_rl/openmathinstruct2.jsonl").read_text().splitlines()
    ]
    train, val = run.examples("prompts", "train"), run.examples("prompts", "val")
    assert len(train) + len(val) == len(rows) and len(val) == 2  # 5% held out, as NeMo-RL
    answers = {row["expected_answer"] for row in rows}
    assert all(example.ground_truth in answers for example in train + val)
    text = run.tokenizer.decode(train[0].input_ids, skip_special=False)
    assert "Think step-by-step to solve the following problem" in text  # NeMo-RL's cot.txt
    assert text.startswith("<|user|>\n") and text.endswith("<|assistant|>\n")
    assert all(e.prompt_len == len(e.input_ids) for e in train)  # a prompt: nothing trains


def test_sft_examples_train_only_the_assistant_turn(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, "sft")
    (first, *_) = run.examples("sft", "train")
    sequence = token_sequence(first)
    trained = [t for t, m in zip(sequence.ids[1:], sequence.label_mask(), strict=True) if m]
    text = run.tokenizer.decode(trained)
    assert text.strip() == "Answer 0"  # squad's answer, after the recipe's template's "Answer:"
    assert "Question 0?" in run.tokenizer.decode(first.input_ids[: first.prompt_len])
