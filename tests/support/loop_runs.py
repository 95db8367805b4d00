"""A training-loop ``Run`` for tests that drive its checkpointing and schedule without workers:
the recipe's run sections filled with what a checked recipe would hold."""

from __future__ import annotations

from typing import Any

from nemo_rl_offload.algorithms.common import Run
from nemo_rl_offload.config import run_settings
from nemo_rl_offload.preflight import Report


def stand_in_run(
    algorithm: str,
    *,
    checkpointing: dict[str, Any],
    section: dict[str, Any] | None = None,
    logger: Any = None,
    max_steps: int = 0,
) -> Run:
    """A Run whose resolved settings come from ``checkpointing`` and ``section`` (the
    algorithm's keys over steps 10, seed 0, no periodic validation)."""
    defaults = {"max_num_steps": 10, "seed": 0, "val_period": 0}
    if algorithm == "dpo":
        defaults["reference_policy_kl_penalty"] = 0.1
    recipe = {
        algorithm: {**defaults, **(section or {})},
        "checkpointing": {"enabled": True, **checkpointing},
        "logger": {"log_dir": "logs"},
    }
    report = Report(algorithm, recipe, None, run=run_settings.resolve(recipe, algorithm))  # type: ignore[arg-type]
    return Run(algorithm, recipe, report, None, logger, None, max_steps=max_steps)  # type: ignore[arg-type]
