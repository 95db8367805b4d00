"""One logger interface, three sinks: a progress line on stdout, a jsonl file, TensorBoard.

Every algorithm loop logs a flat dict of numbers per step through :class:`MetricsLogger`; the
jsonl file (``<log_dir>/metrics.jsonl``, one object per line with ``step`` and ``phase``) is the
record the functional tests and users read back. TensorBoard is written only when the recipe asks
for it and the ``tensorboard`` package is installed (otherwise one warning says so).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

_LOG = logging.getLogger("nemo_rl_offload.metrics")
METRICS_FILE = "metrics.jsonl"
# Shown on the progress line when present, in this order.
_HEADLINE = (
    "loss",
    "reward",
    "val_reward",
    "val_loss",
    "preference_accuracy",
    "kl",
    "tokens_per_s",
    "step_time_s",
    "peak_gpu_memory_gib",
    "offloaded_gib_per_step",
    "cuda_graph_replayed",
)


def _plain(value: Any) -> Any:
    """JSON-safe numbers: tensors and numpy scalars become floats, NaN becomes null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(
        self,
        log_dir: str | Path,
        *,
        total_steps: int,
        tensorboard: bool = False,
        stream: TextIO | None = None,
        resume_step: int | None = None,
    ) -> None:
        """``resume_step``: a run resumed from the checkpoint of that step appends to the
        existing file, without the records of later steps (the run that stopped logged them;
        they run again)."""
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / METRICS_FILE
        if resume_step is not None:
            _drop_records_after(self.path, resume_step)
        self._file = self.path.open("w" if resume_step is None else "a", encoding="utf-8")
        self._stream = stream or sys.stdout
        self._total = total_steps
        self._start = time.monotonic()
        self._writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.log_dir / "tensorboard"))
            except Exception as exc:  # tensorboard missing: say so once, keep the other sinks
                _LOG.warning("logger.tensorboard_enabled: TensorBoard not written (%s)", exc)

    def log(self, step: int, metrics: dict[str, Any], *, phase: str = "train") -> None:
        record = {"step": step, "phase": phase, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self._writer.add_scalar(f"{phase}/{key}", value, step)
        shown = [
            f"{key} {record[key]:.4g}"
            for key in _HEADLINE
            if isinstance(record.get(key), int | float)
        ]
        elapsed = time.monotonic() - self._start
        prefix = f"[{phase} {step}/{self._total} {elapsed:6.1f}s]"
        print(prefix, " | ".join(shown), file=self._stream, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite the metrics file without records of steps after ``step`` (atomically)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or json.loads(line)["step"] <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def read_metrics(log_dir: str | Path, phase: str | None = None) -> list[dict[str, Any]]:
    """The records of a metrics file, optionally of one phase (used by tests and tools)."""
    path = Path(log_dir) / METRICS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if phase is None or r.get("phase") == phase]
