"""Multi-token prediction (``policy.megatron_cfg.mtp_num_layers``): its per-step metrics.

Megatron-core builds the MTP block (``models.builder.mtp_block_spec``) and, in a training
forward, adds each MTP depth's loss to the backward through its ``MTPLossAutoScaler`` (scaled
by ``mtp_loss_scaling_factor / mtp_num_layers``, normalised per token as the main loss is,
with the algorithm's mask: ``models.train_step._mtp_loss_mask``). NeMo-RL reports each
depth's loss and its acceptance rate (the share of masked positions whose argmax is the label);
Megatron keeps both in a process-wide tracker, ``MTPLossLoggingHelper.tracker``, whose buffers it
creates on the current CUDA device. :func:`start_step` gives the tracker zeroed buffers on the
model's device before each training step (so a CPU worker, and a step after a forward-only
pass, start from zero) and :func:`step_metrics` reads, reduces and clears them after it.
"""

from __future__ import annotations

from typing import Any

import torch

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
