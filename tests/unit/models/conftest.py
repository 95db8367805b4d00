"""Fixtures for the model tests: torch.distributed (gloo, one rank) + Megatron parallel state on
CPU, once per test module, and a builder for tiny float32 models from recipe-style settings."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from support.policies import make_policy  # noqa: E402

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_presets import architecture_for  # noqa: E402


@pytest.fixture(scope="module")
def megatron_cpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One gloo rank and Megatron's parallel state (all sizes 1) with the CPU patches on."""
    from nemo_rl_offload.models.cpu_compat import disable_cpu_execution
    from nemo_rl_offload.models.parallel import (
        destroy_megatron_parallel,
        initialize_megatron_parallel,
    )

    store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        initialize_megatron_parallel({}, seed=1234, on_gpu=False)
        yield
    finally:
        destroy_megatron_parallel()
        disable_cpu_execution()
        dist.destroy_process_group()


def _effective(
    model: str = "tiny-dense", **megatron_cfg: Any
) -> megatron_settings.EffectiveSettings:
    policy = make_policy(model, **megatron_cfg)
    policy["precision"] = "float32"
    return megatron_settings.effective_settings(policy, architecture_for(model), te_installed=False)


@pytest.fixture
def effective_for() -> Callable[..., megatron_settings.EffectiveSettings]:
    """effective_for(model, **megatron_cfg): settings of a float32 policy (no TE installed)."""
    return _effective


@pytest.fixture
def build_tiny(megatron_cpu: None) -> Callable[..., tuple[Any, list[str]]]:
    """build_tiny(model, seed=0, **megatron_cfg) -> (GPTModel on CPU, warnings)."""
    from nemo_rl_offload.models.builder import build_gpt_model

    def build(model: str = "tiny-dense", seed: int = 0, **megatron_cfg: Any):
        torch.manual_seed(seed)
        return build_gpt_model(
            _effective(model, **megatron_cfg), architecture_for(model), on_gpu=False
        )

    return build


@pytest.fixture
def moe_globals_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep a CPU MoE forward/backward from leaking Megatron's process-wide MoE state into
    later tests: the aux-loss scale (a backward outside the schedules makes it a 0-d tensor,
    which the schedules' later copy_ of a [1] tensor rejects) and the metrics tracker (its
    buffers stay on the CPU, where a later GPU model cannot add to them)."""
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    monkeypatch.setattr(moe_logging, "_MOE_METRICS_TRACKER", None)
