"""The activation ledger of a recipe, measured once per model and kept on disk.

Measuring the ledger takes seconds for a billion-parameter model, and what a layer saves per
token does not depend on the recipe's lengths, batch sizes, parallel layout or offload
settings, so one measurement serves every recipe of that model. The key and the cache's
location: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.model_shape import layer_kinds
from nemo_rl_offload.planning.ledger import (
    DEFAULT_LENGTHS,
    MODEL,
    Entry,
    LayerKind,
    Ledger,
    one_layer_settings,
    parallel_notes,
    recompute_flops_per_token,
    tokens_per_microbatch,
)

CACHE_ENV = "NEMO_RL_OFFLOAD_CACHE_DIR"
# The modules whose code decides what a measured layer saves.
_MEASURING_MODULES = (
    "nemo_rl_offload.planning.ledger",
    "nemo_rl_offload.offload.saved_tensors",
    "nemo_rl_offload.offload.cuda_norms",
    "nemo_rl_offload.planning.ledger_run",
    "nemo_rl_offload.models.builder",
    "nemo_rl_offload.models.attention",
    "nemo_rl_offload.models.self_attention",
    "nemo_rl_offload.models.mlp_offload",
    "nemo_rl_offload.models.norms",
    "nemo_rl_offload.models.chunked_logprobs",
)
_MEMO: dict[str, dict[str, Any]] = {}


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nemo_rl_offload"


def _code_fingerprint() -> str:
    import importlib.util

    digest = hashlib.sha256()
    for name in _MEASURING_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "none"


def ledger_key(
    effective: megatron_settings.EffectiveSettings,
    architecture: Any,
    section: dict[str, Any],
    lengths: tuple[int, int],
) -> str:
    """The hash of everything the measured entries depend on (see docs/design/planner.md)."""
    from nemo_rl_offload.models.chunked_logprobs import chunk_settings

    kinds = [
        (
            kind,
            {
                k: repr(s.value)
                for k, s in sorted(one_layer_settings(effective, o).settings.items())
            },
        )
        for kind, _, o in layer_kinds(effective)
    ]
    arch = {k: repr(v) for k, v in sorted(dataclasses.asdict(architecture).items())}
    inputs = {
        "kinds": kinds,
        "architecture": arch,
        "chunk": repr(chunk_settings(section)),
        "precision": repr(section.get("precision")),
        "lengths": list(lengths),
        "megatron": _megatron_version(),
        "code": _code_fingerprint(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def stored_entries(ledger: Ledger) -> dict[str, Any]:
    """What the cache keeps of a ledger: its entries, without what the recipe decides."""
    return {
        "model": ledger.model,
        "kinds": [
            {"kind": k.kind, "entries": [dataclasses.asdict(e) for e in k.entries]}
            for k in ledger.kinds
        ],
    }


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data))
        partial.replace(path)
    except OSError:
        pass


def cached_ledger(
    section: dict[str, Any],
    *,
    where: str = "policy",
    base_dir: Path | None = None,
    lengths: tuple[int, int] = DEFAULT_LENGTHS,
) -> tuple[Ledger, bool]:
    """The section's ledger (as :func:`.ledger_run.build_ledger` gives it) and whether it came
    from the cache."""
    from nemo_rl_offload.config.model_presets import section_architecture

    architecture = section_architecture(section, where=where, base_dir=base_dir)
    effective = megatron_settings.effective_settings(
        section, architecture, where=where, te_installed=False
    )
    key = ledger_key(effective, architecture, section, lengths)
    path = cache_dir() / f"ledger-{key}.json"
    stored = _MEMO.get(key) or _read(path)
    hit = stored is not None
    if stored is None:
        from nemo_rl_offload.planning.ledger_run import build_ledger

        stored = stored_entries(
            build_ledger(section, where=where, base_dir=base_dir, lengths=lengths)
        )
        _write(path, stored)
    _MEMO[key] = stored
    return ledger_from_stored(stored, effective, section, where, lengths), hit


def ledger_from_stored(
    stored: dict[str, Any],
    effective: megatron_settings.EffectiveSettings,
    section: dict[str, Any],
    where: str,
    lengths: tuple[int, int],
) -> Ledger:
    """A ledger from :func:`stored_entries`, with what the recipe decides filled in."""
    tokens, source = tokens_per_microbatch(section, where)
    seq = int(section.get("max_total_sequence_length") or tokens)
    kinds_now = {kind: (layers, o) for kind, layers, o in layer_kinds(effective)}
    kinds = []
    for kind in stored["kinds"]:
        layers, overrides = kinds_now.get(kind["kind"], (1, {}))
        settings = one_layer_settings(effective, overrides)
        entries = []
        for data in kind["entries"]:
            entry = Entry(**data)
            if entry.recompute:
                flops = recompute_flops_per_token(entry.recompute, settings, seq)
                entry = dataclasses.replace(entry, recompute_flops_per_token=flops)
            entries.append(entry)
        kinds.append(LayerKind(kind["kind"], 1 if kind["kind"] == MODEL else layers, entries))
    dtype = str(section.get("precision") or "float32")
    return Ledger(
        stored["model"], dtype, tokens, source, tuple(lengths), kinds, parallel_notes(effective)
    )
