"""Offload points for the dense MLP's saved tensors on the local layer spec.

megatron-core 0.19 does not offload the dense MLP, whose saved tensors are about half of a
layer's. This module adds the groups ``mlp_fc1``, ``mlp_act`` and ``mlp_fc2``, opened and closed
by forward hooks on the MLP's two linears and run by Megatron's own offload manager. What each
group holds, and the Megatron code relied on: docs/offloading.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
    FineGrainedActivationOffloadingInterface as OffloadGroup,
)
from megatron.core.transformer.mlp import MLP

from nemo_rl_offload.config.module_names import MLP_OFFLOAD_MODULES
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.offload.owned import mlp_drift

MLP_FC1, MLP_ACT, MLP_FC2 = "mlp_fc1", "mlp_act", "mlp_fc2"


def require_checked_mlp() -> None:
    """Refuse the MLP's offload modules (UserInputError, one line) when Megatron's MLP code they
    rely on is not the code they were checked against (``owned.mlp_drift``; validate refuses
    them the same way first)."""
    drift = mlp_drift()
    if drift:
        raise UserInputError(f"policy.megatron_cfg.offload_modules: {drift}")


class OffloadingMLP(MLP):
    """Megatron's dense MLP with the offload groups of :data:`MLP_OFFLOAD_MODULES` that
    :meth:`place_offload_points` turns on (none: Megatron's MLP exactly)."""

    offload_modules: frozenset[str] = frozenset()
    _open: OffloadGroup | None = None  # the group whose saved-tensor hooks are on

    def place_offload_points(self, modules: frozenset[str]) -> None:
        """Turn on the offload groups ``modules`` (a subset of :data:`MLP_OFFLOAD_MODULES`)."""
        unknown = set(modules) - MLP_OFFLOAD_MODULES
        if unknown:
            raise ValueError(f"not MLP offload modules: {sorted(unknown)}")
        self.offload_modules = frozenset(modules)
        self._handles = [
            self.linear_fc1.register_forward_pre_hook(self._before_fc1),
            self.linear_fc1.register_forward_hook(self._after_fc1),
            self.linear_fc2.register_forward_pre_hook(self._before_fc2),
            self.linear_fc2.register_forward_hook(self._after_fc2),
        ]

    def forward(self, hidden_states: Any, per_token_scale: Any = None, **kwargs: Any) -> Any:
        """Megatron's forward; a group's saved-tensor hooks are turned off whatever happens (an
        exception inside must not leave every later saved tensor in an offload group)."""
        try:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        finally:
            self._close()

    # --- the groups ----------------------------------------------------------------------

    def _open_group(self, name: str, tensor: Any) -> Any:
        """Start group ``name`` (a no-op when it is off) on ``tensor`` and turn its saved-tensor
        hooks on; returns the tensor the group's ops must use."""
        self._close()
        self._open = OffloadGroup(name in self.offload_modules, tensor, name)
        return self._open.__enter__()

    def _close(self) -> OffloadGroup | None:
        """Turn the open group's saved-tensor hooks off; returns it, to be committed."""
        group, self._open = self._open, None
        if group is not None:
            group.__exit__(None, None, None)
        return group

    def _commit(self, name: str, tensor: Any) -> Any:
        """Close the open group and commit it on ``tensor`` (its output) if it is ``name``."""
        group = self._close()
        if group is None or group.name != name:
            return tensor
        return group.group_offload(tensor)

    def _before_fc1(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self._open_group(MLP_FC1, args[0]), *args[1:])

    def _after_fc1(self, module: Any, args: Any, output: Any) -> Any:
        out, bias = output
        out = self._commit(MLP_FC1, out)
        return self._open_group(MLP_ACT, out), bias

    def _before_fc2(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = self._commit(MLP_ACT, args[0])
        return (self._open_group(MLP_FC2, hidden), *args[1:])

    def _after_fc2(self, module: Any, args: Any, output: Any) -> Any:
        out, bias = output
        return self._commit(MLP_FC2, out), bias


def _build(
    offload_modules: frozenset[str], mlp_class: type[OffloadingMLP], **kwargs: Any
) -> OffloadingMLP:
    mlp = mlp_class.as_mlp_submodule(**kwargs)
    if offload_modules:
        mlp.place_offload_points(offload_modules)
    return mlp


def offloading_mlp_builder(
    mlp_builder: Any,
    offload_modules: frozenset[str],
    mlp_class: type[OffloadingMLP] = OffloadingMLP,
) -> Callable:
    """The layer spec's ``mlp`` builder with ``mlp_class`` (:class:`OffloadingMLP` or a subclass:
    ``models.local_recompute``'s MLP) in place of Megatron's dense ``MLP``, ``offload_modules``
    on. ``mlp_builder`` must be the local spec's dense MLP
    (``functools.partial(MLP.as_mlp_submodule, submodules=...)``): any other MLP (experts,
    Transformer Engine's fused MLP) is refused, since its saved tensors lie elsewhere, and so
    is a megatron-core whose MLP code differs from the checked one when offload modules are on
    (:func:`require_checked_mlp`)."""
    if offload_modules:
        require_checked_mlp()
    if not (
        isinstance(mlp_builder, functools.partial)
        and getattr(mlp_builder.func, "__func__", None) is MLP.as_mlp_submodule.__func__
        and set(mlp_builder.keywords) == {"submodules"}
    ):
        raise ValueError(
            f"{mlp_class.__name__} (offloading {sorted(offload_modules)}) replaces Megatron's "
            f"dense MLP of the local layer spec; this layer's MLP is built by {mlp_builder!r}"
        )
    return functools.partial(
        _build,
        offload_modules=frozenset(offload_modules),
        mlp_class=mlp_class,
        **mlp_builder.keywords,
    )
