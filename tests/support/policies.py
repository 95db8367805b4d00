"""Shared builders for tests: a minimal policy section, capability sets, and a rules runner."""

from __future__ import annotations

import copy
from typing import Any

from nemo_rl_offload.config.environment import Capabilities
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.config.module_names import OFFLOAD_MODULES_BY_VERSION

NO_TE = Capabilities("0.19.2", None, OFFLOAD_MODULES_BY_VERSION["0.19"], "version table")
TE_2_10 = Capabilities("0.19.2", "2.10.0", OFFLOAD_MODULES_BY_VERSION["0.19"], "version table")
TE_2_9 = Capabilities("0.19.2", "2.9.1", OFFLOAD_MODULES_BY_VERSION["0.19"], "version table")

P = "policy.megatron_cfg"


def make_policy(model: str = "tiny-dense", **megatron_cfg: Any) -> dict[str, Any]:
    """A schema-valid policy section with the given megatron_cfg keys."""
    return {
        "model_name": model,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 1,
        "max_total_sequence_length": 4096,
        "precision": "bfloat16",
        "megatron_cfg": {
            "enabled": True,
            "optimizer": {"optimizer": "adam", "lr": 1e-5},
            **copy.deepcopy(megatron_cfg),
        },
    }


def check(
    model: str = "tiny-dense",
    caps: Capabilities = NO_TE,
    gpus: int = 1,
    workers: int | None = None,
    **cfg: Any,
):
    """Run the offload rules on a policy built from keyword settings, on ``workers`` workers
    (None: unknown); returns the Findings."""
    from nemo_rl_offload.preflight import check_policy

    return check_policy(
        make_policy(model, **cfg),
        where="policy",
        architecture=architecture_for(model),
        caps=caps,
        gpus_per_node=gpus,
        workers=workers,
    )
