"""Every pass of the policy workers at every parallel layout this backend accepts, on gloo
ranks: a model saved on one rank is loaded onto pipeline-, tensor- and expert-parallel layouts,
and label log-probabilities, a teacher's top-k, greedy and seeded sampling and a training step
must agree with the single-rank model's.

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
    np.testing.assert_allclose(layout["topk_values"], single["topk_values"], rtol=0, atol=ATOL)
    assert layout["topk_indices"] == single["topk_indices"]
    assert layout["greedy"] == single["greedy"]
    assert [len(row) for row in layout["sampled"]] == [6, 6, 6]
    assert layout["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert layout["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)


@pytest.fixture(scope="module")
def dense_single(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("dense_single")
    (result,) = run_ranks(worker_ranks.save_then_every_pass, 1, out, policy=section())
    return result, out / "ckpt"


@pytest.mark.parametrize(
    "megatron_cfg",
    [
        {"pipeline_model_parallel_size": 2, "pipeline_dtype": "float32"},
        {"tensor_model_parallel_size": 2},
    ],
    ids=["pp2", "tp2"],
)
def test_every_pass_agrees_on_a_dense_layout(dense_single, megatron_cfg, tmp_path):
    single, ckpt = dense_single
    results = run_ranks(
        worker_ranks.load_then_every_pass,
        2,
        tmp_path,
        policy=section(**megatron_cfg),
        ckpt=str(ckpt),
    )
    _assert_same_passes(single, _reported(results))
    # Every rank samples the same tokens (the last stage's logits reach all stages).
    assert all(r["sampled"] == results[0]["sampled"] for r in results)
    assert all(r["greedy"] == results[0]["greedy"] for r in results)
    # ... and reports the same log-probabilities for them.
    assert all(r["sampled_logprobs"] == results[0]["sampled_logprobs"] for r in results)
    if megatron_cfg.get("pipeline_model_parallel_size"):
        # The stages run one rank's float32 arithmetic: seeded sampling draws the same tokens.
        assert _reported(results)["sampled"] == single["sampled"]


def test_every_pass_agrees_on_expert_parallel_moe(tmp_path):
    moe = {**section(), "model_name": "tiny-moe"}
    (single,) = run_ranks(worker_ranks.save_then_every_pass, 1, tmp_path / "single", policy=moe)
    ep2 = {**section(expert_model_parallel_size=2), "model_name": "tiny-moe"}
    results = run_ranks(
        worker_ranks.load_then_every_pass,
        2,
        tmp_path / "ep2",
        policy=ep2,
        ckpt=str(tmp_path / "single" / "ckpt"),
    )
    _assert_same_passes(single, _reported(results))
