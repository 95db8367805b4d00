"""The planner's last resort: a share of the optimizer's state on the host.

Why last: megatron-core's hybrid CPU optimizer (NeMo-RL's ``optimizer_cpu_offload`` with
``optimizer_offload_fraction``) steps the parameters whose Adam state it holds with the host's
Adam, which made the 3B shape's whole step several times longer on an H100 machine with all of
it there (see docs/design/planner.md), far more than any activation plan costs. But it is the
one setting that lowers the resident state (weights, gradients, optimizer) that every
activation plan keeps, so a budget under that state has no other plan. The planner offers it
only for a budget that no measured activation plan meets, and only where the rules accept it
for the recipe (Megatron's distributed Adam), each activation plan on the frontier with the
smallest share (in steps of :data:`SHARE_STEP`) that its predicted peak needs, and measures
the fastest predicted.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from nemo_rl_offload.planning.plan_menu import Candidate

SHARE_STEP = 0.05
# The host's Adam per parameter, before a host-optimizer plan of the recipe is measured: what
# the 3B shape's optimizer step took longer with all of its state on an H100 machine's host,
# over its parameters (see docs/design/planner.md). Another host's cores differ: the first
# measured plan replaces it.
HOST_ADAM_S_PER_PARAMETER = 7e-10


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
    """What a share of the optimizer state on the host does to a plan: it takes
    ``state_gib x share + state_offset_gib`` off the forward-backward peak and adds
    ``step_s x share + step_offset_s`` to the step (the host's Adam and the copies each way).
    Priors: the state and its offset from the memory estimate's arithmetic, the time from
    :data:`HOST_ADAM_S_PER_PARAMETER`; then fitted by measured plans: the slopes from one
    share, lines from two shares or more. The line is needed: on the 3B shape a
    small share took far less off the peak than its part of the state, a large one more (the
    hybrid optimizer's float32 gradient copies, which the estimate now counts), and every step
    cost a fixed part besides its share (measured on an H100; see docs/design/planner.md)."""

    state_gib: float
    step_s: float
    state_offset_gib: float = 0.0
    step_offset_s: float = 0.0

    @classmethod
    def prior(
        cls, per_share_bytes: float, at_no_share_bytes: float, parameters: float
    ) -> HostOptimizerModel:
        """From the memory estimate's arithmetic (``memory_estimate.host_optimizer_state``)."""
        return cls(
            per_share_bytes / 2**30,
            parameters * HOST_ADAM_S_PER_PARAMETER,
            state_offset_gib=at_no_share_bytes / 2**30,
        )

    def saving_gib(self, share: float) -> float:
        return max(0.0, self.state_gib * share + self.state_offset_gib)

    def extra_s(self, share: float) -> float:
        return max(0.0, self.step_s * share + self.step_offset_s)

    def share_for(self, peak_gib: float, budget_gib: float, margin: float) -> float | None:
        """The smallest share that predicts ``peak_gib`` at or under the budget with
        ``margin`` to spare (at least one step; None: more than the whole state)."""
        if self.state_gib <= 0:
            return None
        needed = peak_gib - budget_gib * (1 - margin)
        exact = (needed - self.state_offset_gib) / self.state_gib
        share = max(1, math.ceil(exact / SHARE_STEP - 1e-9)) * SHARE_STEP
        return round(share, 6) if share <= 1.0 + 1e-9 else None

    def fitted(self, observations: list[Observation]) -> HostOptimizerModel:
        """The model with what measured plans showed: from one share, the slopes through the
        offsets it has (medians); from two shares or more, least-squares lines."""
        if not observations:
            return self
        savings = [(o.share, o.predicted_without_gib - o.measured_peak_gib) for o in observations]
        extras = [(o.share, max(0.0, o.extra_s)) for o in observations]
        if len({o.share for o in observations}) < 2:
            state = statistics.median((s - self.state_offset_gib) / x for x, s in savings)
            step = statistics.median((e - self.step_offset_s) / x for x, e in extras)
            return dataclasses.replace(
                self, state_gib=state if state > 0 else self.state_gib, step_s=max(0.0, step)
            )
        state_line = statistics.linear_regression(*zip(*savings, strict=True))
        step_line = statistics.linear_regression(*zip(*extras, strict=True))
        if state_line[0] <= 0:  # noise: keep the slope the arithmetic gives
            state_line = (self.state_gib, 0.0)
        return HostOptimizerModel(
            state_line[0], max(0.0, step_line[0]), state_line[1], step_line[1]
        )


def offers(
    ranked: list[Candidate],
    predict: Callable[[Candidate], tuple[float, float]],
    budget_gib: float,
    model: HostOptimizerModel,
    margin: float,
) -> list[Candidate]:
    """Each activation plan of ``ranked`` (the frontier) with the smallest host share that
    brings it under the budget, its predictions set (the peak with the share, the
    forward-backward, the host optimizer's step time), fastest predicted first."""
    out = []
    for plan in ranked:
        peak, seconds = predict(plan)
        share = model.share_for(peak, budget_gib, margin)
        if share is None:
            continue
        candidate = plan.with_host_optimizer(share)
        candidate.predicted_peak_gib = peak - model.saving_gib(share)
        candidate.predicted_fwd_bwd_s = seconds
        candidate.predicted_optimizer_extra_s = model.extra_s(share)
        out.append(candidate)
    return sorted(out, key=lambda c: c.predicted_cost_s or 0.0)
