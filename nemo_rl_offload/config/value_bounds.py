"""Bounds one recipe key sets for another, which the schema's per-key types cannot say.

The schema (:mod:`nemo_rl_offload.config.schema`) bounds each value on its own: counts
positive, rates finite and in range. What is left is a key bounded by another key's value:
``min_lr`` at most ``lr``, a micro-batch within its batch, new tokens within the sequence, a
port range that is a range, and ``top_k``'s one value inside its range that NeMo-RL refuses
(0; -1 or null mean no cut). :func:`problems` reports each as one line naming the key that
holds the bad value and the fix; values the schema refuses (wrong type, out of range) are the
schema's to report and are skipped here, so no key gets two lines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nemo_rl_offload.config.schema import MAX_COUNT

__all__ = ["problems"]

POLICY_SECTIONS = ("policy", "teacher")


def _number(value: Any) -> float | None:
    """``value`` as a finite number, or None (a bool, a string, NaN: the schema's to report)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any, most: int = MAX_COUNT) -> int | None:
    """``value`` as an integer from 1 to ``most`` (the schema's bounds), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        return None
    return value


def _section(node: Any, key: str) -> Mapping[str, Any]:
    child = node.get(key) if isinstance(node, Mapping) else None
    return child if isinstance(child, Mapping) else {}


def _not_above(
    section: Mapping[str, Any], where: str, low_key: str, high_key: str, why: str
) -> list[str]:
    """``low_key`` at most ``high_key`` (both positive integers) in ``section``."""
    low, high = _count(section.get(low_key)), _count(section.get(high_key))
    if low is None or high is None or low <= high:
        return []
    return [
        f"{where}.{low_key}: {low} is more than {high_key} {high} ({why}); set it to at most {high}"
    ]


def _learning_rates(section: Mapping[str, Any], where: str) -> list[str]:
    optimizer = _section(_section(section, "megatron_cfg"), "optimizer")
    lr, min_lr = _number(optimizer.get("lr")), _number(optimizer.get("min_lr"))
    if lr is None or min_lr is None or lr <= 0 or min_lr < 0 or min_lr <= lr:
        return []
    return [
        f"{where}.megatron_cfg.optimizer.min_lr: {min_lr:g} is above lr {lr:g} (the schedule "
        f"decays from lr down to min_lr); set it to at most {lr:g}"
    ]


def _generation(section: Mapping[str, Any], where: str) -> list[str]:
    generation = _section(section, "generation")
    path = f"{where}.generation"
    found = []
    new, total = (
        _count(generation.get("max_new_tokens")),
        _count(section.get("max_total_sequence_length")),
    )
    if new is not None and total is not None and new > total:
        # NeMo-RL's recipes set max_new_tokens to max_total_sequence_length itself: equal is
        # accepted (each call samples what its prompts leave).
        found.append(
            f"{path}.max_new_tokens: {new} is more than {where}.max_total_sequence_length "
            f"{total} (prompt and response share it); set it to at most {total}"
        )
    for key in ("top_k", "val_top_k"):
        if type(generation.get(key)) is int and generation[key] == 0:
            found.append(
                f"{path}.{key}: 0 keeps no token (NeMo-RL refuses it too); set -1 or null for "
                "no top-k cut, or a count from 1"
            )
    found += _port_range(generation, path, "port_range_low", "port_range_high")
    return found


def _port_range(section: Mapping[str, Any], where: str, low_key: str, high_key: str) -> list[str]:
    low, high = _count(section.get(low_key), 65535), _count(section.get(high_key), 65535)
    if low is None or high is None or low <= high:
        return []
    return [
        f"{where}.{low_key}: {low} is above {high_key} {high} (the ports tried run from low to "
        f"high); set it to at most {high}"
    ]


def problems(recipe: Mapping[str, Any], algorithm: str) -> list[str]:
    """One line per value bounded by another key's (empty when there is none)."""
    found: list[str] = []
    for where in POLICY_SECTIONS:
        section = _section(recipe, where)
        if not section:
            continue
        found += _learning_rates(section, where)
        found += _not_above(
            section,
            where,
            "train_micro_batch_size",
            "train_global_batch_size",
            "a micro-batch is part of a step's batch",
        )
        found += _generation(section, where)
    if algorithm in ("sft", "dpo"):
        found += _not_above(
            _section(recipe, algorithm),
            algorithm,
            "val_micro_batch_size",
            "val_global_batch_size",
            "a micro-batch is part of a validation batch",
        )
    found += _port_range(
        _section(recipe, "cluster"), "cluster", "master_port_range_low", "master_port_range_high"
    )
    return found
