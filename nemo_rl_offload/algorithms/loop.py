"""The one training loop every algorithm runs; an algorithm supplies only its step body.

The loop owns what must behave the same in SFT, DPO, GRPO and distillation: validation at
start, the steps still to run after a resume, the end of the data epochs, logging each step's
metrics, validation and checkpoint saving after a step (:meth:`Run.end_step`: ``val_period``,
``save_period``, keep_top_k, the stop rule and checkpoint_must_save_by), the last save, and
shutting the workers down whatever happens. An algorithm's :class:`Steps` says how to train
one step, how to validate, and where its data position is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_offload.algorithms.common import EpochSampler, Run
from nemo_rl_offload.config.run_settings import ScheduleSettings

# The GRPO and distillation default: no epoch limit unless the recipe sets max_num_epochs.
NO_EPOCH_LIMIT = 1 << 30


@dataclass
class TrainResult:
    """One training step as the loop logs it (:meth:`Run.log_train_step`): the workers'
    summed ``metrics``, the step's wall time and tokens, which sums are divided by the step's
    count (``per_count``) and the algorithm's own ``values``."""

    metrics: dict[str, float]
    elapsed: float
    tokens: int
    per_count: dict[str, str] | None = None
    values: dict[str, float] = field(default_factory=dict)


@dataclass
class Steps:
    """An algorithm's step body, ready to run: the trained ``policy`` group (the one
    checkpointed), the ``sampler`` whose position is the data position, and how to train one
    step and validate (both given the step number, which seeds GRPO's and distillation's
    sampling). ``schedule``: the algorithm section's validation period, epochs and
    ``val_at_start`` (:mod:`nemo_rl_offload.config.run_settings`)."""

    policy: Any
    sampler: EpochSampler
    train_step: Callable[[int], TrainResult]
    validate: Callable[[int], dict[str, float]]
    schedule: ScheduleSettings
    stop_when: Callable[[dict[str, Any]], str | None] | None = None
    # More of the driver's state to checkpoint (JSON), e.g. async GRPO's waiting rollouts.
    state: Callable[[], dict[str, Any]] | None = None
    # Steps whose data was drawn ahead of them (async GRPO): the run goes on past the data
    # epochs until they are trained.
    drawn_ahead: Callable[[], int] | None = None

    @property
    def val_period(self) -> int:
        return self.schedule.val_period

    @property
    def max_epochs(self) -> int:
        epochs = self.schedule.max_epochs
        return NO_EPOCH_LIMIT if epochs is None else epochs

    @property
    def val_at_start(self) -> bool:
        return self.schedule.val_at_start

    @property
    def data_exhausted(self) -> bool:
        """The sampler has drawn the last prompt of the data epochs."""
        return self.sampler.epoch >= self.max_epochs

    @property
    def data_done(self) -> bool:
        """No step has data left: the epochs are drawn and no drawn-ahead step waits."""
        ahead = self.drawn_ahead() if self.drawn_ahead is not None else 0
        return self.data_exhausted and ahead == 0


def drive(run: Run, start: Callable[[Run], Steps]) -> int:
    """Run ``start``'s step body until the steps, the data epochs or the stop rule end it;
    the workers ``start`` began (``run.start_group``) are shut down however it ends."""
    try:
        steps = start(run)
        if steps.val_at_start and run.start_step == 0:
            run.progress.label = f"{run.algorithm} step 0"
            with run.progress.phase("validation"):
                metrics = steps.validate(0)
            run.logger.log(0, metrics, phase="val")
            stop = steps.stop_when(metrics) if steps.stop_when is not None else None
            if stop is not None:
                print(stop, file=sys.stderr, flush=True)
                return 0
        for step in run.steps():
            if steps.data_done:
                break
            run.progress.label = f"{run.algorithm} step {step}"  # its phases' lines say so
            result = steps.train_step(step)
            run.progress.finish()
            run.log_train_step(
                step,
                result.metrics,
                elapsed=result.elapsed,
                tokens=result.tokens,
                per_count=result.per_count,
                **result.values,
            )
            run.end_step(
                step,
                steps.policy,
                steps.sampler.position,
                state=steps.state() if steps.state is not None else None,
                val_period=steps.val_period,
                data_done=steps.data_done,
                validate=lambda step=step: steps.validate(step),
                stop_when=steps.stop_when,
            )
        run.finish(steps.policy)
        return 0
    finally:
        run.close()
