"""benchmarks/copy_rates.py on CPU: its table and its refusals (the copies need a GPU; the GPU
machine ran them for benchmarks/results/2026-11-22_h100_copy_rates.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import copy_rates  # noqa: E402


def test_the_table_has_a_row_per_size_and_a_column_per_mode_and_direction():
    keys = [f"{mode}/{d}" for mode in copy_rates.MODES for d in copy_rates.DIRECTIONS]
    rates = {
        16.0: {key: 50.0 + index for index, key in enumerate(keys)},
        0.5: dict.fromkeys(keys, 1.0),
    }
    lines = copy_rates.table(rates).splitlines()
    assert lines[0] == "| copy MiB | " + " | ".join(keys) + " |"
    assert len(lines) == 4 and lines[2].startswith("| 16 | 50.0 | 51.0 |")
    assert lines[3].startswith("| 0.5 | 1.0 |")


@pytest.mark.parametrize(
    "args",
    [
        ["--sizes-mib", "16,big"],
        ["--sizes-mib", "0,16"],
        ["--sizes-mib", "4096"],  # larger than the 2048 MiB series
        ["--repeat", "0"],
    ],
)
def test_bad_sizes_and_counts_are_refused_in_one_line(capsys, args):
    assert copy_rates.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("copy_rates.py: --sizes-mib") and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so(capsys, tmp_path):
    assert copy_rates.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-written
