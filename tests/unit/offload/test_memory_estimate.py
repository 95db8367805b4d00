"""The pre-launch memory estimate (nemo_rl_offload/planning/memory_estimate.py): its arithmetic
against the H100 measurements of issue 20, and each setting's effect both ways.

The ledger is the 3B-shaped Llama's (llama-1b with 28 layers, hidden 3072, ffn 8192, 24 heads,
8 query groups), as ``nemo-rl-offload plan --ledger`` measured it on the CPU and
:mod:`nemo_rl_offload.planning.ledger_cache` stores it (``ledger_llama3b_shape.json``): the
arithmetic is tested on its own, without measuring a layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.policies import make_policy

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.planning.ledger_cache import ledger_from_stored
from nemo_rl_offload.planning.memory_estimate import (
    GIB,
    MemoryEstimate,
    estimate_peak,
    gpu_peak,
    host_optimizer_state,
    parameter_counts,
)

STORED = json.loads((Path(__file__).parent / "ledger_llama3b_shape.json").read_text())
SHAPE = {
    "num_layers": 28,
    "hidden_size": 3072,
    "ffn_hidden_size": 8192,
    "num_attention_heads": 24,
    "num_query_groups": 8,
}
FIVE = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


def _section(tokens: int = 8192, distributed: bool = True, **cfg: Any) -> dict[str, Any]:
    optimizer = {"optimizer": "adam", "lr": 1e-5, "use_distributed_optimizer": distributed}
    optimizer.update(cfg.pop("optimizer", {}))
    section = make_policy("llama-1b", model_overrides=SHAPE, **cfg)
    section["megatron_cfg"]["optimizer"] = optimizer
    section["megatron_cfg"]["distributed_data_parallel_config"] = {"grad_reduce_in_fp32": False}
    section.update(max_total_sequence_length=tokens, train_micro_batch_size=1)
    return section


def _estimate(section: dict[str, Any], **kwargs: Any) -> MemoryEstimate:
    architecture = architecture_for("llama-1b")
    effective = megatron_settings.effective_settings(section, architecture, te_installed=False)
    ledger = ledger_from_stored(STORED, effective, section, "policy", (32, 64))
    return estimate_peak(effective, architecture, section, ledger, **kwargs)


FULL = {"activation_checkpointing": True}
OFFLOAD_FIVE = {"fine_grained_activation_offloading": True, "offload_modules": FIVE}

# The training step's peak (forward-backward, measured after zero_grad) of the 3B shape at
# 2 micro-batches on one H100 80GB, megatron-core 0.19.2, no Transformer Engine. Source: the
# text of issue 20 (planner runs with the distributed optimizer; benchmarks/offload_benchmark.py
# without it).
MEASURED = [
    ("no offload, distributed optimizer", 8192, True, {}, 67.81),
    ("full recompute, distributed optimizer", 8192, True, FULL, 47.88),
    ("full recompute", 8192, False, FULL, 47.88),
    ("full recompute", 16384, False, FULL, 50.75),
    ("all five offload modules, distributed optimizer", 8192, True, OFFLOAD_FIVE, 58.94),
    pytest.param(
        "all five offload modules",
        8192,
        False,
        OFFLOAD_FIVE,
        65.95,
        marks=pytest.mark.xfail(
            strict=True,
            reason="estimated 11.5% low and not explained "
            "(benchmarks/results/2026-11-25_cpu_memory_estimate_vs_issue20_h100.md)",
        ),
    ),
]
TOLERANCE = 0.05


@pytest.mark.parametrize(("case", "tokens", "distributed", "cfg", "measured_gib"), MEASURED)
def test_training_peak_is_within_tolerance_of_the_h100_measurement(
    case, tokens, distributed, cfg, measured_gib
):
    estimate = _estimate(_section(tokens, distributed, **cfg))
    predicted = estimate.phases()["training"] / GIB
    assert abs(predicted - measured_gib) <= TOLERANCE * measured_gib, (case, predicted)


def test_the_parts_of_the_3b_shape():
    """3.02B parameters: bf16 weights and gradient buffers, Adam's float32 master and moments
    (12 bytes each) on one rank; the ledger's 22.3 GiB of activations with nothing removed."""
    estimate = _estimate(_section())
    assert estimate.parameters.total == pytest.approx(3.0154e9, rel=1e-3)
    assert estimate.weights == pytest.approx(2 * estimate.parameters.total)
    assert estimate.gradients == estimate.weights
    assert estimate.optimizer == pytest.approx(12 * estimate.parameters.total)
    assert estimate.gradient_copies == pytest.approx(4 * estimate.parameters.total)
    assert estimate.activations.total / GIB == pytest.approx(22.3, abs=0.2)
    assert estimate.activations.total == pytest.approx(estimate.activations.saved)
    assert estimate.kv_cache == 0 and estimate.reference_weights == 0


def test_distributed_optimizer_shards_the_state_over_data_parallel_ranks():
    alone = _estimate(_section(), workers=2)
    plain = _estimate(_section(distributed=False), workers=2)
    assert alone.optimizer == pytest.approx(plain.optimizer / 2)
    assert alone.gradients == plain.gradients  # the gradient buffer is whole on every rank


def test_optimizer_cpu_offload_moves_its_fraction_to_the_host():
    """The share on the host leaves the GPU; the share kept there also holds megatron-core's
    hybrid optimizer's float32 gradient copies through the training step (4 bytes a
    parameter), where the plain optimizer's are freed before it."""
    host = {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 0.75,
        "use_precision_aware_optimizer": True,  # the path the hybrid optimizer needs
    }
    moved = _estimate(_section(optimizer=host))
    kept = _estimate(_section())
    params = kept.parameters.total
    assert moved.optimizer == pytest.approx(kept.optimizer * 0.25 + 4 * params * 0.25)
    assert moved.optimizer_on_host == pytest.approx(kept.optimizer * 0.75)
    assert moved.gradient_copies == 0 and kept.gradient_copies == pytest.approx(4 * params)
    assert kept.optimizer_on_host == 0


def test_the_planners_host_optimizer_line_is_the_estimates_resident_state_at_each_share():
    """What the planner's host-optimizer prior takes off the training step's resident state at
    share s: the estimate's optimizer state of the recipe as it is less that with
    optimizer_cpu_offload at s, a line (bytes at no share + s x bytes per share). At no share
    it costs memory (the hybrid optimizer's gradient copies); with the distributed optimizer
    the state and the parameters stepped are a rank's shard."""
    architecture = architecture_for("llama-1b")
    for workers in (1, 2):
        section = _section()
        effective = megatron_settings.effective_settings(section, architecture, te_installed=False)
        per_share, at_none, parameters = host_optimizer_state(
            effective, architecture, section, workers=workers
        )
        plain = _estimate(section, workers=workers)
        for share in (0.25, 0.5, 1.0):
            host = {
                "optimizer_cpu_offload": True,
                "optimizer_offload_fraction": share,
                "use_precision_aware_optimizer": True,
            }
            moved = _estimate(_section(optimizer=host), workers=workers)
            assert at_none + share * per_share == pytest.approx(plain.resident - moved.resident)
        assert at_none < 0
        assert parameters == pytest.approx(plain.parameters.total / workers)


def test_offload_modules_remove_their_entries_but_the_last_layers():
    five = _estimate(_section(**OFFLOAD_FIVE)).activations
    plain = _estimate(_section()).activations
    removed = sum(five.removed_by().values())
    # attn_proj's input is the attention's output, charged to core attention, which saves it.
    assert set(five.removed_by()) == {f"offload {name}" for name in FIVE if name != "attn_proj"}
    # Every ledger entry these modules reach, but the last layer's, which Megatron's offload
    # manager keeps, and tensors under min_offloaded_tensor_size (the norms' float32
    # statistics, a few KiB).
    section = _section(**OFFLOAD_FIVE)
    effective = megatron_settings.effective_settings(
        section, architecture_for("llama-1b"), te_installed=False
    )
    ledger = ledger_from_stored(STORED, effective, section, "policy", (32, 64))
    reach = sum(
        k.layers * e.bytes_at(8192) for k in ledger.kinds for e in k.entries if e.offload in FIVE
    )
    assert removed == pytest.approx(reach * 27 / 28, rel=0.01)
    assert removed < reach * 27 / 28
    assert plain.total - five.total == pytest.approx(removed)
    half = _estimate(_section(**OFFLOAD_FIVE, activation_offload_fraction=0.5)).activations
    assert sum(half.removed_by().values()) == pytest.approx(removed / 2)


def test_the_attentions_output_leaves_only_when_the_projection_offloads_it_too():
    """SDPA and the output projection save the attention's output (one storage): offloading
    core_attn alone leaves it on the GPU, where the projection keeps it (the runtime does not
    copy it either: offload/shared_copies.py); with attn_proj it goes, once."""
    alone = _estimate(
        _section(fine_grained_activation_offloading=True, offload_modules=["core_attn"])
    )
    pair = _estimate(
        _section(
            fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj"]
        )
    )
    output = 6144 * 8192 * 27  # bytes per token x tokens x the layers but the last
    assert alone.activations.total - pair.activations.total == pytest.approx(output, rel=1e-6)
    assert pair.activations.offloaded - alone.activations.offloaded == pytest.approx(output)


def test_selective_recompute_removes_its_entries():
    cfg = {
        "activation_checkpointing": True,
        "recompute_granularity": "selective",
        "recompute_modules": ["mlp"],
    }
    mlp = _estimate(_section(**cfg)).activations
    assert set(mlp.removed_by()) == {"recompute mlp", "recompute mlp_act"}
    assert mlp.total < _estimate(_section()).activations.total


def test_full_recompute_keeps_layer_inputs_and_one_segment_and_layer_input_offload_the_inputs():
    full = _estimate(_section(**FULL)).activations
    hidden_bytes = 3072 * 8192 * 2
    assert full.layer_inputs == 28 * hidden_bytes
    assert sum(m.kept for m in full.modules) == 0
    offloaded = _estimate(
        _section(**FULL, fine_grained_activation_offloading=True, offload_modules=["layer_input"])
    ).activations
    # Every input goes to the host; backward holds two: the segment's being recomputed and
    # the one before it, reloading beside it (offload/layer_input.py).
    assert offloaded.layer_inputs == 2 * hidden_bytes
    assert offloaded.offloaded == 28 * hidden_bytes and full.offloaded == 0
    assert offloaded.total < full.total
    two = _estimate(_section(**FULL, recompute_num_layers=2)).activations
    assert two.layer_inputs == 14 * hidden_bytes
    assert two.recomputed_segment == pytest.approx(2 * full.recomputed_segment)


def test_tensor_parallelism_divides_weights_and_activations():
    one = _estimate(_section(), workers=2)
    two = _estimate(_section(tensor_model_parallel_size=2), workers=2)
    assert two.weights < 0.51 * one.weights
    assert 0.5 * one.activations.total < two.activations.total < one.activations.total


def test_a_reference_copy_and_sampling_add_their_parts():
    estimate = _estimate(_section(), with_reference=True, samples_per_step=64)
    assert estimate.reference_weights == estimate.weights
    # 64 sequences of 8192 tokens: 28 layers x keys and values x 8 groups x 128 x bf16.
    assert estimate.kv_cache == 2 * 28 * 64 * 8192 * 8 * 128 * 2
    assert estimate.phases()["generation"] == estimate.between_steps + estimate.kv_cache
    plain = _estimate(_section())
    assert "generation" not in plain.phases()


def test_kv_cache_is_bounded_by_the_prompt_and_new_tokens_and_by_buffer_size_gb():
    section = _section()
    section["generation"] = {"max_new_tokens": 1024}
    short = _estimate(section, samples_per_step=64, longest_prompt=1024)
    assert short.kv_cache_length == 2048
    section["generation"]["mcore_generation_config"] = {"buffer_size_gb": 1}
    capped = _estimate(section, samples_per_step=64, longest_prompt=1024)
    assert capped.kv_cache == GIB
    assert "buffer_size_gb" in capped.notes[0]


def test_a_teacher_beside_the_policy_adds_what_it_keeps():
    policy = _estimate(_section())
    teacher = _estimate(_section(), where="teacher", trainable=False)
    assert teacher.activations is None and teacher.gradients == 0
    peak, label = gpu_peak([policy, teacher])
    assert label == f"policy {policy.peak_phase}"
    assert peak == pytest.approx(policy.peak + teacher.between_steps)


# The whole step's peak of the 3B shape on one H100 (distributed optimizer, no reference copy,
# torch's Adam), the same in every case of the long-context matrix whatever its activations:
# benchmarks/results/2026-11-25_h100x2_long_context_3b.md ("step peak").
MEASURED_OPTIMIZER_STEP_GIB = 67.47


def test_the_optimizer_step_holds_the_gradient_copies_and_torch_adams_temporary():
    """Without a fused Adam the step holds two float32 parameter-sized buffers over the
    resident state (the gradients' copies and the denominator), as measured; a fused Adam
    (Transformer Engine or Apex on the job's machine) holds only the copies."""
    torch_adam = _estimate(_section())
    assert torch_adam.step_temporaries == pytest.approx(4 * torch_adam.parameters.total)
    measured = MEASURED_OPTIMIZER_STEP_GIB * GIB
    assert abs(torch_adam.phases()["optimizer step"] - measured) <= 0.01 * measured
    fused = _estimate(_section(), fused_adam=True)
    assert fused.step_temporaries == 0
    assert fused.phases()["optimizer step"] == pytest.approx(fused.between_steps)
    sgd = _estimate(_section(optimizer={"optimizer": "sgd"}))
    assert sgd.step_temporaries == 0
    sharded = _estimate(_section(), workers=2)
    assert sharded.step_temporaries == pytest.approx(torch_adam.step_temporaries / 2)


PLANNER_CANDIDATES = [
    ("offload set", {"modules": tuple(FIVE)}),
    ("offload fraction", {"modules": ("core_attn", "mlp_fc1"), "fraction": 0.5}),
    ("selective recompute", {"recompute_modules": ("mlp", "layernorm")}),
    ("recompute and offload", {"modules": ("core_attn",), "recompute_modules": ("mlp",)}),
    ("full recompute", {"full_recompute": True}),
    ("full recompute, layer_input", {"modules": ("layer_input",), "full_recompute": True}),
    ("block recompute", {"full_recompute": True, "recompute_num_layers": 7}),
]


@pytest.mark.parametrize(
    "parallel",
    [{}, {"tensor_model_parallel_size": 2, "sequence_parallel": True}],
    ids=["tp1", "tp2-sp"],
)
@pytest.mark.parametrize(
    ("case", "fields"), PLANNER_CANDIDATES, ids=[c for c, _ in PLANNER_CANDIDATES]
)
def test_the_planners_prediction_for_a_candidate_is_validates_estimate_of_its_settings(
    case, fields, parallel
):
    """The planner predicts a candidate's kept and moved bytes from the recipe's table; the
    estimate of the recipe with the candidate's patch applied must say the same."""
    from nemo_rl_offload.config.loader import deep_merge
    from nemo_rl_offload.planning import cost_model
    from nemo_rl_offload.planning.plan_menu import Candidate, layer_costs

    fields = dict(fields)
    candidate = Candidate(fields.pop("modules", ()), fields.pop("fraction", 1.0), None, **fields)
    section = _section(**parallel)
    architecture = architecture_for("llama-1b")
    effective = megatron_settings.effective_settings(section, architecture, te_installed=False)
    ledger = ledger_from_stored(STORED, effective, section, "policy", (32, 64))
    costs = layer_costs(effective, ledger, lambda kind, option: 0.0, 2)
    predicted = cost_model.removal(costs, candidate.settings())

    patched = deep_merge(section, candidate.patch()["policy"])
    estimated = _estimate(patched).activations
    assert predicted.activation_bytes == pytest.approx(estimated.total, rel=1e-12), case
    assert predicted.offloaded_bytes == pytest.approx(estimated.offloaded, rel=1e-12), case
    assert estimated.total < estimated.saved, case  # each candidate removes something


def test_multi_token_prediction_adds_a_layer_and_its_projection_per_depth():
    architecture = architecture_for("llama-1b")

    def params(**cfg: Any) -> float:
        effective = megatron_settings.effective_settings(
            make_policy("llama-1b", **cfg), architecture, te_installed=False
        )
        counts = parameter_counts(effective, architecture)
        return counts.layers + counts.embedding + counts.output

    plain = params()
    hidden, layers = architecture.transformer["hidden_size"], architecture.transformer["num_layers"]
    assert params(mtp_num_layers=0) == plain  # NeMo-RL's "off"
    one = params(mtp_num_layers=1) - plain
    # One decoder layer's parameters, the [embedding; hidden] -> hidden projection, three norms.
    decoder_layer = plain - params(model_overrides={"num_layers": layers - 1})
    assert one == pytest.approx(decoder_layer + 2 * hidden * hidden + 3 * hidden)
    assert params(mtp_num_layers=3) - plain == pytest.approx(3 * one)
    assert params(mtp_num_layers=3, mtp_use_repeated_layer=True) - plain == pytest.approx(one)
