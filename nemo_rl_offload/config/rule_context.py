"""What every recipe rule reads and writes: one policy section's effective settings and where
each came from (:class:`RuleContext`), and the findings all rules add to (:class:`Findings`).
The rules themselves: :mod:`.megatron_rules` (parallelism, batching, precision, MTP) and
:mod:`nemo_rl_offload.offload.rules` (offloading and the recompute beside it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_offload.config.environment import Capabilities
from nemo_rl_offload.config.megatron_settings import EffectiveSettings
from nemo_rl_offload.config.model_presets import Architecture


@dataclass
class Findings:
    """What the rules found. ``worker_env`` holds variables every policy worker must get."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    worker_env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def extend(self, other: Findings) -> None:
        self.errors += other.errors
        self.warnings += other.warnings
        self.worker_env.update(other.worker_env)
        self.notes += other.notes


@dataclass
class RuleContext:
    """What every rule needs: the effective settings and where each came from."""

    where: str
    megatron_cfg: dict[str, Any]
    effective: EffectiveSettings
    architecture: Architecture | None
    caps: Capabilities
    policy_cfg: dict[str, Any]
    gpus_per_node: Any
    # How many workers the section runs on (None: the cluster section is malformed; the
    # schema reports it).
    workers: int | None = None
    # TransformerConfig's field names in the installed megatron-core (None: not installed).
    transformer_fields: frozenset[str] | None = None
    findings: Findings = field(default_factory=Findings)

    @property
    def prefix(self) -> str:
        return f"{self.where}.megatron_cfg"

    def path(self, name: str) -> str:
        return self.effective.source(name, f"{self.prefix}.{name}")

    def value(self, name: str, default: Any = None) -> Any:
        return self.effective.value(name, default)

    def error(self, line: str) -> None:
        self.findings.errors.append(line)

    def warn(self, line: str) -> None:
        self.findings.warnings.append(line)

    @property
    def fgo_on(self) -> bool:
        return self.value("fine_grained_activation_offloading") is True

    @property
    def modules(self) -> list[str]:
        """``offload_modules`` as listed (on or off)."""
        return list(self.effective.listed_offload_modules)

    @property
    def is_moe(self) -> bool:
        return self.effective.is_moe


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def names(value: Any) -> list[str]:
    """A list of module names, or [] when the value is not such a list (the schema reports it)."""
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    return []


def fmt(names: Any) -> str:
    return "[" + ", ".join(sorted(names)) + "]"


Rule = Callable[[RuleContext], None]
