"""``policy.router_replay`` (NeMo-RL's "R3"): whether a recipe replays the sampler's experts in
training, which recipes can, and the routes' data format (``models.router_replay`` records
and replays them). One module owns the rules; validate and a run both go through them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# The sampled routes as data (the driver batches them; models.router_replay records and
# replays them): the micro-batch key of [rows, positions, MoE layers, k] (NeMo-RL's field
# name), and the value of a position without a route (the router's own top-k decides).
ROUTES_KEY = "routed_experts"
NO_ROUTE = -1


def route_dtype(num_experts: int) -> np.dtype:
    """The smallest signed integer type that holds every expert id and :data:`NO_ROUTE`."""
    return np.dtype(np.int16) if num_experts < 2**15 else np.dtype(np.int32)


# Megatron's routing types that choose experts without its top-k function, the one place
# replay acts (sinkhorn's and quantile balancing's own assignment).
_OWN_ASSIGNMENT = ("sinkhorn", "quantile_balancing")


def enabled(section: Mapping[str, Any]) -> bool:
    """``router_replay.enabled`` of a policy section: the sampler records routes and the
    policy's forwards replay them (the workers build the routers for it on models with
    experts only)."""
    replay = section.get("router_replay")
    return isinstance(replay, Mapping) and replay.get("enabled") is True


def problems(
    section: Mapping[str, Any],
    where: str,
    algorithm: str | None,
    *,
    has_experts: bool,
    routing: tuple[Any, str],
    fused_topk: tuple[Any, str],
    graphs: tuple[Any, str],
) -> tuple[list[str], list[str]]:
    """(errors, warnings), one line each, for ``where``'s ``router_replay``. ``routing``,
    ``fused_topk`` and ``graphs``: the effective ``moe_router_load_balancing_type``,
    ``moe_router_fusion`` and ``cuda_graph_impl``, each with the recipe path that set it."""
    if not enabled(section):
        return [], []
    key = f"{where}.router_replay.enabled"
    if algorithm not in (None, "grpo"):
        return [
            f"{key}: router replay replays the experts GRPO's sampler chose, and {algorithm} "
            "trains on no sequence this policy sampled with its routes recorded; set it to false"
        ], []
    if not has_experts:
        return [], [
            f"warning: {key}: the model has no experts, so there are no routes to replay; "
            "it does nothing here"
        ]
    errors = []
    (balancing, balancing_path), (fusion, fusion_path) = routing, fused_topk
    if balancing in _OWN_ASSIGNMENT:
        errors.append(
            f"{key}: {balancing_path} is {balancing!r}, which assigns experts without the top-k "
            "that replay sets; use aux_loss, seq_aux_loss or none, or set router_replay.enabled "
            "to false"
        )
    if fusion is True:
        errors.append(
            f"{key}: {fusion_path} is true, and Megatron's fused top-k kernel does not replay "
            f"routes; set {fusion_path} to false"
        )
    impl, impl_path = graphs
    if impl not in (None, "none"):
        errors.append(
            f"{key}: {impl_path} is {impl!r}: a captured training graph would replay the routes "
            f"of the step it was captured in; set {impl_path} to none"
        )
    return errors, []
