"""How a policy section groups sequences into micro-batches, read from the recipe.

These settings are recipe facts: the recipe checks (which packing algorithms exist), the
offload runtime (the one length packed steps are padded to) and the algorithms' batching
(:mod:`nemo_rl_offload.algorithms.packing`) all read them, so they live with the config and
need neither torch nor Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# NeMo-RL's sequence-packing algorithms (policy.sequence_packing.algorithm); the packers
# themselves are algorithms.packing.PACKERS, checked against this at import.
PACKER_NAMES = (
    "modified_first_fit_decreasing",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "concatenative",
)


def round_up(value: int, multiple: int) -> int:
    multiple = max(1, multiple)
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class BatchingSettings:
    """How a policy section groups sequences into micro-batches: ``mode`` is ``rows`` (padded
    rows of a fixed count), ``packing`` or ``dynamic``; token budgets for training and
    forward-only passes."""

    mode: str = "rows"
    train_rows: int = 1
    logprob_rows: int = 1
    train_tokens: int = 0
    logprob_tokens: int = 0
    algorithm: str = "modified_first_fit_decreasing"
    largest_first: bool = False
    round_to: int = 1  # make_sequence_length_divisible_by (padded lengths, pack lengths)
    sequence_length_round: int = 1  # dynamic batching's padded lengths
    where: str = "policy"  # the recipe section, for messages

    @classmethod
    def from_policy(
        cls, section: dict[str, Any], *, pair_rows: bool = False, where: str = "policy"
    ) -> BatchingSettings:
        """From a policy (or teacher) section named ``where``. ``pair_rows``: DPO, whose
        forward-only rows default to two per pair."""
        train_rows = int(section.get("train_micro_batch_size") or 1)
        logprob_rows = section.get("logprob_batch_size")
        if logprob_rows is None:
            logprob_rows = train_rows * (2 if pair_rows else 1)
        round_to = int(section.get("make_sequence_length_divisible_by", 1) or 1)
        base = {
            "train_rows": train_rows,
            "logprob_rows": int(logprob_rows),
            "round_to": round_to,
            "where": where,
        }
        packing = section.get("sequence_packing") or {}
        dynamic = section.get("dynamic_batching") or {}
        max_len = int(section.get("max_total_sequence_length") or 0)
        if packing.get("enabled"):
            cfg, mode = packing, "packing"
        elif dynamic.get("enabled"):
            cfg, mode = dynamic, "dynamic"
        else:
            return cls(**base)
        # NeMo-RL's recipes default the budgets to the rows' worth of longest sequences.
        train_tokens = int(cfg.get("train_mb_tokens") or max_len * train_rows)
        logprob_tokens = int(cfg.get("logprob_mb_tokens") or max_len * int(logprob_rows))
        return cls(
            mode=mode,
            **base,
            train_tokens=train_tokens,
            logprob_tokens=logprob_tokens,
            algorithm=str(packing.get("algorithm") or "modified_first_fit_decreasing"),
            largest_first=packing.get("microbatch_order") == "largest_first",
            sequence_length_round=int(dynamic.get("sequence_length_round") or 1),
        )

    def pack_length(self, *, training: bool = True) -> int:
        """The length every pack is padded to: the budget rounded up to the padding
        multiple (tensor parallelism with sequence parallel splits the sequence)."""
        return round_up(self.train_tokens if training else self.logprob_tokens, self.round_to)


def pack_length(section: dict[str, Any]) -> int | None:
    """The training pack length of a policy section with sequence packing on, else None: the
    one step length the offload runtime pads to (one plan per micro-batch count)."""
    packing_cfg = section.get("sequence_packing")
    if not (isinstance(packing_cfg, dict) and packing_cfg.get("enabled")):
        return None
    try:
        return BatchingSettings.from_policy(section).pack_length()
    except (TypeError, ValueError):  # a malformed section: the schema reports it
        return None
