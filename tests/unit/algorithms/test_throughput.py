"""A step's throughput metrics in NeMo-RL's units, and the model FLOPs they rest on."""

from __future__ import annotations

import pytest

from nemo_rl_offload.algorithms.throughput import step_throughput
from nemo_rl_offload.config.megatron_settings import effective_settings
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.models.flops import peak_bf16_flops, training_flops


def _effective(model: str):
    section = {"model_name": model, "precision": "bfloat16", "megatron_cfg": {"enabled": True}}
    return effective_settings(section, architecture_for(model), te_installed=False)


def test_per_gpu_throughputs_divide_the_steps_tokens_by_each_phase_and_every_gpu():
    out = step_throughput(
        lengths=[100, 300],
        gpus=2,
        elapsed_s=4.0,
        phases_s={"generation": 2.0, "policy_and_reference_logprobs": 0.5, "policy_training": 1.0},
        training_flops=2e15,
        peak_tflops=1000.0,
    )
    assert out["tokens_per_sec_per_gpu"] == pytest.approx(400 / 4 / 2)
    assert out["samples_per_sec_per_gpu"] == pytest.approx(2 / 4 / 2)
    assert out["policy_training_tokens_per_sec_per_gpu"] == pytest.approx(400 / 1 / 2)
    assert out["policy_and_reference_logprobs_tokens_per_sec_per_gpu"] == pytest.approx(400)
    assert out["training_worker_group_tokens_per_sec_per_gpu"] == pytest.approx(400 / 1.5 / 2)
    assert out["train_flops_per_gpu"] == pytest.approx(1000.0)  # TFLOP/s
    assert out["train_fp_utilization"] == pytest.approx(1.0)


def test_phases_that_did_not_run_and_unknown_gpus_are_left_out():
    out = step_throughput(
        lengths=[10],
        gpus=1,
        elapsed_s=1.0,
        phases_s={"policy_training": 0.5, "policy_and_reference_logprobs": 0.0},
        training_flops=1e12,
        peak_tflops=0.0,
    )
    assert "policy_and_reference_logprobs_tokens_per_sec_per_gpu" not in out
    assert "train_flops_per_gpu" in out and "train_fp_utilization" not in out


def test_model_flops_are_six_per_weight_and_token_plus_causal_attention():
    """llama-1b: 16 layers of (q, k, v, o) and a SwiGLU MLP, an untied output layer."""
    effective = _effective("llama-1b")
    arch = architecture_for("llama-1b").transformer
    h, ffn, layers = arch["hidden_size"], arch["ffn_hidden_size"], arch["num_layers"]
    kv = arch["num_query_groups"] * h // arch["num_attention_heads"]
    vocab = architecture_for("llama-1b").vocab_size
    weights = layers * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + vocab * h
    s = 1000
    want = 6 * weights * s + 3 * 2 * s * s * h * layers
    assert training_flops(effective, vocab, [s]) == pytest.approx(want)
    # Sequences count by their own lengths: two of 500 do less attention work than one of 1000.
    assert training_flops(effective, vocab, [500, 500]) < training_flops(effective, vocab, [s])


def test_moe_layers_count_the_routed_experts_not_all_of_them():
    effective = _effective("moe-1b")
    vocab = architecture_for("moe-1b").vocab_size
    more = effective_settings(
        {
            "model_name": "moe-1b",
            "precision": "bfloat16",
            "megatron_cfg": {"enabled": True, "model_overrides": {"num_moe_experts": 64}},
        },
        architecture_for("moe-1b"),
        te_installed=False,
    )
    # More experts at the same top-k: only the router grows.
    base, bigger = training_flops(effective, vocab, [128]), training_flops(more, vocab, [128])
    assert 0 < bigger - base < 0.01 * base


def test_the_peak_is_known_for_h100_and_h200_only():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA A10G") == 0.0


def test_decode_work_counts_the_longest_row_and_every_position_read() -> None:
    from types import SimpleNamespace

    from nemo_rl_offload.algorithms.throughput import DecodeWork

    work = DecodeWork()
    prompts = [SimpleNamespace(ids=[1] * 10), SimpleNamespace(ids=[1] * 4)]
    work.add(prompts, [[5, 6, 7], [5]])  # the batch decodes 3 steps
    work.add(prompts[:1], [[5, 6]])  # a second batch (dynamic sampling): 2 more
    work.add([], [])
    metrics = work.metrics()
    assert metrics["generation_rows"] == 3
    assert metrics["generation_decode_steps"] == 5
    # row 1 reads 10, 11, 12 positions; row 2 reads 4; row 3 reads 10, 11
    assert metrics["generation_attended_positions"] == 33 + 4 + 21
