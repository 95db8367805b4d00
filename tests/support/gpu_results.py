"""Where GPU tests put their measurements: JSON files in $NEMO_RL_OFFLOAD_RESULTS (a directory)
when it is set, each with the environment it was measured in."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_results(name: str, payload: dict[str, Any]) -> None:
    """``<name>.json`` in $NEMO_RL_OFFLOAD_RESULTS, with the environment added; nothing when
    the variable is unset."""
    where = os.environ.get("NEMO_RL_OFFLOAD_RESULTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        from nemo_rl_offload.telemetry import environment

        body = {"environment": environment(), **payload}
        (Path(where) / f"{name}.json").write_text(json.dumps(body, indent=1))
