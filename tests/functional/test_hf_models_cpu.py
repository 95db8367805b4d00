"""Starting from a local Hugging Face directory and exporting back, through the CLI, on CPU.

A tiny random Llama with a character tokenizer is written by examples/make_hf_model.py. SFT
starts from it: its first validation loss must be what transformers computes for the same
model on the same data (the weights and the tokenizer really came from the directory). The
trained checkpoint is exported with ``export-hf``; transformers loads the export, and its loss
on the same data must equal the run's last validation loss. Broken directories fail before
any worker starts, with one line naming the file or tensor.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from support.training_cli import REPO, cli

TINY_SFT = REPO / "examples" / "configs" / "tiny" / "sft.yaml"
sys.path.insert(0, str(REPO / "examples"))

from make_hf_model import make_model_dir  # noqa: E402


def _val_microbatches(model_dir: Path, overrides: list[str]) -> list[dict]:
    """The validation micro-batches the SFT run evaluates, built with the package's own code."""
    from nemo_rl_offload.algorithms import batching
    from nemo_rl_offload.data.datasets import encode_and_check_lengths, load_split
    from nemo_rl_offload.data.tokenizer import load_tokenizer
    from nemo_rl_offload.preflight import load_and_check

    report = load_and_check(str(TINY_SFT), overrides)
    recipe = report.recipe
    cfg, policy = recipe["sft"], recipe["policy"]
    tokenizer = load_tokenizer(None, str(model_dir))
    examples = load_split(report.run.data, "sft", "val")
    encoded = encode_and_check_lengths(
        examples, tokenizer, int(policy["max_total_sequence_length"]), "data"
    )
    sequences = [batching.TokenSequence(list(e.input_ids), e.prompt_len) for e in encoded]
    sequences = sequences[: int(cfg["val_batches"]) * int(cfg["val_global_batch_size"])]
    return batching.microbatches(
        sequences,
        int(cfg["val_micro_batch_size"]),
        pad_id=tokenizer.pad_id,
        round_to=int(policy.get("make_sequence_length_divisible_by", 1) or 1),
    )


def _hf_nll(model_dir: Path, microbatches: list[dict]) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for mb in microbatches:
            logits = model(torch.tensor(mb["input_ids"])).logits.float()
            logprobs = torch.log_softmax(logits, dim=-1)
            labels = torch.tensor(mb["labels"]).unsqueeze(-1)
            picked = logprobs.gather(-1, labels).squeeze(-1).numpy()
            total += float(-(picked * mb["loss_mask"]).sum())
            count += float(mb["loss_mask"].sum())
    return total / count


def _val_losses(log_dir: Path) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in lines if "val_loss" in r]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("hf") / "tiny-llama", layers=2, hidden=64)


# Multi-token prediction on: its block starts from its initialisation (the directory has none),
# trains beside the policy, and is left out of the export, whose logits are the policy's.
MTP = [
    "++policy.megatron_cfg.mtp_num_layers=1",
    "++policy.megatron_cfg.mtp_loss_scaling_factor=0.3",
]


@pytest.mark.parametrize("extra", [[], MTP], ids=["plain", "mtp"])
def test_sft_starts_from_the_directory_and_exports_back(model_dir, tmp_path, extra):
    overrides = [
        f"policy.model_name={model_dir}",
        "sft.max_num_steps=4",
        "sft.val_period=4",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
        *extra,
    ]
    done = cli("sft", "--config", str(TINY_SFT), *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    if extra:
        logged = [
            json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
        ]
        assert any("mtp_1_loss" in record for record in logged)
    (first_step, first), *_, (last_step, last) = _val_losses(tmp_path / "logs")
    assert (first_step, last_step) == (0, 4)
    microbatches = _val_microbatches(model_dir, overrides)
    assert first == pytest.approx(_hf_nll(model_dir, microbatches), abs=1e-4)

    out = tmp_path / "export"
    done = cli(
        "export-hf",
        "--config",
        str(TINY_SFT),
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--out",
        str(out),
        *overrides,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("multi-token prediction block" in done.stderr) == bool(extra)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    exported = _hf_nll(out, microbatches)
    assert exported == pytest.approx(last, abs=1e-4)
    assert abs(exported - first) > 1e-3  # it trained: the export is not the starting point

    again = cli(
        "export-hf", "--config", str(TINY_SFT), "--checkpoint", str(tmp_path / "ckpt"),
        "--out", str(out), *overrides,
    )  # fmt: skip
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
    assert "Traceback" not in again.stderr


def _broken_copy(model_dir: Path, tmp_path: Path, change) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    change(broken)
    return broken


def _reshape_a_tensor(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    state[name] = torch.zeros(state[name].shape[0] * 2, state[name].shape[1])
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "change,expected",
    [
        (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"not safetensors"), "not a readable"),
        (_reshape_a_tensor, "model.layers.1.self_attn.q_proj.weight"),
    ],
    ids=["missing_weights", "corrupt_weights", "wrong_shape"],
)
def test_a_broken_directory_is_one_line_before_any_worker(model_dir, tmp_path, change, expected):
    broken = _broken_copy(model_dir, tmp_path, change)
    done = cli(
        "sft",
        "--config",
        str(TINY_SFT),
        f"policy.model_name={broken}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    problems = [line for line in done.stderr.splitlines() if line.startswith(str(broken))]
    assert len(problems) == 1 and expected in problems[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "ckpt").exists()
