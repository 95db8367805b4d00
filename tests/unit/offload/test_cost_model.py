"""The physical model of offloading's cost: what cannot hide behind compute."""

from __future__ import annotations

import pytest

from nemo_rl_offload.offload.cost_model import PassTimes, overhead_floor_s, step_floor_s

GB = 1e9


def test_transfers_shorter_than_the_passes_hide_completely():
    assert overhead_floor_s(1 * GB, PassTimes(0.05, 0.10), 50 * GB, 50 * GB) == 0.0


def test_the_excess_over_each_pass_is_the_floor():
    # 4.3 GB per micro-batch at 54 GB/s: 80 ms each way against a 35 ms forward, 70 ms backward
    floor = overhead_floor_s(4.3 * GB, PassTimes(0.035, 0.070), 54 * GB, 54 * GB)
    assert floor == pytest.approx((4.3 / 54 - 0.035) + (4.3 / 54 - 0.070))


def test_each_direction_counts_against_its_own_pass():
    # the reload hides behind a long backward, the offload does not hide behind a short forward
    floor = overhead_floor_s(2 * GB, PassTimes(0.01, 1.0), 20 * GB, 20 * GB)
    assert floor == pytest.approx(0.1 - 0.01)


def test_nothing_moved_costs_nothing_and_bad_bandwidth_is_refused():
    assert overhead_floor_s(0, PassTimes(0.0, 0.0), 0, 0) == 0.0
    with pytest.raises(ValueError, match="bandwidths"):
        overhead_floor_s(1.0, PassTimes(0.0, 0.0), 0, 1)


def test_step_floor_adds_every_microbatch():
    times = PassTimes(0.01, 0.02)
    one = overhead_floor_s(1 * GB, times, 10 * GB, 10 * GB)
    assert step_floor_s(0.5, 4, 4 * GB, times, 10 * GB, 10 * GB) == pytest.approx(0.5 + 4 * one)
