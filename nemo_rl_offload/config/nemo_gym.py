"""``env.should_use_nemo_gym``: what a NeMo-Gym GRPO run needs, checked before it starts.

The rollouts themselves are :mod:`nemo_rl_offload.algorithms.gym_rollouts`; this module owns
the decision of which recipes can run them. NeMo-Gym needs a Python that has it
(:func:`~nemo_rl_offload.environments.nemo_gym.gym_python`): ``validate`` warns when there is
none on this machine (as it does for a Hugging Face model that is not here), a run refuses.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_rl_offload.errors import UserInputError

__all__ = ["DATASET_NAME", "GYM_PYTHON_ENV", "enabled", "gym_python", "problems", "uses_gym_rows"]

# A Python with nemo-gym installed (else the ``gym`` command's, else this one if it has it).
GYM_PYTHON_ENV = "NEMO_RL_OFFLOAD_GYM_PYTHON"
# NeMo-RL's dataset name for NeMo-Gym's rows (data/nemo_gym_rows.py loads them).
DATASET_NAME = "NemoGymDataset"


def _dataset_name(data_cfg: Mapping[str, Any], split_key: str) -> Any:
    for section in (data_cfg.get(split_key), data_cfg.get("default")):
        if isinstance(section, Mapping) and section.get("dataset_name") is not None:
            return section["dataset_name"]
    return None


def uses_gym_rows(data_cfg: Mapping[str, Any]) -> bool:
    """Whether the recipe's training data is NeMo-Gym rows (``data.train`` or ``data.default``
    names the NemoGymDataset)."""
    return isinstance(data_cfg, Mapping) and _dataset_name(data_cfg, "train") == DATASET_NAME


def gym_python() -> str:
    """The Python that runs NeMo-Gym: :data:`GYM_PYTHON_ENV`, else the ``gym`` command's
    interpreter, else this one when it can import nemo_gym."""
    named = os.environ.get(GYM_PYTHON_ENV)
    if named:
        if not Path(named).is_file():
            raise UserInputError(f"{GYM_PYTHON_ENV}: {named} is not a file; give a Python path")
        return named
    command = shutil.which("gym")
    if command:
        first = Path(command).read_text(errors="replace").splitlines()[:1]
        if first and first[0].startswith("#!"):
            return first[0][2:].strip()
    try:
        import nemo_gym  # noqa: F401
    except ImportError:
        raise UserInputError(
            "env.should_use_nemo_gym: no Python with NeMo-Gym found: install nemo-gym "
            f"(pip install nemo-gym, Python >= 3.12) into a virtual environment and set "
            f"{GYM_PYTHON_ENV} to its python (or put its gym command on PATH; "
            "scripts/nemo-gym-venv makes one)"
        ) from None
    return sys.executable


def enabled(recipe: Mapping[str, Any]) -> bool:
    env = recipe.get("env")
    return isinstance(env, Mapping) and env.get("should_use_nemo_gym") is True


def problems(
    recipe: Mapping[str, Any], algorithm: str | None, *, starting: bool
) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a recipe that turns NeMo-Gym on (none otherwise)."""
    if not enabled(recipe):
        return [], []
    errors: list[str] = []
    warnings: list[str] = []
    if algorithm not in ("grpo", "distillation"):
        errors.append(
            f"env.should_use_nemo_gym: NeMo-Gym rollouts are GRPO's and distillation's "
            f"samples; {algorithm} never samples; set it to false"
        )
        return errors, warnings
    data = recipe.get("data")
    if not uses_gym_rows(data if isinstance(data, Mapping) else {}):
        errors.append(
            f"data.train.dataset_name: NeMo-Gym rollouts take NeMo-Gym rows; set it (or "
            f"data.default.dataset_name) to {DATASET_NAME} with data.train.data_path"
        )
    nemo_gym = (recipe.get("env") or {}).get("nemo_gym")
    paths = nemo_gym.get("config_paths") if isinstance(nemo_gym, Mapping) else None
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        errors.append(
            f"env.nemo_gym.config_paths: {paths!r} must list NeMo-Gym's server config files "
            "(a model server such as responses_api_models/vllm_model/configs/"
            "vllm_model_for_training.yaml, and the resources servers and agents)"
        )
    try:
        gym_python()
    except UserInputError as missing:
        if starting:
            errors += missing.problems
        else:
            warnings += [f"warning: {line} (a run refuses to start)" for line in missing.problems]
    return errors, warnings
