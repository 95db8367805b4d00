"""The physical model of offloading's cost: what cannot hide behind compute."""

from __future__ import annotations

import dataclasses

import pytest
from support.fake_planner import layer_table

from nemo_rl_offload.config.model_shape import DENSE
from nemo_rl_offload.planning import cost_model as cm
from nemo_rl_offload.planning.activation_bytes import BLOCK, UNIFORM, ActivationSettings
from nemo_rl_offload.planning.cost_model import PassTimes, overhead_floor_s, step_floor_s

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


# ------------------------------------------------------------------ the planner's cost model

GIB = 2**30
LAYER = (
    (1.0 * GIB, "attn_norm", "full"),
    (2.0 * GIB, "qkv_linear", "layernorm"),
    (3.0 * GIB, "core_attn", "core_attn"),
    (4.0 * GIB, "mlp_act", "mlp"),
    (0.5 * GIB, "mlp_fc2", "mlp_act"),
)
FLOPS = {"layernorm": 1e9, "core_attn": 2e11, "mlp": 5e11, "mlp_act": 1e9, "full": 1e12}
# Four dense layers; the model's own entries (1 GiB) in WITH_MODEL only.
KINDS = cm.LayerCosts(layer_table(4, LAYER, 0.25 * GIB), {DENSE: FLOPS})
WITH_MODEL = cm.LayerCosts(layer_table(4, LAYER, 0.25 * GIB, 1 * GIB), {DENSE: FLOPS})
Plan = ActivationSettings
CAL = cm.Calibration(
    resident_bytes=10 * GIB,
    activation_scale=1.0,
    base_step_s=1.2,
    microbatches=2,
    flops_per_s=1e13,
    hbm_bytes_per_s=1e12,
    d2h_bytes_per_s=50e9,
    h2d_bytes_per_s=50e9,
    host_s_per_hook=1e-3,
)


def test_nothing_removed_keeps_every_layer_and_the_model():
    removed = cm.removal(WITH_MODEL, Plan())
    assert removed.activation_bytes == (1 + 4 * 10.5) * GIB
    assert (removed.offloaded_bytes, removed.recompute_flops, removed.hooks) == (0, 0, 0)
    assert cm.predict(WITH_MODEL, Plan(), CAL).step_s == 1.2


def test_offloading_a_fraction_removes_that_fraction_and_costs_hooks_and_copies():
    plain = cm.removal(KINDS, Plan())
    half = cm.removal(KINDS, Plan(frozenset({"core_attn", "mlp_act"}), 0.5))
    # Half of every layer's 7 GiB but the last layer's, which the offload manager keeps.
    assert plain.activation_bytes - half.activation_bytes == 0.5 * 3 * 7 * GIB
    assert half.offloaded_bytes == 10.5 * GIB and half.hooks == 4
    # 10.5 GiB per micro-batch at 50 GB/s: longer than both 0.2 s forward and 0.4 s backward.
    predicted = cm.step_time_s(half, CAL)
    floor = cm.overhead_floor_s(10.5 * GIB, cm.PassTimes(0.2, 0.4), 50e9, 50e9)
    assert predicted == pytest.approx(1.2 + 2 * (floor + 4 * 1e-3)) and floor > 0


def test_a_modules_own_fraction_moves_and_hooks_only_that_share_of_it():
    plan = Plan(frozenset({"core_attn", "mlp_act"}), fraction_by_module=(("mlp_act", 0.25),))
    removed = cm.removal(KINDS, plan)
    # core_attn's 3 GiB on 3 of 4 layers, a quarter of mlp_act's 4 GiB on 3 of 4 layers.
    assert removed.offloaded_bytes == (3 * 3 + 0.25 * 3 * 4) * GIB
    assert removed.hooks == 4 * (1 + 0.25)


def test_recompute_frees_what_its_option_covers_and_costs_its_flops_or_traffic():
    mlp = cm.removal(KINDS, Plan(recompute=frozenset({"mlp"})))
    assert mlp.activation_bytes == 4 * 6 * GIB  # the MLP frees its activation's input too
    assert mlp.recompute_flops == 4 * 5e11 and mlp.recompute_traffic_bytes == 0
    norm = cm.removal(KINDS, Plan(recompute=frozenset({"layernorm"})))
    assert norm.recompute_flops == 0 and norm.recompute_traffic_bytes == 4 * 2 * 2 * GIB
    # Offloading what recompute already freed moves nothing.
    both = Plan(frozenset({"qkv_linear"}), recompute=frozenset({"layernorm"}))
    assert cm.removal(KINDS, both).offloaded_bytes == 0


def test_full_recompute_keeps_the_inputs_and_one_layer_and_block_keeps_the_rest_whole():
    full = cm.removal(KINDS, Plan(full=UNIFORM))
    assert full.activation_bytes == (4 * 0.25 + 10.5) * GIB
    assert full.recompute_flops == 4 * 1e12
    block = cm.removal(KINDS, Plan(full=BLOCK, num_layers=1))
    assert block.activation_bytes == (0.25 + 3 * 10.5) * GIB and block.recompute_flops == 1e12
    offloaded = cm.removal(KINDS, Plan(frozenset({"layer_input"}), full=UNIFORM))
    assert offloaded.offloaded_bytes == 1 * GIB and offloaded.hooks == 4
    assert offloaded.activation_bytes == (2 * 0.25 + 10.5) * GIB


def test_the_memory_line_fits_two_runs_and_takes_the_ledger_as_is_from_one():
    assert cm.fit_memory([(4.0, 14.0)]) == (10.0, 1.0)
    resident, scale = cm.fit_memory([(4.0, 14.4), (20.0, 32.0)])
    assert (resident, scale) == (pytest.approx(10.0), pytest.approx(1.1))
    assert cm.fit_memory([(4.0, 14.0), (20.0, 14.0)])[1] == 0.5  # noise, not a ledger
    with pytest.raises(ValueError):
        cm.fit_memory([])


def test_the_plain_step_and_the_flop_rate_from_full_recompute_with_and_without_the_plain_run():
    # Forward 1e12 FLOPs per micro-batch, all of it recomputed: 4 passes against 3.
    assert cm.base_step_s(2.0, 1e12, 1e12) == pytest.approx(1.5)
    assert cm.flops_per_s(2.0, None, 1e12, 1e12, 3) == pytest.approx(3 * 4e12 / 2.0)
    assert cm.flops_per_s(2.0, 1.6, 1e12, 1e12, 3) == pytest.approx(3e12 / 0.4)
    assert cm.flops_per_s(2.0, 2.1, 1e12, 1e12, 3) == pytest.approx(3 * 4e12 / 2.0)  # noise


def test_the_offload_scale_is_what_a_measured_run_adds_beyond_the_model_over_its_overhead():
    """Hooks' host time and copy pressure are scaled together: the run's extra time over the
    calibration's offload overhead (both terms), never below zero, none without hooks."""
    removed = cm.removal(KINDS, Plan(frozenset({"attn_norm"})))
    cal = dataclasses.replace(CAL, copy_pressure=0.1)
    without = cm.step_time_s(
        removed, dataclasses.replace(cal, host_s_per_hook=0.0, copy_pressure=0)
    )
    overhead = removed.hooks * 1e-3 + 0.1 * cm.copy_seconds(removed, cal)
    assert overhead > removed.hooks * 1e-3  # the copies count
    assert cm.offload_scale(without + 2 * 3 * overhead, removed, cal) == pytest.approx(3.0)
    assert cm.step_time_s(removed, cal) == pytest.approx(without + 2 * overhead)
    assert cm.offload_scale(without - 0.1, removed, cal) == 0.0
    assert cm.offload_scale(1.0, cm.removal(KINDS, Plan()), cal) is None
    nothing = dataclasses.replace(cal, host_s_per_hook=0.0, copy_pressure=0.0)
    assert cm.offload_scale(1.0, removed, nothing) is None


def test_before_an_offload_plan_is_measured_two_layers_of_its_copies_stand_in_for_the_offset():
    """An offload plan peaks beyond the line. Until one is measured the model adds two layers'
    worth of what the plan moves (the last layer's groups Megatron keeps and the first
    reload); a fitted offset replaces that, a failed plan's need is a floor under both, and a
    plan without offloading (or under full recompute) gets none."""
    plan = Plan(frozenset({"core_attn"}))
    removed = cm.removal(KINDS, plan)
    line = cm.peak_bytes(CAL.resident_bytes, removed.activation_bytes)
    per_layer = removed.offloaded_bytes / 3  # four layers, the last one kept
    assert per_layer == 3 * GIB
    assert cm.predict(KINDS, plan, CAL).peak_bytes == line + 2 * per_layer
    fitted = dataclasses.replace(CAL, offload_peak_bytes=1 * GIB)
    assert cm.predict(KINDS, plan, fitted).peak_bytes == line + 1 * GIB
    floored = dataclasses.replace(fitted, offload_peak_floor_bytes=9 * GIB)
    assert cm.predict(KINDS, plan, floored).peak_bytes == line + 9 * GIB
    for other in (
        Plan(recompute=frozenset({"mlp"})),
        Plan(frozenset({"layer_input"}), full=UNIFORM),
    ):
        bare = cm.removal(KINDS, other)
        assert cm.predict(KINDS, other, floored).peak_bytes == cm.peak_bytes(
            CAL.resident_bytes, bare.activation_bytes
        )
