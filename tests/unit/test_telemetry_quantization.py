"""telemetry measures a quantization-aware recipe quantized, calibrated on random tokens cut as
a run cuts its data (telemetry._quantize_as_the_run_would)."""

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
    section = {"quant_cfg": "FP8_DEFAULT_CFG", "quant_calib_size": 2, "quant_batch_size": 3,
               "quant_sequence_length": 16}  # fmt: skip
    said = _quantize_as_the_run_would(calibrated, section, 64, 100, rng)
    assert (
        said
        == "policy quantization-aware with FP8_DEFAULT_CFG: 1 quantizers, calibrated on 3 batches"
    )
    ((value, batches),) = calibrated.calls
    # 2 sequences of 64 tokens: 8 rows of 16, batches of 3 rows.
    assert value == "FP8_DEFAULT_CFG" and [len(b) for b in batches] == [3, 3, 2]
    assert all(len(row) == 16 and max(row) < 100 for b in batches for row in b)
    uncalibrated = _Group()
    _quantize_as_the_run_would(uncalibrated, {"quant_cfg": "NVFP4_MLP_WEIGHT_ONLY_CFG"}, 64, 9, rng)
    assert uncalibrated.calls == [("NVFP4_MLP_WEIGHT_ONLY_CFG", [])]
