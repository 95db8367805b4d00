"""The planner's last resort: a share of the optimizer's state on the host.

Why last: megatron-core's hybrid CPU optimizer (NeMo-RL's ``optimizer_cpu_offload`` with
``optimizer_offload_fraction``) steps the parameters whose Adam state it holds with the host's
Adam, which made the 3B shape's whole step several times longer on an H100 machine with all of
it there (benchmarks/results/2026-11-26_h100_optimizer_offload_3b_seq8192.json), far more than
any activation plan costs. But it is the one setting that lowers the resident state (weights,
gradients, optimizer) that every activation plan keeps, so a budget under that state has no
other plan. The planner offers it only for a budget that no measured activation plan meets,
each activation plan on the frontier with the smallest share (in steps of
:data:`SHARE_STEP`) that its predicted peak needs, and measures the fastest predicted.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nemo_rl_offload.plan_menu import Candidate

SHARE_STEP = 0.05
# The host's Adam per parameter, before a host-optimizer plan of the recipe is measured: the 3B
# shape's optimizer step took 2.15 s longer with the state of its parameters (about 3.0e9) on
# an H100 machine's host (benchmarks/results/2026-11-26_h100_optimizer_offload_3b_seq8192.json,
# optimizer_time_s at fraction 1 against 0). Another host's cores differ: the first measured
# plan replaces it.
HOST_ADAM_S_PER_PARAMETER = 7e-10


def offered(recipe_policy: dict[str, Any], dtensor: bool) -> bool:
    """Whether the recipe can take the host optimizer at all: Megatron's distributed Adam (the
    path megatron-core's hybrid optimizer runs through; the rules check the rest per plan)."""
    if dtensor:
        return False
    optimizer = (recipe_policy.get("megatron_cfg") or {}).get("optimizer")
    return (
        isinstance(optimizer, dict)
        and optimizer.get("optimizer", "adam") == "adam"
        and optimizer.get("use_distributed_optimizer") is True
    )


@dataclass(frozen=True)
class Observation:
    """A measured host-optimizer plan: its share, the peak its activation plan was predicted
    at without the host optimizer, and what it measured (peak, the step's extra seconds)."""

    share: float
    predicted_without_gib: float
    measured_peak_gib: float
    extra_s: float


@dataclass(frozen=True)
class HostOptimizerModel:
    """What a share of the optimizer state on the host does to a plan: a whole share takes
    ``state_gib`` off the forward-backward peak and adds ``step_s`` to the step (the host's
    Adam, the copies each way). Priors: the state from the memory estimate's arithmetic, the
    time from :data:`HOST_ADAM_S_PER_PARAMETER`; then fitted by measured plans."""

    state_gib: float
    step_s: float

    @classmethod
    def prior(cls, state_bytes: float, parameters: float) -> HostOptimizerModel:
        return cls(state_bytes / 2**30, parameters * HOST_ADAM_S_PER_PARAMETER)

    def share_for(self, peak_gib: float, budget_gib: float, margin: float) -> float | None:
        """The smallest share that predicts ``peak_gib`` at or under the budget with
        ``margin`` to spare (at least one step; None: more than the whole state)."""
        if self.state_gib <= 0:
            return None
        needed = (peak_gib - budget_gib * (1 - margin)) / self.state_gib
        share = max(1, math.ceil(needed / SHARE_STEP - 1e-9)) * SHARE_STEP
        return round(share, 6) if share <= 1.0 + 1e-9 else None

    def fitted(self, observations: list[Observation]) -> HostOptimizerModel:
        """The model with what measured plans showed per share (medians; the state only from
        plans whose peak fell, the time from every one)."""
        if not observations:
            return self
        states = [
            (o.predicted_without_gib - o.measured_peak_gib) / o.share
            for o in observations
            if o.predicted_without_gib > o.measured_peak_gib
        ]
        return HostOptimizerModel(
            statistics.median(states) if states else self.state_gib,
            statistics.median(max(0.0, o.extra_s) / o.share for o in observations),
        )


def offers(
    ranked: list[Candidate],
    predict: Callable[[Candidate], tuple[float, float]],
    budget_gib: float,
    model: HostOptimizerModel,
    margin: float,
) -> list[tuple[Candidate, float, float]]:
    """(candidate, predicted peak GiB, predicted step-time cost s) for each activation plan
    of ``ranked`` (the frontier) with the smallest host share that brings it under the
    budget, fastest predicted first."""
    out = []
    for plan in ranked:
        peak, seconds = predict(plan)
        share = model.share_for(peak, budget_gib, margin)
        if share is None:
            continue
        candidate = dataclasses.replace(
            plan,
            host_optimizer=share,
            predicted_peak_gib=None,
            predicted_fwd_bwd_s=None,
            measured_peak_gib=None,
            measured_fwd_bwd_s=None,
            measurements=1,
            failure=None,
        )
        out.append((candidate, peak - share * model.state_gib, seconds + share * model.step_s))
    return sorted(out, key=lambda offer: offer[2])
