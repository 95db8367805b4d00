"""Full recompute with each segment's input offloaded (``offload_modules: [layer_input]``) on a
GPU: llama-1b in bf16 at TOKENS tokens per micro-batch, full recompute (uniform, one layer per
segment) with and without it, both in deterministic mode (the reproducible attention kernel):
gradients must match bitwise (offloading moves bytes, it must not change one); the bytes a
forward leaves on the GPU until its backward must drop by most of the segment inputs' bytes;
the step's peak and time go to $NEMO_RL_OFFLOAD_RESULTS/layer_input_llama-1b.json.

    NEMO_RL_OFFLOAD_RESULTS=benchmarks/results/layer_input \\
        python3 -m pytest -m gpu -q tests/functional/test_layer_input_gpu.py
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from support.gpu_results import write_results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODEL, TOKENS, STEPS = "llama-1b", 8192, 3
FULL_RECOMPUTE = {
    "activation_checkpointing": True,
    "recompute_num_layers": 1,
    # Bitwise comparable: flash attention's backward is not deterministic.
    "model_overrides": {"deterministic_mode": True},
}
LAYER_INPUT = {"fine_grained_activation_offloading": True, "offload_modules": ["layer_input"]}


def _run(**cfg: Any) -> dict[str, Any]:
    """STEPS forward-backward steps of a seeded bf16 llama-1b: gradients of the last step,
    bytes held from forward to backward, peak over the step and seconds per step (median)."""
    from support.policies import make_policy

    from nemo_rl_offload.config.megatron_settings import effective_settings
    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.models.builder import build_gpt_model

    policy = make_policy(MODEL, **cfg)
    arch = architecture_for(MODEL)
    effective = effective_settings(policy, arch, te_installed=False)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # Both runs build the same weights: Megatron initialises them from its own CUDA RNG
    # tracker, which the first build advances.
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model, _ = build_gpt_model(effective, arch, on_gpu=True)
    model = model.to(torch.bfloat16)
    initial = [param.detach().float().sum().item() for param in model.parameters()]
    generator = torch.Generator().manual_seed(7)
    held, peaks, seconds = [], [], []
    for _ in range(STEPS):
        ids = torch.randint(0, arch.vocab_size, (1, TOKENS), generator=generator).cuda()
        position = torch.arange(TOKENS, device="cuda").unsqueeze(0)
        # Gradients stay allocated after the first step (zeroed, accumulated into in place),
        # so the step's peak is the activations': otherwise the backward's last layers, where
        # every gradient has been allocated and no layer input is left, set it for both runs.
        for param in model.parameters():
            if param.grad is not None:
                param.grad.zero_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = model(ids, position, None, labels=torch.roll(ids, -1, 1)).float().mean()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before)
        loss.backward()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated() - before)
    grads = [param.grad.detach().clone() for param in model.parameters()]
    layers = len(model.decoder.layers)
    del model, loss
    torch.cuda.empty_cache()
    return {
        "initial": initial,
        "grads": grads,
        "held_gib": held[-1] / 2**30,
        "peak_gib": peaks[-1] / 2**30,
        "step_s": sorted(seconds)[len(seconds) // 2],
        "layers": layers,
    }


def test_layer_input_offload_on_gpu(megatron_gpu):
    plain = _run(**FULL_RECOMPUTE)
    offloaded = _run(**FULL_RECOMPUTE, **LAYER_INPUT)

    assert plain["initial"] == offloaded["initial"], "the same weights"
    diff = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(plain["grads"], offloaded["grads"], strict=True)
    )
    from nemo_rl_offload.config.model_presets import architecture_for

    hidden = architecture_for(MODEL).transformer["hidden_size"]
    segment_inputs_gib = plain["layers"] * TOKENS * hidden * 2 / 2**30
    results = {
        "model": MODEL,
        "tokens": TOKENS,
        "segment_inputs_gib": segment_inputs_gib,
        "max_grad_diff": diff,
        **{f"full_recompute_{k}": v for k, v in plain.items() if k not in ("grads", "initial")},
        **{f"layer_input_{k}": v for k, v in offloaded.items() if k not in ("grads", "initial")},
    }
    write_results(f"layer_input_{MODEL}", results)
    print(results)
    assert all(
        torch.equal(a, b) for a, b in zip(plain["grads"], offloaded["grads"], strict=True)
    ), results
    saved = plain["held_gib"] - offloaded["held_gib"]
    assert saved >= 0.9 * segment_inputs_gib, results
    assert offloaded["peak_gib"] < plain["peak_gib"], results
