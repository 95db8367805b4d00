"""The calibration batches of a quantization-aware policy (``policy.quant_calib_size``,
``quant_sequence_length``, ``quant_batch_size``; config/quantization.calibration_batches)."""

from __future__ import annotations

from nemo_rl_offload.config.quantization import calibration, calibration_batches, summary

SEQUENCES = [list(range(100 * i, 100 * i + 7)) for i in range(5)]


def test_the_first_examples_are_cut_into_full_rows_and_batched():
    cfg = {"quant_calib_size": 3, "quant_sequence_length": 4, "quant_batch_size": 2}
    batches = calibration_batches(SEQUENCES, calibration(cfg))
    stream = list(range(7)) + list(range(100, 107)) + list(range(200, 207))
    rows = [stream[i : i + 4] for i in range(0, 20, 4)]  # 21 tokens: the short last row goes
    assert batches == [rows[0:2], rows[2:4], rows[4:5]]


def test_no_examples_no_batches_and_a_short_stream_is_one_row():
    assert calibration_batches(SEQUENCES, calibration({})) == []
    # one example of the stream, rows of NeMo-RL's 1024 tokens
    one = calibration_batches(SEQUENCES, calibration({"quant_calib_size": 1}))
    assert one == [[list(range(7))]]


def test_the_runs_line_says_whether_it_calibrated():
    counts = {"quantizers": 4, "calibration_batches": 2}
    assert summary("X_CFG", counts) == (
        "policy quantization-aware with X_CFG: 4 quantizers, calibrated on 2 batches"
    )
    assert summary("X_CFG", {**counts, "calibration_batches": 0}).endswith("4 quantizers")
