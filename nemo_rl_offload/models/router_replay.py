"""Router replay (NeMo-RL's ``policy.router_replay``, "R3"): an MoE policy trains on the experts
its sampler chose.

The sampler and the training forward can send a token near a tie to other experts, and the
importance ratio then compares two networks; replaying the sampler's choices removes that.
:class:`Recorder` records routes while sampling, :class:`ReplayRouter` replays them in training.
How: docs/training.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

from nemo_rl_offload.config.router_replay import NO_ROUTE, ROUTES_KEY, route_dtype
from nemo_rl_offload.models.step_feature import FeatureInput
from nemo_rl_offload.offload.owned import fingerprint

__all__ = ["NO_ROUTE", "ROUTES_KEY", "Recorder", "ReplayRouter", "RoutesReplay"]

# Megatron's RouterReplay members this module relies on, by the digest of their source
# (``offload.owned.fingerprint``) in the megatron-core this package pins: get_replay_topk's
# actions and arguments (overridden below), and the target / backward-list bookkeeping.
_RELIED_ON = {
    "get_replay_topk": "6da70f5dfce9e249",
    "set_target_indices": "beed899bf3f1e951",
    "clear_indices": "68cf435fee42688e",
}


def check_megatron() -> None:
    """Refuse to replay routes on a megatron-core whose RouterReplay differs from the one this
    module was written against (one line naming what changed)."""
    changed = [
        name
        for name, digest in _RELIED_ON.items()
        if fingerprint(getattr(RouterReplay, name)) != digest
    ]
    if changed:
        raise RuntimeError(
            f"policy.router_replay: megatron-core's RouterReplay.{', '.join(changed)} changed "
            "since this package was written against it; models/router_replay.py needs review"
        )


class RoutesReplay(RouterReplay):
    """Megatron's per-router replay state, held by one router only (not in Megatron's
    process-wide list), that lets a position without a route (all ``NO_ROUTE``) keep the
    router's own top-k."""

    def __init__(self) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        # During a training step (start_step .. step_metrics): how many (token, layer) routes the
        # forward replayed and how many of those differ from the router's own choice.
        self.counts: Tensor | None = None

    def get_replay_topk(
        self,
        scores: Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[Tensor, Tensor]:
        replaying = self.router_replay_action in (
            RouterReplayAction.REPLAY_FORWARD,
            RouterReplayAction.REPLAY_BACKWARD,
        )
        if not replaying:
            return super().get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            target = self.target_topk_idx
        else:
            target = self.replay_backward_list.pop(0)
        target = target.to(scores.device)
        if target.shape != (scores.shape[0], topk):
            raise RuntimeError(
                f"router replay: {tuple(target.shape)} routes for {scores.shape[0]} tokens of "
                f"top-{topk} (a layout bug: the routes must follow the router's tokens)"
            )
        missing = (target == NO_ROUTE).all(dim=-1, keepdim=True)
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = torch.where(missing, own, target)
        if (
            self.counts is not None
            and self.router_replay_action == RouterReplayAction.REPLAY_FORWARD
        ):
            replayed = ~missing[:, 0]
            differs = (own.sort(dim=-1).values != chosen.sort(dim=-1).values).any(dim=-1)
            self.counts += torch.stack([replayed.sum(), (differs & replayed).sum()])
        return scores.gather(1, chosen), chosen


class ReplayRouter(TopKRouter):
    """Megatron's top-k router with its own :class:`RoutesReplay` (docs/training.md)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.router_replay is not None:  # built by Megatron for moe_enable_routing_replay
            with contextlib.suppress(ValueError):
                RouterReplay.global_router_replay_instances.remove(self.router_replay)
        self.router_replay = RoutesReplay()


def with_replay_router(mlp_spec: Any) -> Any:
    """``mlp_spec`` (Megatron's MoE spec: ``partial(MoELayer, submodules=MoESubmodules(...))``)
    with :class:`ReplayRouter` as its router; refuses (one line) a spec of another shape."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    submodules = getattr(mlp_spec, "keywords", {}).get("submodules")
    if not isinstance(mlp_spec, functools.partial) or not isinstance(submodules, MoESubmodules):
        raise RuntimeError(
            f"policy.router_replay: the layer's MLP spec is {mlp_spec!r}, not Megatron's MoE "
            "spec, so its router cannot be replaced (a layout this package does not build)"
        )
    submodules = dataclasses.replace(submodules, router=ReplayRouter)
    return functools.partial(
        mlp_spec.func, *mlp_spec.args, **{**mlp_spec.keywords, "submodules": submodules}
    )


def moe_layer_numbers(config: Any) -> list[int]:
    """The decoder's MoE layers (1-based global layer numbers), from ``moe_layer_freq``: the
    routes' layer axis follows this order."""
    count = int(config.num_layers)
    freq = getattr(config, "moe_layer_freq", 1)
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(count)]
    return [i + 1 for i, moe in enumerate(pattern) if moe]


# Where decoder_replays keeps its answer on the model (this package's own attribute).
_REPLAYS_ATTRIBUTE = "_nemo_rl_offload_route_replays"


def decoder_replays(model: torch.nn.Module) -> list[tuple[int, RoutesReplay]]:
    """This pipeline stage's decoder routers' replay states with their index on the routes'
    layer axis (multi-token prediction layers' routers are left alone: no sampler feeds them)."""
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model)
    found = getattr(gpt, _REPLAYS_ATTRIBUTE, None)
    if found is None:  # once per model: every replayed forward asks
        index = {number: i for i, number in enumerate(moe_layer_numbers(gpt.config))}
        found = [
            (index[int(module.layer_number)], module.router_replay)
            for module in gpt.decoder.modules()
            if isinstance(module, ReplayRouter) and not module.is_mtp_layer
        ]
        setattr(gpt, _REPLAYS_ATTRIBUTE, found)
    return found


def replays_routes(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built with :class:`ReplayRouter` (``policy.router_replay`` on a
    model with experts, as ``models.builder`` decides): read from its config, so the answer is
    the same on every rank, also on a pipeline stage that holds no MoE layer."""
    from megatron.core.utils import unwrap_model

    config = unwrap_model(model).config
    return bool(config.moe_enable_routing_replay and config.num_moe_experts)


# ---------------------------------------------------------------- training and log-probabilities


def router_tokens(routes: Tensor, sequence_parallel_rank: int, tp: int) -> Tensor:
    """[rows, positions, layers, k] in the model input's layout (this context-parallel rank's
    positions) -> [tokens, layers, k] in the router's: sequence-major (Megatron's [s, b]
    activations flattened), this sequence-parallel rank's slice of the positions."""
    seq_first = routes.transpose(0, 1)
    if tp > 1:
        seq_first = seq_first.chunk(tp, dim=0)[sequence_parallel_rank]
    return seq_first.reshape(-1, *routes.shape[2:])


def arm(model: torch.nn.Module, routes: Tensor) -> None:
    """Set every decoder router of this stage to replay ``routes`` ([tokens, layers, k] in the
    router's layout, :func:`router_tokens`) in the next forward."""
    for index, replay in decoder_replays(model):
        replay.set_target_indices(routes[:, index].to(torch.long).contiguous())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def after_forward(model: torch.nn.Module, *, training: bool) -> None:
    """After a replayed forward: a training forward's routers replay the same routes in a
    recompute during the backward (Megatron's backward replay pops them in order); a
    forward-only pass is done with them."""
    for _, replay in decoder_replays(model):
        if training:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        else:
            replay.clear_router_replay_action()
            replay.clear_indices()


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: Tensor | None, *, training: bool) -> Iterator[None]:
    """The enclosed forward replays ``routes`` ([tokens, layers, k] in the router's layout;
    None: no replay), then :func:`after_forward`; a forward that raises leaves nothing armed."""
    if routes is None:
        yield
        return
    arm(model, routes)
    try:
        yield
    except BaseException:
        disarm(model)
        raise
    after_forward(model, training=training)


def start_step(model: torch.nn.Module, device: Any) -> None:
    """Count, over the training step to come, the routes replayed and those that differ from
    the routers' own choices (:func:`step_metrics`)."""
    for _, replay in decoder_replays(model):
        replay.counts = torch.zeros(2, dtype=torch.long, device=device)


def step_metrics(model: torch.nn.Module, device: Any) -> dict[str, float]:
    """``router_replay_changed``: the share of the step's replayed (token, MoE layer) routes
    whose experts differ from the router's own top-k on the same input, over every rank (each
    counts its own tokens and layers; ranks that see the same tokens add to both counts
    alike). What replay changes: 0 when the sampler's and the trainer's routers agree. Empty
    without router replay. Every rank of the group calls it (one all-reduce)."""
    if not replays_routes(model):
        return {}
    totals = torch.zeros(2, dtype=torch.long, device=device)
    for _, replay in decoder_replays(model):
        if replay.counts is not None:
            totals += replay.counts
        replay.counts = None
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(totals)
    replayed, changed = totals.tolist()
    return {"router_replay_changed": changed / replayed} if replayed else {}


def disarm(model: torch.nn.Module) -> None:
    """No replay, nothing held (after a step, or a forward that raised)."""
    for _, replay in decoder_replays(model):
        replay.clear_router_replay_action()
        replay.clear_indices()


class RouterReplayStep:
    """Router replay in the training step and the forward passes (:mod:`.step_feature`): each
    forward given sampled routes replays them (in the routers' token layout: this
    sequence-parallel rank's slice), the routers are disarmed after a pass, and the step reports
    how many replayed routes the routers would have chosen otherwise."""

    forward_keys: tuple[str, ...] = (ROUTES_KEY,)

    def start_step(self, model: Any, device: Any) -> None:
        start_step(model, device)

    def inputs(self, model: Any, batch: Mapping[str, Tensor]) -> dict[str, FeatureInput]:
        routes = batch.get(ROUTES_KEY)
        # No route on padding or another rank's positions: the router's own top-k there.
        return {} if routes is None else {ROUTES_KEY: FeatureInput(routes, NO_ROUTE)}

    def forward(
        self, model: Any, inputs: Mapping[str, Tensor], *, training: bool
    ) -> tuple[dict[str, Any], contextlib.AbstractContextManager[Any]]:
        routes = inputs.get(ROUTES_KEY)
        if routes is None:
            return {}, contextlib.nullcontext()
        from megatron.core import parallel_state

        config = model.config
        slices = (
            max(1, int(config.tensor_model_parallel_size))
            if getattr(config, "sequence_parallel", False)
            else 1
        )
        rank = parallel_state.get_tensor_model_parallel_rank() if slices > 1 else 0
        return {}, replaying(model, router_tokens(routes, rank, slices), training=training)

    def after_pass(self, model: Any, microbatches: list[Mapping[str, Tensor]]) -> None:
        """Routers keep no replayed routes beyond the pass (their backward replay list holds
        each training micro-batch's until a recompute takes it, and none does without one)."""
        if any(ROUTES_KEY in mb for mb in microbatches):
            disarm(model)

    def step_metrics(self, model: Any, device: Any, microbatches: int) -> dict[str, float]:
        return step_metrics(model, device)


# ---------------------------------------------------------------------------------- sampling


class Recorder:
    """The routes of one sampling call (docs/training.md): ``rows`` sequences of up to
    ``max_len`` positions over every MoE layer of the model."""

    def __init__(self, model: torch.nn.Module, rows: int, max_len: int, device: Any) -> None:
        from megatron.core.utils import unwrap_model

        config = unwrap_model(model).config
        self.replays = decoder_replays(model)
        # This stage's columns of the routes' layer axis, and the rows a decode step feeds.
        self.columns = torch.tensor([index for index, _ in self.replays], device=device)
        self.rows = torch.arange(rows, device=device)
        self.layers = len(moe_layer_numbers(config))
        self.topk = int(config.moe_router_topk)
        self.dtype = route_dtype(int(config.num_moe_experts))
        self.routes = torch.full(
            (rows, max_len, self.layers, self.topk),
            NO_ROUTE,
            dtype=getattr(torch, self.dtype.name),
            device=device,
        )
        self.sequence_parallel = bool(config.sequence_parallel)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Record each router's top-k during the enclosed forward."""
        for _, replay in self.replays:
            replay.clear_indices()
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
        finally:
            for _, replay in self.replays:
                replay.clear_router_replay_action()

    def _recorded(self) -> Tensor | None:
        """This stage's recorded top-k [tokens, stage's MoE layers, k] of the last forward,
        gathered over the sequence-parallel ranks; None on a stage without MoE layers."""
        if not self.replays:
            return None
        stacked = torch.stack([r.get_recorded_indices() for _, r in self.replays], dim=1)
        if not self.sequence_parallel:
            return stacked
        from megatron.core import tensor_parallel

        return tensor_parallel.gather_from_sequence_parallel_region(stacked)

    def prefill(self, rows: int, prompt_lengths: Tensor) -> None:
        """Keep the prefill's routes of each prompt's positions: [rows, length] fed as
        Megatron's [length, rows] (a shorter prompt's padding is not a position of its
        sequence: a decode step feeds those positions later, or nothing does)."""
        recorded = self._recorded()
        if recorded is None:
            return
        count = self.routes.shape[0]
        length = recorded.shape[0] // rows
        per_position = recorded.view(length, rows, *recorded.shape[1:]).transpose(0, 1)[:count]
        fed = torch.arange(length, device=per_position.device)[None, :] < prompt_lengths[:, None]
        per_position = torch.where(fed[:, :, None, None], per_position, NO_ROUTE)
        self.routes[:, :length, self.columns] = per_position.to(self.routes.dtype)

    def decode(self, positions: Tensor) -> None:
        """Keep a decode step's routes: row i fed one token at ``positions[i]``."""
        recorded = self._recorded()
        if recorded is None:
            return
        count = positions.shape[0]
        rows, columns = self.rows[:count, None], self.columns[None, :]
        self.routes[rows, positions[:, None], columns] = recorded[:count].to(self.routes.dtype)

    def finish(self) -> np.ndarray:
        """Every MoE layer's routes, on every pipeline stage ([rows, max_len, layers, k]): each
        stage recorded its own layers and left -1 in the others' (NCCL reduces no 16-bit
        integers, so the reduction runs on a 32-bit copy)."""
        from megatron.core import parallel_state

        routes = self.routes
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            routes = routes.to(torch.int32)
            torch.distributed.all_reduce(
                routes,
                op=torch.distributed.ReduceOp.MAX,
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return routes.cpu().numpy().astype(self.dtype)
