"""Every pass of the policy workers at every parallel layout this backend accepts, on gloo
ranks: a model saved on one rank is loaded onto pipeline-, tensor- (with and without sequence
parallelism) and expert-parallel layouts, and label log-probabilities, a teacher's top-k,
greedy and seeded sampling, a training step and the weights it leaves must agree with one rank
that loaded the same model.

Pipeline stages run the same arithmetic as one rank, so the outputs there are equal up to
float32 rounding at most; tensor and expert parallelism sum in another order, so they agree
within a float32 tolerance, and greedy continuations (far from ties at these logits) are equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import worker_ranks
from support.worker_ranks import run_ranks, section

ATOL = 2e-5
# A training length no layout pads (see the MoE and MTP steps).
EVEN = 24


def _reported(results: list[dict]) -> dict:
    """The first reporting rank's outputs, with the step's loss summed over reporting ranks."""
    reporters = [r for r in results if r["reports"]]
    first = dict(reporters[0])
    first["loss"] = sum(r["loss"] for r in reporters)
    return first


def _assert_same_passes(single: dict, layout: dict) -> None:
    assert layout["shapes"] == single["shapes"]
    for got, expected in zip(layout["logprobs"], single["logprobs"], strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    assert [len(pack) for pack in layout["packed_logprobs"]] == [17]
    for got, expected in zip(layout["packed_logprobs"], single["packed_logprobs"], strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    np.testing.assert_allclose(layout["topk_values"], single["topk_values"], rtol=0, atol=ATOL)
    assert layout["topk_indices"] == single["topk_indices"]
    assert layout["greedy"] == single["greedy"]
    assert [len(row) for row in layout["sampled"]] == [6, 6, 6]
    assert layout["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert layout["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    # The step's update: a gradient a layout left partial (e.g. a replicated weight that saw
    # only its rank's tokens) moves the weights elsewhere even where the norm hides it.
    np.testing.assert_allclose(
        layout["probe_after_step"], single["probe_after_step"], rtol=0, atol=ATOL
    )


def _single(out: Path, policy: dict, **kwargs) -> tuple[dict, Path]:
    """A checkpoint after one step on one rank, and every pass of one rank that loaded it."""
    run_ranks(worker_ranks.save_after_one_step, 1, out, policy=policy)
    ckpt = out / "ckpt"
    (result,) = run_ranks(
        worker_ranks.load_then_every_pass,
        1,
        out / "single",
        policy=policy,
        ckpt=str(ckpt),
        **kwargs,
    )
    return result, ckpt


def _every_pass(policy: dict, ckpt: Path, tmp_path: Path, **kwargs) -> list[dict]:
    """Two ranks of ``policy``'s layout load the one-rank checkpoint and run every pass."""
    return run_ranks(
        worker_ranks.load_then_every_pass, 2, tmp_path, policy=policy, ckpt=str(ckpt), **kwargs
    )


@pytest.fixture(scope="module")
def dense_single(tmp_path_factory) -> tuple[dict, Path]:
    return _single(tmp_path_factory.mktemp("dense_single"), section())


@pytest.mark.parametrize(
    "megatron_cfg",
    [
        {"pipeline_model_parallel_size": 2, "pipeline_dtype": "float32"},
        {"tensor_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        {"context_parallel_size": 2},
    ],
    ids=["pp2", "tp2", "tp2_sp", "cp2"],
)
def test_every_pass_agrees_on_a_dense_layout(dense_single, megatron_cfg, tmp_path):
    single, ckpt = dense_single
    results = _every_pass(section(**megatron_cfg), ckpt, tmp_path)
    _assert_same_passes(single, _reported(results))
    # Every rank samples the same tokens (the last stage's logits reach all stages).
    assert all(r["sampled"] == results[0]["sampled"] for r in results)
    assert all(r["greedy"] == results[0]["greedy"] for r in results)
    # ... and reports the same log-probabilities for them.
    assert all(r["sampled_logprobs"] == results[0]["sampled_logprobs"] for r in results)
    if megatron_cfg.get("pipeline_model_parallel_size"):
        # The stages run one rank's float32 arithmetic: seeded sampling draws the same tokens.
        assert _reported(results)["sampled"] == single["sampled"]


# LoRA (policy.megatron_cfg.peft): the adapters follow their linear's split; the checkpoint
# holds adapters trained one step (B away from zero) and the frozen base.
LORA = {"peft": {"enabled": True, "dim": 4, "alpha": 8, "dropout": 0.0}}


@pytest.fixture(scope="module")
def lora_single(tmp_path_factory) -> tuple[dict, Path]:
    return _single(tmp_path_factory.mktemp("lora_single"), section(**LORA))


@pytest.mark.parametrize(
    "megatron_cfg",
    [
        {"tensor_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    ],
    ids=["tp2", "tp2_sp"],
)
def test_every_pass_agrees_with_lora_adapters(lora_single, megatron_cfg, tmp_path):
    single, ckpt = lora_single
    _assert_same_passes(
        single, _reported(_every_pass(section(**megatron_cfg, **LORA), ckpt, tmp_path))
    )


# Multi-token prediction: two depths whose losses weigh half the policy's; the checkpoint holds
# the MTP block trained one step. Its step trains on an even length, as the MoE step below: at
# an odd length, which sequence parallelism pads, tp2_sp's weights after the step differed by
# up to 1e-4 on one CPU (not on another; landed code too): a fresh Adam's first step turns the
# gradients' last digits into more than ATOL. Its forward passes still run odd lengths.
MTP = {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.5}


@pytest.fixture(scope="module")
def mtp_single(tmp_path_factory) -> tuple[dict, Path]:
    return _single(tmp_path_factory.mktemp("mtp_single"), section(**MTP), train_length=EVEN)


@pytest.mark.parametrize(
    "megatron_cfg",
    [
        {},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        {"context_parallel_size": 2},
    ],
    ids=["dp2", "tp2_sp", "cp2"],
)
def test_every_pass_agrees_with_multi_token_prediction(mtp_single, megatron_cfg, tmp_path):
    single, ckpt = mtp_single
    results = _every_pass(section(**megatron_cfg, **MTP), ckpt, tmp_path, train_length=EVEN)
    assert set(single["mtp"]) == {
        f"mtp_{depth}_{name}" for depth in (1, 2) for name in ("loss", "acceptance_rate")
    }
    if not megatron_cfg.get("context_parallel_size"):
        _assert_same_passes(single, _reported(results))
        for result in results:  # every rank holds the values reduced over the layout's ranks
            assert result["mtp"] == pytest.approx(single["mtp"], rel=1e-4)
        return
    # Under context parallelism Megatron's MTP loss normalises each rank's positions by that
    # rank's own count of rolled tokens (process_mtp_loss), so the MTP part of the gradient
    # and the logged MTP losses differ from one rank's by the share of tokens the roll drops at
    # each rank's chunk ends (here 2 of 22 on one rank, 0 of 24 on the other); everything the
    # policy's own loss computes is exact.
    layout = _reported(results)
    for got, expected in zip(layout["logprobs"], single["logprobs"], strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    assert layout["greedy"] == single["greedy"]
    assert layout["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert layout["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-2)
    assert layout["grad_norm"] != pytest.approx(single["grad_norm"], rel=1e-5)
    for result in results:
        assert result["mtp"] == pytest.approx(single["mtp"], rel=5e-2)


# The MoE step trains on an even length: a padded position changes an MoE model's gradients in
# their last digits even on one rank (its tokens reach the experts), and a fresh Adam's first
# step turns that into more than ATOL. Its forward passes still run odd lengths.
MOE_TRAIN_LENGTH = EVEN


@pytest.fixture(scope="module")
def moe_single(tmp_path_factory) -> tuple[dict, Path]:
    return _single(tmp_path_factory.mktemp("moe_single"), _moe(), train_length=MOE_TRAIN_LENGTH)


def _moe(**megatron_cfg) -> dict:
    return {**section(**megatron_cfg), "model_name": "tiny-moe"}


@pytest.mark.parametrize(
    "megatron_cfg",
    [
        {"expert_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    ],
    ids=["ep2", "tp2_sp"],
)
def test_every_pass_agrees_on_expert_parallel_moe(moe_single, megatron_cfg, tmp_path):
    single, ckpt = moe_single
    results = _every_pass(_moe(**megatron_cfg), ckpt, tmp_path, train_length=MOE_TRAIN_LENGTH)
    _assert_same_passes(single, _reported(results))


# Router replay (policy.router_replay): the sampler's routes are gathered over sequence-parallel
# ranks and pipeline stages, and the replayed routes reach each router in its own token layout
# (its context-parallel positions, its sequence-parallel slice, its stage's layers).
def _replaying(**megatron_cfg) -> dict:
    return {**_moe(**megatron_cfg), "router_replay": {"enabled": True}}


@pytest.fixture(scope="module")
def replay_single(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("replay_single")
    run_ranks(worker_ranks.save_after_one_step, 1, out, policy=_replaying())
    (result,) = run_ranks(
        worker_ranks.load_then_replay,
        1,
        out / "single",
        policy=_replaying(),
        ckpt=str(out / "ckpt"),
    )
    return result, out / "ckpt"


@pytest.mark.parametrize(
    "megatron_cfg",
    [
        {"pipeline_model_parallel_size": 2, "pipeline_dtype": "float32"},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        {"context_parallel_size": 2},
        {"expert_model_parallel_size": 2},
    ],
    ids=["pp2", "tp2_sp", "cp2", "ep2"],
)
def test_router_replay_agrees_on_every_layout(replay_single, megatron_cfg, tmp_path):
    single, ckpt = replay_single
    assert all(-1 not in np.asarray(r)[:-1] for r in single["routes"])  # every fed position
    # The routes replace the routers' own choices (else this compares nothing).
    for replayed, own in zip(single["logprobs"], single["own_logprobs"], strict=True):
        assert np.abs(np.asarray(replayed) - np.asarray(own)).max() > 1e-3
    results = run_ranks(
        worker_ranks.load_then_replay,
        2,
        tmp_path,
        policy=_replaying(**megatron_cfg),
        ckpt=str(ckpt),
    )
    layout = _reported(results)
    assert layout["greedy"] == single["greedy"]
    for got, expected in zip(layout["routes"], single["routes"], strict=True):
        np.testing.assert_array_equal(np.sort(got, -1), np.sort(expected, -1))
    for name in ("logprobs", "packed_logprobs"):
        for got, expected in zip(layout[name], single[name], strict=True):
            np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    assert layout["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert layout["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    # The share of routes replay changed, counted over every rank's tokens and layers.
    assert 0.5 < single["changed"] < 1.0
    assert all(r["changed"] == pytest.approx(single["changed"], abs=0.01) for r in results)


# FP8 linears (policy.megatron_cfg.fp8_cfg), blockwise with power-of-two scales (the default):
# each tensor-parallel shard quantizes its own blocks (a row-parallel shard's 1x128 blocks end at
# its edge, so a shard's scale may differ from one rank's), but rounding to e4m3 does not depend
# on a power-of-two scale (away from the format's smallest and largest values), so every layout
# computes the same products and agrees within float32's tolerance, as without FP8.
FP8 = {"fp8_cfg": {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": False}}


@pytest.fixture(scope="module")
def fp8_single(tmp_path_factory) -> tuple[dict, Path]:
    return _single(tmp_path_factory.mktemp("fp8_single"), section(**FP8))


@pytest.mark.parametrize(
    "megatron_cfg",
    [
        {"tensor_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    ],
    ids=["tp2", "tp2_sp"],
)
def test_every_pass_agrees_with_fp8_linears(fp8_single, megatron_cfg, tmp_path):
    single, ckpt = fp8_single
    _assert_same_passes(
        single, _reported(_every_pass(section(**megatron_cfg, **FP8), ckpt, tmp_path))
    )
