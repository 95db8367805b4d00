"""How a policy section groups sequences into micro-batches, read from the recipe.

These settings are recipe facts: the recipe checks (which packing algorithms exist), the
offload runtime (the one length packed steps are padded to) and the algorithms' batching
(:mod:`nemo_rl_offload.algorithms.packing`) all read them, so they live with the config and
need neither torch nor Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
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

    @staticmethod
    def mode_of(section: Mapping[str, Any]) -> str:
        """``rows``, ``packing`` or ``dynamic``: which of ``sequence_packing`` and
        ``dynamic_batching`` is on (packing first; the rules refuse both)."""
        for mode, key in (("packing", "sequence_packing"), ("dynamic", "dynamic_batching")):
            cfg = section.get(key)
            if isinstance(cfg, Mapping) and cfg.get("enabled"):
                return mode
        return "rows"

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
        mode = cls.mode_of(section)
        if mode == "rows":
            return cls(**base)
        packing = section.get("sequence_packing") or {}
        dynamic = section.get("dynamic_batching") or {}
        cfg = packing if mode == "packing" else dynamic
        max_len = int(section.get("max_total_sequence_length") or 0)
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
    if BatchingSettings.mode_of(section) != "packing":
        return None
    try:
        return BatchingSettings.from_policy(section).pack_length()
    except (TypeError, ValueError):  # a malformed section: the schema reports it
        return None


# The shortest default length bucket of a padded step.
SMALLEST_BUCKET = 32


def sequence_length_buckets(max_length: int, multiple: int = 1) -> list[int]:
    """The default padded lengths of a step: powers of two and the midpoints 1.5 x 2^k from
    32 on, each rounded up to ``multiple``, and last ``max_length`` rounded up to it.

    Every bucket is a step shape with its own offload plan (the pinned buffers are shared), so
    buckets trade padding (at most half a bucket: a length just above 2^k pads to 1.5 x 2^k)
    against plans (about two per doubling of the length, 15 up to 4096)."""
    multiple = max(1, multiple)
    top = round_up(max_length, multiple)
    buckets: set[int] = {top}
    size = SMALLEST_BUCKET
    while size < top:
        for candidate in (size, size * 3 // 2):
            rounded = round_up(candidate, multiple)
            if rounded < top:
                buckets.add(rounded)
        size *= 2
    return sorted(buckets)


def step_buckets(policy_cfg: dict[str, Any]) -> tuple[list[int], bool]:
    """The length buckets a policy section's offloaded steps are padded to, and whether they
    are the default (derived from its max_total_sequence_length and padding multiple). With
    sequence packing every training micro-batch is one pack of the same length, so that length
    is the only bucket: one plan per micro-batch count."""
    packed = pack_length(policy_cfg)
    if packed is not None:
        return [packed], False
    given = (policy_cfg.get("megatron_cfg") or {}).get("offload_sequence_length_buckets")
    if given:
        return list(given), False
    multiple = policy_cfg.get("make_sequence_length_divisible_by")
    return sequence_length_buckets(
        int(policy_cfg["max_total_sequence_length"]), multiple if isinstance(multiple, int) else 1
    ), True
