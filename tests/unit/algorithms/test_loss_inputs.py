"""GRPO's loss inputs prepared on the driver: the sampler's log-probabilities on the label
positions, NeMo-RL's sequence log-probability error and its threshold, the positive-example
NLL's scale, and the KL switch of use_kl_in_reward."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nemo_rl_offload.algorithms import batching, loss_inputs
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.policy.policy_group import holds_reference


def _sequences() -> list[TokenSequence]:
    return [TokenSequence([1, 2, 3, 4, 5], 3), TokenSequence([1, 2, 6, 7], 2)]


def test_generation_rows_sit_on_the_label_positions_of_the_response():
    rows = loss_inputs.generation_rows(_sequences(), [[-0.1, -0.2], [-0.3, -0.4]])
    mbs = batching.microbatches(_sequences(), 2, pad_id=0)
    batching.attach_rows(mbs, "generation_logprobs", rows)
    mb = mbs[0]
    # The loss mask marks the labels that are response tokens: exactly where the values are.
    np.testing.assert_array_equal(mb["generation_logprobs"] != 0, mb["loss_mask"] > 0)
    np.testing.assert_allclose(mb["generation_logprobs"][0], [0, 0, -0.1, -0.2, 0])
    np.testing.assert_allclose(mb["generation_logprobs"][1], [0, -0.3, -0.4, 0, 0])


def _error_inputs() -> tuple[list[np.ndarray], list[np.ndarray]]:
    generation = loss_inputs.generation_rows(_sequences(), [[-0.1, -0.2], [-0.3, -0.4]])
    old = [np.concatenate([row, [0.0, 0.0]]) for row in generation]  # a padded pass's rows
    old[1][1:3] += [1.0, 0.0]  # the second sequence: errors e^1 and 1
    return generation, old


def test_seq_logprob_error_is_measured_and_names_the_sequences_above_the_threshold():
    generation, old = _error_inputs()
    metrics, dropped = loss_inputs.seq_logprob_error(
        _sequences(), generation, old, [1.0, 1.0], None
    )
    high = (math.e + 1) / 2
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(high, rel=1e-6)
    assert metrics["min_seq_mult_prob_error"] == pytest.approx(1.0)
    assert dropped == []  # no threshold: nothing leaves

    metrics, dropped = loss_inputs.seq_logprob_error(_sequences(), generation, old, [1.0, 1.0], 1.5)
    assert dropped == [1]
    assert metrics["num_masked_seqs_by_logprob_error"] == 1.0
    assert metrics["masked_correct_pct"] == 1.0
    assert metrics["max_seq_mult_prob_error_after_mask"] == pytest.approx(1.0)


def test_a_sequence_that_does_not_train_has_no_error_to_measure():
    generation, old = _error_inputs()
    sequences = _sequences()
    sequences[1].loss_multiplier = 0.0  # e.g. cut by data.max_input_seq_length
    metrics, dropped = loss_inputs.seq_logprob_error(sequences, generation, old, [1.0, 1.0], 1.5)
    assert dropped == [] and metrics["max_seq_mult_prob_error"] == pytest.approx(1.0)


def test_positive_nll_scale_makes_the_term_a_mean_over_positive_tokens():
    sequences = _sequences()  # 2 + 2 response tokens
    assert loss_inputs.positive_nll_scale(sequences, [1.0, 0.0], token_level=True) == 2.0
    assert loss_inputs.positive_nll_scale(sequences, [1.0, 0.0], token_level=False) == 1.0
    assert loss_inputs.positive_nll_scale(sequences, [0.0, 0.0], token_level=True) == 0.0


def test_use_kl_in_reward_takes_the_kl_out_of_grpo():
    """GRPO's advantage estimator reads no KL, so NeMo-RL's use_kl_in_reward leaves none: no
    penalty in the loss, and no reference model to hold."""
    loss_cfg = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "reference_policy_kl_penalty": 0.1}
    assert loss_inputs.loss_spec(loss_cfg)["kl_penalty"] == 0.1
    assert holds_reference({"loss_fn": loss_cfg}, "grpo")
    loss_cfg["use_kl_in_reward"] = True
    assert loss_inputs.loss_spec(loss_cfg)["kl_penalty"] == 0.0
    assert not holds_reference({"loss_fn": loss_cfg}, "grpo")
