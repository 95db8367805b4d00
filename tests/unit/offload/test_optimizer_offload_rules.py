"""The optimizer-state offload rule (config.megatron_rules._optimizer_offload), each way: NeMo-RL's
optimizer_cpu_offload / optimizer_offload_fraction refused in one line where megatron-core's
hybrid CPU optimizer cannot run, accepted where it can."""

from __future__ import annotations

from typing import Any

import pytest
from support.policies import NO_TE, TE_2_10, P, check, make_policy

from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.preflight import check_policy

GOOD: dict[str, Any] = {
    "optimizer": "adam",
    "lr": 1e-5,
    "use_distributed_optimizer": True,
    "use_precision_aware_optimizer": True,
    "optimizer_cpu_offload": True,
    "optimizer_offload_fraction": 1.0,
}


def _check(optimizer: dict[str, Any], gpus: int = 1):
    policy = make_policy("tiny-dense")
    policy["megatron_cfg"]["optimizer"] = optimizer
    return check_policy(
        policy,
        where="policy",
        architecture=architecture_for("tiny-dense"),
        caps=NO_TE,
        gpus_per_node=gpus,
    )


@pytest.mark.parametrize(
    ("bad", "path", "fragment"),
    [
        (
            {"use_distributed_optimizer": False},
            "optimizer_cpu_offload",
            "use_distributed_optimizer",
        ),
        (
            {"use_precision_aware_optimizer": False},
            "optimizer_cpu_offload",
            "use_precision_aware_optimizer=true",
        ),
        ({"optimizer": "sgd"}, "optimizer", "needs adam"),
        ({"optimizer_offload_fraction": 0.0}, "optimizer_offload_fraction", "must be in (0, 1]"),
        ({"optimizer_offload_fraction": 1.5}, "optimizer_offload_fraction", "must be in (0, 1]"),
    ],
    ids=["distributed", "precision_aware", "sgd", "fraction0", "fraction_big"],
)
def test_optimizer_offload_rule_both_ways(bad, path, fragment):
    found = _check({**GOOD, **bad})
    lines = [e for e in found.errors if e.startswith(f"{P}.optimizer.{path}: ")]
    assert any(fragment in line for line in lines), found.errors
    assert _check(GOOD).errors == []


def test_optimizer_offload_needs_gpu_workers():
    assert any("needs CUDA" in e for e in _check(GOOD, gpus=0).errors)
    assert _check(GOOD, gpus=1).errors == []


def test_fraction_without_offload_warns_and_nemo_rl_defaults_pass():
    found = _check({**GOOD, "optimizer_cpu_offload": False, "optimizer_offload_fraction": 0.5})
    assert found.errors == [] and any("ignored because" in w for w in found.warnings)
    defaults = _check(
        {
            "optimizer": "adam",
            "lr": 1e-5,
            "optimizer_cpu_offload": False,
            "optimizer_offload_fraction": 0.0,
        }
    )
    assert defaults.errors == [] and defaults.warnings == []


@pytest.mark.parametrize(
    "caps,gpus,optimizer,warned",
    [
        (NO_TE, 1, {}, True),
        (TE_2_10, 1, {}, False),
        (NO_TE, 0, {}, False),  # CPU workers: the distributed optimizer, as always there
        (
            NO_TE,
            1,
            {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0},
            False,
        ),
    ],
    ids=["no_te", "te", "cpu_workers", "hybrid_cpu_optimizer"],
)
def test_the_precision_aware_optimizer_without_its_fused_adam_is_a_warning(
    caps, gpus, optimizer, warned
):
    """NeMo-RL's base recipes set use_precision_aware_optimizer: true; megatron-core refuses it
    at the optimizer's construction without Transformer Engine's FusedAdam (unless the hybrid
    CPU optimizer runs it), so the workers run the distributed optimizer (megatron_settings.
    precision_aware_optimizer) and validate says so."""
    from nemo_rl_offload.config import megatron_settings

    opt = {
        "use_distributed_optimizer": True,
        "use_precision_aware_optimizer": True,
        **optimizer,
    }
    findings = check(
        "tiny-dense", caps, gpus=gpus, optimizer={"optimizer": "adam", "lr": 1e-5, **opt}
    )
    assert findings.errors == []
    lines = [w for w in findings.warnings if "use_precision_aware_optimizer: ignored" in w]
    assert bool(lines) == warned
    runs = megatron_settings.precision_aware_optimizer(
        opt, te_installed=caps.has_transformer_engine, on_gpu=gpus > 0
    )
    assert runs == (not warned and gpus > 0)
