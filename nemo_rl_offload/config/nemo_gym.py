"""``env.should_use_nemo_gym``: what a NeMo-Gym GRPO run needs, checked before it starts.

The rollouts themselves are :mod:`nemo_rl_offload.algorithms.gym_rollouts`; this module owns
the decision of which recipes can run them. NeMo-Gym needs a Python that has it
(:func:`~nemo_rl_offload.environments.nemo_gym.gym_python`): ``validate`` warns when there is
none on this machine (as it does for a Hugging Face model that is not here), a run refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_rl_offload.data.nemo_gym_rows import DATASET_NAME, uses_gym_rows
from nemo_rl_offload.errors import UserInputError

__all__ = ["enabled", "problems"]


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
    policy = recipe.get("policy") if isinstance(recipe.get("policy"), Mapping) else {}
    replay = policy.get("router_replay")
    if isinstance(replay, Mapping) and replay.get("enabled"):
        errors.append(
            "policy.router_replay.enabled: the policy's HTTP server does not return the "
            "sampler's routes to NeMo-Gym yet; set it to false with env.should_use_nemo_gym"
        )
    from nemo_rl_offload.environments.nemo_gym import gym_python

    try:
        gym_python()
    except UserInputError as missing:
        if starting:
            errors += missing.problems
        else:
            warnings += [f"warning: {line} (a run refuses to start)" for line in missing.problems]
    return errors, warnings
