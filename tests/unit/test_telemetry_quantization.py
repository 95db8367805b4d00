"""telemetry measures a quantization-aware recipe quantized, calibrated on random tokens in the
recipe's calibration shape (telemetry._quantize_as_the_run_would)."""

from __future__ import annotations

import numpy as np

from nemo_rl_offload.telemetry import _quantize_as_the_run_would


class _Group:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []

    def quantize(self, value: str, batches: list) -> dict[str, int]:
        self.calls.append((value, batches))
        return {"quantizers": 1, "calibration_batches": len(batches)}


def test_a_quantized_recipe_is_measured_quantized_and_a_plain_one_is_not():
    rng = np.random.default_rng(0)
    plain = _Group()
    assert _quantize_as_the_run_would(plain, {"model_name": "m"}, 64, 100, rng) is None
    assert plain.calls == []
    calibrated = _Group()
    section = {"quant_cfg": "FP8_DEFAULT_CFG", "quant_calib_size": 8, "quant_batch_size": 3,
               "quant_sequence_length": 16}  # fmt: skip
    said = _quantize_as_the_run_would(calibrated, section, 64, 100, rng)
    assert said == "FP8_DEFAULT_CFG: 1 quantizers"
    ((value, (batch,)),) = calibrated.calls
    assert value == "FP8_DEFAULT_CFG" and np.array(batch).shape == (3, 16)
    assert np.array(batch).max() < 100
    uncalibrated = _Group()
    _quantize_as_the_run_would(uncalibrated, {"quant_cfg": "NVFP4_MLP_WEIGHT_ONLY_CFG"}, 64, 9, rng)
    assert uncalibrated.calls == [("NVFP4_MLP_WEIGHT_ONLY_CFG", [])]
