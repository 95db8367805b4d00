"""The activation ledger on a GPU: the ledger derived on the CPU for llama-1b in bf16 at 2048
tokens per micro-batch (examples/configs/grpo_math_1B_megatron.yaml, one sequence a
micro-batch) against what one training micro-batch holds on the GPU without offloading. Both
numbers, and the ledger, go to $NEMO_RL_OFFLOAD_RESULTS/ledger_llama-1b.json.

    NEMO_RL_OFFLOAD_RESULTS=benchmarks/results/ledger \\
        python3 -m pytest -m gpu -q tests/functional/test_ledger_gpu.py

Two measurements: the bytes a training forward leaves allocated until its backward (what the
ledger claims to count), and the step's activation peak as the worker reports it
(``peak_activation_gpu_memory_gib``: the forward-backward peak over the resident state, which
adds the backward's transient tensors on top).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.gpu_results import write_results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODEL, TOKENS = "llama-1b", 2048
REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "examples" / "configs" / "grpo_math_1B_megatron.yaml")
OVERRIDES = [
    "policy.train_micro_batch_size=1",
    "policy.logprob_batch_size=1",
    f"policy.max_total_sequence_length={TOKENS}",
]


def _section() -> dict:
    """The recipe's policy (llama-1b, bf16, NeMo-RL's fusions) at one sequence of TOKENS."""
    from nemo_rl_offload.preflight import load_and_check

    report = load_and_check(RECIPE, OVERRIDES)
    assert not report.errors, report.errors
    return report.recipe["policy"]


# The ledger is built on the CPU in a process of its own: it needs one gloo rank and
# Megatron's CPU execution, this process needs nccl and none of that.
LEDGER = """
import json, sys
from nemo_rl_offload.planning.ledger_run import build_ledger
print(json.dumps(build_ledger(json.loads(sys.argv[1])).as_json()))
"""


@pytest.fixture(scope="module")
def measured() -> dict:
    import numpy as np

    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    section = _section()
    done = subprocess.run(
        [sys.executable, "-c", LEDGER, json.dumps(section)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    ledger = json.loads(done.stdout.strip().splitlines()[-1])
    worker = PolicyWorker(
        settings=resolve_policy(section), rank=0, world_size=1, seed=1, on_gpu=True
    )
    worker.setup(*worker.node_address())
    worker.model.train()
    vocab = worker.architecture.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, (1, TOKENS))
    microbatch = {"input_ids": ids, "labels": ids, "loss_mask": np.ones((1, TOKENS), "f4")}
    try:
        worker.train([microbatch], {"name": "nll"})  # optimizer state, allocator warm
        step = worker.train([microbatch], {"name": "nll"})
        tokens = torch.as_tensor(ids, device="cuda")
        positions = torch.arange(TOKENS, device="cuda").unsqueeze(0)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = worker.model(tokens, positions, None, labels=tokens).sum()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        del loss
    finally:
        worker.close()
    result = {
        "model": MODEL,
        "tokens_per_microbatch": TOKENS,
        "ledger_bytes": ledger["total_bytes_per_microbatch"],
        "forward_held_bytes": held,
        "step_activation_peak_bytes": step["peak_activation_gpu_memory_gib"] * 2**30,
        "ledger": ledger,
    }
    write_results(f"ledger_{MODEL}", result)
    return result


def test_the_ledger_matches_what_a_training_forward_holds_on_the_gpu(measured):
    assert measured["ledger_bytes"] == pytest.approx(measured["forward_held_bytes"], rel=0.05)


def test_the_steps_activation_peak_is_the_ledger_and_the_backwards_first_transient(measured):
    """The step peaks as its backward starts: everything the ledger counts is still held, and
    the loss's backward adds the logits' gradient (of one micro-batch: at most its float32
    logits, [tokens, vocab] x 4 bytes; the planner calibrates this offset from measured steps)."""
    from nemo_rl_offload.config.model_presets import architecture_for

    logits_float32 = TOKENS * architecture_for(MODEL).vocab_size * 4
    excess = measured["step_activation_peak_bytes"] - measured["ledger_bytes"]
    assert 0 <= excess <= logits_float32, (excess, logits_float32)
