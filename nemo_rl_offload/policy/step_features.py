"""The features that change the training step and the forward passes, registered in one place.

A feature's per-step behaviour lives in its own module as one
:class:`~nemo_rl_offload.models.step_feature.StepFeature`; the step (:mod:`.train_step`) and the
worker (:mod:`.policy_worker`) run every feature registered in :data:`STEP_FEATURES` and name
none. Adding a feature's step behaviour is its module plus one line here
(docs/architecture.md).
"""

from __future__ import annotations

from nemo_rl_offload.models.mtp import MtpStep
from nemo_rl_offload.models.router_replay import RouterReplayStep
from nemo_rl_offload.models.step_feature import StepFeature

STEP_FEATURES: tuple[StepFeature, ...] = (
    MtpStep(),
    RouterReplayStep(),
)


def forward_keys() -> tuple[str, ...]:
    """Every micro-batch key a registered feature's forward-only pass reads."""
    return tuple(key for feature in STEP_FEATURES for key in feature.forward_keys)
