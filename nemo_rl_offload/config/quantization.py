"""``policy.quant_cfg`` (NeMo-RL's quantization-aware training with NVIDIA ModelOpt): which
config a recipe names, where its file is, and which combinations this backend refuses.
``models.quantization`` applies it; validate and a run both go through :func:`problems`.

NeMo-RL's meaning, kept here: ``policy.quant_cfg`` names a ModelOpt config, either a constant
of ``modelopt.torch.quantization`` (``NVFP4_DEFAULT_CFG``) or a YAML recipe file whose
``quantize:`` section (or the whole document) holds ``quant_cfg`` and ``algorithm``. The
policy trains with ModelOpt's fake-quantized linears (straight-through gradients), and
``policy.generation.quant_cfg`` says how rollouts are quantized. Rollouts here run on the
training model, so they can be quantized with the policy's config or not at all.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nemo_rl_offload.config.safe_yaml import load_yaml, yaml_problem

# NeMo-RL's defaults for the calibration loop (policy.quant_batch_size,
# policy.quant_sequence_length).
DEFAULT_CALIBRATION_BATCH = 32
DEFAULT_CALIBRATION_LENGTH = 1024
_CONFIG_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
# Quantizers of the KV cache and of attention's matmuls: ModelOpt attaches them to Transformer
# Engine's attention only, so on this backend's attention they would quantize nothing.
_ATTENTION_QUANTIZERS = re.compile(r"bmm_quantizer|kv_cache|softmax_quantizer|_KV_", re.I)


def policy_config(section: Mapping[str, Any]) -> str | None:
    """The section's ``quant_cfg`` (None: the policy is not quantized)."""
    value = section.get("quant_cfg")
    return value if isinstance(value, str) and value else None


def rollouts_quantized(section: Mapping[str, Any]) -> bool:
    """Whether the sampler runs the quantized model (``generation.quant_cfg`` set; equal to
    ``quant_cfg``, which :func:`problems` checks)."""
    generation = section.get("generation") or {}
    return isinstance(generation, Mapping) and bool(generation.get("quant_cfg"))


def is_config_name(value: str) -> bool:
    """A ModelOpt constant's name (``NVFP4_DEFAULT_CFG``), not a file."""
    return bool(_CONFIG_NAME.fullmatch(value))


def search_dirs(base_dir: Path, recipe_path: Path | None) -> list[Path]:
    """Where a relative recipe file is looked for: the working directory (NeMo-RL resolves it
    there: its recipes name paths from its repository's root), then each directory above the
    recipe file and above each file its ``defaults:`` reach (so a NeMo-RL recipe, or a recipe
    of one's own over it, finds NeMo-RL's file from anywhere)."""
    from nemo_rl_offload.config.loader import recipe_files

    dirs = [base_dir]
    for file in recipe_files(recipe_path) if recipe_path is not None else []:
        dirs += [d for d in file.resolve().parents if d not in dirs]
    return dirs


def locate(value: str, dirs: Sequence[Path]) -> Path | None:
    """The recipe file ``value`` names, or None when no directory of ``dirs`` holds it."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return path if path.is_file() else None
    for directory in dirs:
        if (directory / path).is_file():
            return directory / path
    return None


def name_file_absolutely(section: dict[str, Any], dirs: Sequence[Path]) -> None:
    """Write a recipe file found relatively as its absolute path into ``section`` (and into
    ``generation.quant_cfg`` when it names the same), so that the workers, which run
    elsewhere, read the file :func:`problems` checked."""
    value = policy_config(section)
    if value is None or is_config_name(value):
        return
    path = locate(value, dirs)
    if path is None:
        return
    section["quant_cfg"] = str(path.resolve())
    generation = section.get("generation")
    if isinstance(generation, dict) and generation.get("quant_cfg") == value:
        generation["quant_cfg"] = section["quant_cfg"]


def read_recipe_file(path: Path) -> dict[str, Any]:
    """The ``mtq.quantize`` config of a YAML recipe: its ``quantize:`` section, or the
    document itself; ``algorithm`` defaults to ``max`` (ModelOpt's calibration default)."""
    try:
        document = load_yaml(path.read_text())
    except yaml.YAMLError as exc:  # one line, where it is
        raise ValueError(yaml_problem(path.name, exc)) from None
    config = document.get("quantize", document) if isinstance(document, dict) else None
    if not isinstance(config, dict) or "quant_cfg" not in config:
        raise ValueError("it holds no quant_cfg (at the top or under quantize:)")
    return {"algorithm": "max", **config}


@dataclass(frozen=True)
class Calibration:
    """NeMo-RL's calibration keys: ``quant_calib_size`` examples, rows of
    ``quant_sequence_length`` tokens, ``quant_batch_size`` rows a batch."""

    examples: int = 0
    length: int = DEFAULT_CALIBRATION_LENGTH
    per_batch: int = DEFAULT_CALIBRATION_BATCH


def calibration(section: Mapping[str, Any]) -> Calibration:
    """A policy section's calibration settings (NeMo-RL's defaults)."""
    return Calibration(
        examples=int(section.get("quant_calib_size") or 0),
        length=int(section.get("quant_sequence_length") or DEFAULT_CALIBRATION_LENGTH),
        per_batch=int(section.get("quant_batch_size") or DEFAULT_CALIBRATION_BATCH),
    )


def calibration_batches(
    sequences: Sequence[Sequence[int]], settings: Calibration
) -> list[list[list[int]]]:
    """The calibration batches from token id sequences (a run's training data): the first
    ``examples`` laid end to end and cut into rows of ``length`` tokens (no padding enters the
    calibrated ranges; a short last row is dropped unless it is the only one), ``per_batch``
    rows a batch."""
    examples, length, per_batch = settings.examples, settings.length, settings.per_batch
    stream = [token for sequence in sequences[:examples] for token in sequence]
    rows = [stream[i : i + length] for i in range(0, len(stream), length)]
    if len(rows) > 1 and len(rows[-1]) < length:
        rows.pop()
    return [rows[i : i + per_batch] for i in range(0, len(rows), per_batch)]


def summary(value: str, applied: Mapping[str, int]) -> str:
    """The line a run prints once the workers quantized (``PolicyGroup.quantize``'s counts)."""
    calibrated = applied["calibration_batches"]
    return f"policy quantization-aware with {value}: {applied['quantizers']} quantizers" + (
        f", calibrated on {calibrated} batches" if calibrated else ""
    )


def problems(
    recipe: Mapping[str, Any],
    *,
    dirs: Sequence[Path],
    peft_enabled: bool,
    graphs: Any,
    config_names: Callable[[], set[str]] | None = None,
) -> tuple[list[str], list[str]]:
    """(errors, warnings), one line each, for the policy's quantization keys. ``graphs``: the
    effective ``cuda_graph_impl``; ``config_names``: ModelOpt's config names (asked only for a
    recipe that names one; ``models.quantization.config_names``)."""
    policy = recipe.get("policy")
    if not isinstance(policy, Mapping):
        return [], []
    errors: list[str] = []
    warnings: list[str] = []
    value = policy_config(policy)
    generation = policy.get("generation") or {}
    wanted = generation.get("quant_cfg") if isinstance(generation, Mapping) else None
    if wanted and wanted != value:
        errors.append(
            f"policy.generation.quant_cfg: {wanted!r} differs from policy.quant_cfg "
            f"({value!r}); rollouts here run on the training model, so they are quantized with "
            f"the policy's config or not at all; set it to {value!r} or null"
            if value
            else f"policy.generation.quant_cfg: {wanted!r} quantizes rollouts of a policy "
            "that trains unquantized; rollouts here run on the training model: set "
            f"policy.quant_cfg to {wanted!r} too (quantization-aware training) or this to null"
        )
    real_quant = isinstance(generation, Mapping) and generation.get("real_quant") is True
    if real_quant and not wanted:
        errors.append(
            "policy.generation.real_quant: true quantizes rollouts with their quant_cfg, and "
            "policy.generation.quant_cfg is null (NeMo-RL refuses this too); set "
            "generation.quant_cfg to policy.quant_cfg, or real_quant to false"
        )
    elif real_quant and value:
        warnings.append(
            "warning: policy.generation.real_quant: rollouts run the fake-quantized weights "
            "on megatron-core, the values NVFP4 kernels compute (up to summation order), "
            "not vLLM's packed NVFP4 kernels"
        )
    if value is None:
        return errors, warnings
    key = "policy.quant_cfg"
    if is_config_name(value):
        known = config_names() if config_names is not None else None
        if known is not None and value not in known:
            close = difflib.get_close_matches(value, sorted(known), n=1)
            errors.append(
                f"{key}: {value!r} is not a quantization config of ModelOpt"
                + (f"; did you mean {close[0]}?" if close else f"; its configs: {sorted(known)}")
            )
        elif _ATTENTION_QUANTIZERS.search(value):
            errors.append(_attention_refusal(key, value))
    else:
        path = locate(value, dirs)
        if path is None:
            errors.append(
                f"{key}: {value!r} is neither a ModelOpt config name (e.g. NVFP4_DEFAULT_CFG) "
                f"nor a file under {dirs[0]} or a directory above the recipe and the files "
                "it inherits; give the file's absolute path"
            )
        else:
            try:
                config = read_recipe_file(path)
            except (ValueError, yaml.YAMLError, OSError) as err:
                errors.append(f"{key}: {path} is not a ModelOpt quantization recipe: {err}")
            else:
                if _enables_attention_quantizers(config["quant_cfg"]):
                    errors.append(_attention_refusal(key, value))
    if peft_enabled:
        errors.append(
            f"{key}: quantization-aware training beside LoRA adapters is not implemented yet "
            "by this backend; set policy.megatron_cfg.peft.enabled to false, or this to null"
        )
    if graphs not in (None, "none"):
        errors.append(
            f"{key}: quantization-aware training under CUDA graphs ({graphs}) is not "
            "implemented yet by this backend; set policy.megatron_cfg.cuda_graph_impl to "
            "none, or this to null"
        )
    return errors, warnings


def _attention_refusal(key: str, value: str) -> str:
    return (
        f"{key}: {value!r} quantizes the KV cache or attention's matmuls, which ModelOpt "
        "does only inside Transformer Engine's attention (not installed here): this backend's "
        "attention would stay unquantized; choose a config of the linear layers only"
    )


def _enables_attention_quantizers(entries: Any) -> bool:
    """Whether a config's ``quant_cfg`` (NeMo-RL's list form or ModelOpt's older mapping
    form) enables a quantizer of attention's matmuls or the KV cache."""
    if isinstance(entries, Mapping):
        entries = [{"quantizer_name": k, "cfg": v} for k, v in entries.items()]
    for entry in entries or []:
        if not isinstance(entry, Mapping):
            continue
        name = str(entry.get("quantizer_name", ""))
        cfg = entry.get("cfg")
        enabled = entry.get("enable", not (isinstance(cfg, Mapping) and cfg.get("enable") is False))
        if enabled and _ATTENTION_QUANTIZERS.search(name):
            return True
    return False
