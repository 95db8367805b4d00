"""What the installed megatron-core and Transformer Engine support: facts, not rules.

The offload rules take a :class:`Capabilities` as input, so tests can ask "what if Transformer
Engine 2.10 were installed?" without installing it. :func:`detect` reads the real machine.

Known offload module names come from the installed megatron-core when it tells them: version
0.19 keeps them in a local set inside ``TransformerConfig.__post_init__`` and prints them when
given an unknown name, so we ask it once with a probe name and read its answer. If that fails
(a future version words it differently, or megatron-core is missing) we fall back to a table
by version.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

from nemo_rl_offload.config.environment import Capabilities, version_tuple
from nemo_rl_offload.config.module_names import LOCAL_RECOMPUTE_MODULES, OFFLOAD_MODULES_BY_VERSION


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """Importing megatron-core without Transformer Engine or Apex prints a screen of warnings
    (and torch a CUDA notice) that say nothing about the user's recipe; keep them off stderr,
    where every line is meant to be about the recipe."""
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch_log.setLevel(level)


def transformer_config_class() -> Any:
    """megatron-core's TransformerConfig, imported quietly; None when megatron-core is missing."""
    try:
        with _quiet_import():
            from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception:  # missing or broken megatron-core: callers fall back or skip
        return None
    return TransformerConfig


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _names_from_megatron() -> frozenset[str] | None:
    """Ask the installed TransformerConfig which offload module names it allows."""
    TransformerConfig = transformer_config_class()
    if TransformerConfig is None:
        return None
    try:
        with _quiet_import():
            TransformerConfig(
                num_layers=1,
                hidden_size=8,
                num_attention_heads=1,
                fine_grained_activation_offloading=True,
                offload_modules=["__nemo_rl_offload_probe__"],
            )
    except (AssertionError, ValueError) as exc:
        match = re.search(r"Allowed modules are:\s*(\{.*?\})", str(exc))
        if match:
            try:
                return frozenset(ast.literal_eval(match.group(1)))
            except (ValueError, SyntaxError):
                return None
    return None


def _names_from_table(megatron_version: str | None) -> frozenset[str]:
    minor = ".".join(str(p) for p in version_tuple(megatron_version)[:2])
    if minor in OFFLOAD_MODULES_BY_VERSION:
        return OFFLOAD_MODULES_BY_VERSION[minor]
    return OFFLOAD_MODULES_BY_VERSION[max(OFFLOAD_MODULES_BY_VERSION, key=version_tuple)]


@functools.cache
def detect() -> Capabilities:
    """The capabilities of this Python environment (cached: it imports megatron-core once)."""
    megatron_version = _installed_version("megatron-core")
    te_version = _installed_version("transformer-engine") or _installed_version(
        "transformer_engine"
    )
    if te_version is None and importlib.util.find_spec("transformer_engine") is not None:
        te_version = "unknown"
    names = _names_from_megatron()
    source = "megatron-core"
    if names is None:
        names, source = _names_from_table(megatron_version), "version table"
    drift, mlp_drift = _offload_code_drift(megatron_version)
    recompute_drift = _recompute_code_drift(megatron_version)
    return Capabilities(
        megatron_version,
        te_version,
        names,
        source,
        drift,
        mlp_drift,
        _layer_input_code_drift(megatron_version),
        recompute_drift,
    )


def _layer_input_code_drift(megatron_version: str | None) -> str | None:
    """The line refusing ``layer_input`` when the Megatron checkpoint code it relies on is not
    the checked one (:func:`nemo_rl_offload.offload.layer_input.drift`), else None."""
    if megatron_version is None:
        return None
    try:
        with _quiet_import():
            module = importlib.import_module("nemo_rl_offload.offload.layer_input")
    except (ImportError, AttributeError) as exc:
        return (
            f"megatron-core {megatron_version}'s checkpoint code is not the one the layer_input "
            f"offload was checked against ({exc}); remove layer_input from offload_modules"
        )
    return module.drift()


def _offload_code_drift(megatron_version: str | None) -> tuple[str | None, str | None]:
    """Whether the installed megatron-core's offload code is the one the offload runtime's
    subclasses (:func:`nemo_rl_offload.offload.owned.megatron_drift`) and the MLP offload points
    (``owned.mlp_drift``) were checked against: None each when it is or megatron-core is
    missing (reported elsewhere), else the line to show."""
    if megatron_version is None:
        return None, None
    try:
        with _quiet_import():
            owned = importlib.import_module("nemo_rl_offload.offload.owned")
    except (ImportError, AttributeError) as exc:  # a module or class the runtime uses is gone
        line = (
            f"megatron-core {megatron_version}'s fine-grained offloading module is not the one "
            f"this backend was checked against ({exc}); pin the megatron-core version named in "
            "nemo_rl_offload/offload/owned.py (CHECKED_MEGATRON_VERSION) or update that module"
        )
        return line, line
    return owned.megatron_drift(), owned.mlp_drift()


def _recompute_code_drift(megatron_version: str | None) -> tuple[tuple[str, str], ...]:
    """(module, line) for each of :data:`LOCAL_RECOMPUTE_MODULES` whose Megatron code is not the
    checked one (``owned.recompute_drift``); () when it all is or megatron-core is missing."""
    if megatron_version is None:
        return ()
    try:
        with _quiet_import():
            owned = importlib.import_module("nemo_rl_offload.offload.owned")
    except (ImportError, AttributeError) as exc:  # a module or class the seams use is gone
        return tuple(
            (
                name,
                f"recomputing {name} on the local layer spec needs the megatron-core code "
                f"this backend was checked against ({exc}); remove {name} or pin the version "
                "named in nemo_rl_offload/offload/owned.py (CHECKED_MEGATRON_VERSION)",
            )
            for name in sorted(LOCAL_RECOMPUTE_MODULES)
        )
    lines = ((name, owned.recompute_drift({name})) for name in sorted(LOCAL_RECOMPUTE_MODULES))
    return tuple((name, line) for name, line in lines if line)


@functools.cache
def transformer_config_fields() -> frozenset[str] | None:
    """Field names of the installed TransformerConfig, or None when megatron-core is missing."""
    TransformerConfig = transformer_config_class()
    if TransformerConfig is None:
        return None
    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))


@functools.cache
def transformer_config_defaults() -> dict[str, object]:
    """Default values of the installed TransformerConfig's simple fields ({} without megatron)."""
    TransformerConfig = transformer_config_class()
    if TransformerConfig is None:
        return {}
    defaults: dict[str, object] = {}
    for f in dataclasses.fields(TransformerConfig):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults
