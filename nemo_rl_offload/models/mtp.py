"""Multi-token prediction (``policy.megatron_cfg.mtp_num_layers``): its per-step metrics.

Megatron-core builds the MTP block (``models.builder.mtp_block_spec``) and, in a training
forward, adds each MTP depth's loss to the backward through its ``MTPLossAutoScaler`` (scaled
by ``mtp_loss_scaling_factor / mtp_num_layers``, normalised per token as the main loss is,
with the algorithm's mask: :class:`MtpStep`). NeMo-RL reports each
depth's loss and its acceptance rate (the share of masked positions whose argmax is the label);
Megatron keeps both in a process-wide tracker, ``MTPLossLoggingHelper.tracker``, whose buffers it
creates on the current CUDA device. :func:`start_step` gives the tracker zeroed buffers on the
model's device before each training step (so a CPU worker, and a step after a forward-only
pass, start from zero) and :func:`step_metrics` reads, reduces and clears them after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nemo_rl_offload.models.step_feature import FeatureInput

TRACKED = ("loss_values", "correct_values", "total_values")


def depths(model: Any) -> int:
    """The model's MTP depths (0 without MTP)."""
    from megatron.core.utils import unwrap_model

    return int(getattr(unwrap_model(model).config, "mtp_num_layers", None) or 0)


def start_step(model: Any, device: torch.device) -> None:
    """Zeroed tracker buffers for this step's training forward passes (none without MTP)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    n = depths(model)
    if n:
        MTPLossLoggingHelper.tracker = {key: torch.zeros(n, device=device) for key in TRACKED}


def step_metrics(model: Any, microbatches: int) -> dict[str, float]:
    """``mtp_<k>_loss`` (depth k's loss: the mean over the step's micro-batches of each one's
    per-token loss, averaged over the data-parallel and context-parallel ranks, as Megatron's
    training loop logs it) and ``mtp_<k>_acceptance_rate`` (percent of the counted positions
    whose most likely token is the label, over all of them); the tracker is cleared."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    MTPLossLoggingHelper.tracker = {}
    n = depths(model)
    if not n or "loss_values" not in tracker:
        return {}
    # One all-reduce of the three rows; a sum (gloo has no average).
    values = torch.stack([tracker[key].float() for key in TRACKED])
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    ranks = torch.distributed.get_world_size(group)
    if ranks > 1:
        torch.distributed.all_reduce(values, group=group)
    losses, correct, total = values.cpu().tolist()
    metrics: dict[str, float] = {}
    for depth in range(n):
        metrics[f"mtp_{depth + 1}_loss"] = losses[depth] / (ranks * max(microbatches, 1))
        metrics[f"mtp_{depth + 1}_acceptance_rate"] = 100.0 * correct[depth] / max(total[depth], 1)
    return metrics


class MtpStep:
    """Multi-token prediction in the training step (:mod:`.step_feature`): the tracker zeroed
    and read per step, and the algorithm's mask handed to the MTP losses as ``loss_mask``: the
    positions the algorithm's loss counts (NeMo-RL's token mask times its sample mask), so they
    count no prompt or padding. Megatron rolls the mask with the labels for each depth; a
    forward without labels (the distillation student's logits) makes Megatron derive them from
    the input ids and roll once more, so there each input position's mask is given."""

    forward_keys: tuple[str, ...] = ()
    MASK = "mtp_loss_mask"

    def start_step(self, model: Any, device: Any) -> None:
        start_step(model, device)

    def inputs(self, model: Any, batch: Mapping[str, Tensor]) -> dict[str, FeatureInput]:
        if "loss_mask" not in batch or not depths(model):
            return {}
        mask = batch["loss_mask"]
        if batch.get("labels") is None:
            mask = torch.cat([mask.new_zeros((mask.shape[0], 1)), mask[:, :-1]], dim=1)
        return {self.MASK: FeatureInput(mask, 0)}

    def forward(
        self, model: Any, inputs: Mapping[str, Tensor], *, training: bool
    ) -> tuple[dict[str, Any], contextlib.AbstractContextManager[Any]]:
        mask = inputs.get(self.MASK)
        return ({} if mask is None else {"loss_mask": mask}), contextlib.nullcontext()

    def after_pass(self, model: Any, microbatches: list[Mapping[str, Tensor]]) -> None:
        return None

    def step_metrics(self, model: Any, device: Any, microbatches: int) -> dict[str, float]:
        return step_metrics(model, microbatches)
