"""On-policy distillation's step metrics (algorithms/opd.py) count only the samples in the
loss, as NeMo-RL's OPD estimator's mask (token mask x sample mask) does."""

from __future__ import annotations

import numpy as np
import pytest

from nemo_rl_offload.algorithms.opd import PREFIX, distillation_metrics

GAP, MEAN, STD = (
    f"{PREFIX}/teacher_student_logprob_gap_mean",
    f"{PREFIX}/adv_mean",
    f"{PREFIX}/adv_std",
)


def test_samples_out_of_the_loss_do_not_count():
    gaps = [np.array([1.0, 3.0], np.float32), np.array([100.0, -50.0], np.float32)]
    metrics = distillation_metrics(gaps, [True, False])
    assert metrics[GAP] == metrics[MEAN] == 2.0
    assert metrics[STD] == pytest.approx(np.std([1.0, 3.0], ddof=1))
    every = distillation_metrics(gaps, [True, True])
    assert every[GAP] == pytest.approx(13.5)


def test_no_sample_in_the_loss_gives_zeros_and_one_token_no_spread():
    gaps = [np.array([1.0, 3.0], np.float32)]
    assert distillation_metrics(gaps, [False]) == {GAP: 0.0, MEAN: 0.0, STD: 0.0}
    one = distillation_metrics([np.array([2.0], np.float32)], [True])
    assert one == {GAP: 2.0, MEAN: 2.0, STD: 0.0}
