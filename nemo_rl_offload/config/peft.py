"""``policy.megatron_cfg.peft``: LoRA adapters with NeMo-RL's keys and meaning, as settings.

NeMo-RL hands this section to Megatron-Bridge's LoRA: each chosen linear of attention and MLP
computes ``base(x) + (alpha / dim) * B(A(dropout(x)))`` (dropout on the adapter's input with
``dropout_position: pre``, on its output with ``post``), A starts xavier-initialised and B at
zero (so training starts from the base model), and every base weight is frozen. An empty
``target_modules`` means every linear of the layer (:data:`LINEARS`).

This module turns the section into :class:`LoraSettings` (what the layer spec places) and
reports, one line each, what this backend does not implement (so a recipe that asks for it
fails before a run, naming the key and the fix). No torch here.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The linears of the local layer spec an adapter can sit on (Megatron-Bridge's default targets).
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# Column-parallel linears (output split over tensor parallelism); the others are row-parallel.
COLUMN_PARALLEL = frozenset({"linear_qkv", "linear_fc1"})
A_INITS = ("xavier",)
B_INITS = ("zero",)
# NeMo-RL's exemplar values, used for a key the recipe leaves out.
DEFAULTS: dict[str, Any] = {
    "dim": 8,
    "alpha": 32,
    "dropout": 0.0,
    "dropout_position": "post",
    "lora_A_init_method": "xavier",
    "lora_B_init_method": "zero",
}


@dataclass(frozen=True)
class LoraSettings:
    """The adapters of one model: which linears carry one, the rank, the scale's numerator and
    the dropout."""

    targets: frozenset[str]
    dim: int
    alpha: float
    dropout: float = 0.0
    dropout_position: str = "post"

    @property
    def scale(self) -> float:
        """What the adapter's output is multiplied by (``alpha / dim``)."""
        return self.alpha / self.dim


def _section(policy_cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    megatron_cfg = policy_cfg.get("megatron_cfg") or {}
    peft = megatron_cfg.get("peft") if isinstance(megatron_cfg, Mapping) else None
    if not isinstance(peft, Mapping) or peft.get("enabled") is not True:
        return None
    return peft


def _names(value: Any) -> list[str]:
    return [str(name) for name in value] if isinstance(value, list) else []


def _matching(patterns: list[str]) -> set[str]:
    return {name for name in LINEARS if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


def _targets(peft: Mapping[str, Any]) -> frozenset[str]:
    chosen = _matching(_names(peft.get("target_modules"))) or set(LINEARS)
    return frozenset(chosen - _matching(_names(peft.get("exclude_modules"))))


def lora_settings(policy_cfg: Mapping[str, Any]) -> LoraSettings | None:
    """The adapters ``policy_cfg`` (a policy section) asks for; None when peft is off. The
    section is assumed to have passed :func:`problems`."""
    peft = _section(policy_cfg)
    if peft is None:
        return None
    value = {**DEFAULTS, **{k: v for k, v in peft.items() if v is not None}}
    return LoraSettings(
        targets=_targets(peft),
        dim=int(value["dim"]),
        alpha=float(value["alpha"]),
        dropout=float(value["dropout"]),
        dropout_position=str(value["dropout_position"]),
    )


def _pattern_problem(key: str, pattern: str) -> str | None:
    if "." in pattern:
        return (
            f"{key}: '{pattern}' names modules of particular layers; this backend places "
            f"adapters on every layer alike: use linear names ({', '.join(LINEARS)})"
        )
    if _matching([pattern]):
        return None
    if any(ch in pattern for ch in "*?["):
        return None  # a wildcard for modules these models do not have (e.g. Mamba's out_proj)
    close = difflib.get_close_matches(pattern, LINEARS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{key}: '{pattern}' is not a linear of these models; {hint}use {', '.join(LINEARS)}"


def problems(policy_cfg: Mapping[str, Any], where: str = "policy") -> list[str]:
    """One line per peft setting of ``policy_cfg`` this backend cannot run (empty when peft
    is off). Types are the schema's to report; only well-typed values are looked at."""
    peft = _section(policy_cfg)
    if peft is None:
        return []
    key = f"{where}.megatron_cfg.peft"
    found: list[str] = []
    for name in ("target_modules", "exclude_modules"):
        for pattern in _names(peft.get(name)):
            line = _pattern_problem(f"{key}.{name}", pattern)
            if line:
                found.append(line)
    if not found and not _targets(peft):
        found.append(
            f"{key}.exclude_modules: excludes every target; leave at least one of "
            f"{', '.join(LINEARS)}"
        )
    dim = peft.get("dim")
    if isinstance(dim, int) and not isinstance(dim, bool) and dim < 1:
        found.append(f"{key}.dim: {dim} is not a rank; use a positive integer (e.g. 8)")
    alpha = peft.get("alpha")
    if isinstance(alpha, int | float) and not isinstance(alpha, bool) and alpha <= 0:
        found.append(f"{key}.alpha: {alpha} must be positive (the scale is alpha / dim)")
    dropout = peft.get("dropout")
    if isinstance(dropout, int | float) and not 0 <= dropout < 1:
        found.append(f"{key}.dropout: {dropout} must be in [0, 1)")
    for name, allowed in (("lora_A_init_method", A_INITS), ("lora_B_init_method", B_INITS)):
        method = peft.get(name)
        if method is not None and method not in allowed:
            found.append(
                f"{key}.{name}: '{method}' is not implemented by this backend; use "
                f"{' or '.join(repr(a) for a in allowed)}"
            )
    if peft.get("a2a_experimental") is True:
        found.append(
            f"{key}.a2a_experimental: the all-to-all adapter communication is not implemented "
            "by this backend; set it to false"
        )
    if peft.get("lora_dtype") not in (None, "None"):
        found.append(
            f"{key}.lora_dtype: adapters take the model's precision here; set it to null "
            "(policy.precision sets both)"
        )
    return found


def model_problems(
    policy_cfg: Mapping[str, Any],
    where: str,
    *,
    has_experts: bool,
    transformer_impl: str | None,
    cuda_graph_impl: str | None,
) -> list[str]:
    """What peft cannot be combined with in the model this section builds (one line each)."""
    if _section(policy_cfg) is None:
        return []
    key = f"{where}.megatron_cfg.peft.enabled"
    found = []
    if has_experts:
        found.append(
            f"{key}: adapters on a model with experts (MoE linears) are not implemented yet; "
            "set it to false or use a dense model"
        )
    if transformer_impl not in (None, "local"):
        found.append(
            f"{key}: adapters sit on the local layer spec; set "
            f"{where}.megatron_cfg.transformer_impl to local"
        )
    if cuda_graph_impl not in (None, "none"):
        found.append(
            f"{key}: adapters with CUDA graphs are not checked yet; set "
            f"{where}.megatron_cfg.cuda_graph_impl to none"
        )
    return found
