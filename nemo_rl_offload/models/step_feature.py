"""The contract of a feature's step behaviour (:class:`StepFeature`) and the per-position
inputs its forward reads (:class:`FeatureInput`). Registry: :mod:`.policy.step_features`."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor


@dataclass(frozen=True)
class FeatureInput:
    """A per-position tensor ([rows, positions, ...]) a feature's forward reads, in the
    micro-batch's whole layout: the step pads it with ``fill`` and splits it over
    context-parallel ranks as it does the model's inputs."""

    value: Tensor
    fill: int | float


class StepFeature(Protocol):
    """What a feature adds to a training step (every method is a no-op for a model or a
    micro-batch without the feature)."""

    # Micro-batch keys a forward-only pass must send to the workers' devices for the feature.
    forward_keys: tuple[str, ...]

    def start_step(self, model: Any, device: Any) -> None:
        """Before the step's first forward."""

    def inputs(self, model: Any, batch: Mapping[str, Tensor]) -> dict[str, FeatureInput]:
        """Per-position tensors the forward reads, from the micro-batch as the caller gave it."""

    def forward(
        self, model: Any, inputs: Mapping[str, Tensor], *, training: bool
    ) -> tuple[dict[str, Any], contextlib.AbstractContextManager[Any]]:
        """The model's extra keyword arguments and a context around its call, from
        :meth:`inputs` as this rank feeds them (padded, its context-parallel positions)."""

    def after_pass(self, model: Any, microbatches: list[Mapping[str, Tensor]]) -> None:
        """After a pass over ``microbatches`` (training or forward-only), raised or not."""

    def step_metrics(self, model: Any, device: Any, microbatches: int) -> dict[str, float]:
        """The step's metrics (every rank calls it; it may reduce over them)."""
