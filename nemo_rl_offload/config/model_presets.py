"""Model architectures by name, as plain data, so that validation can reason about a model
(is it MoE? how big is an expert's input?) without importing torch or megatron.

``policy.model_name`` is either a preset name below or a local Hugging Face model directory;
:func:`architecture_for` turns either into an :class:`Architecture`: TransformerConfig fields
plus the few GPTModel arguments that are not TransformerConfig fields.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nemo_rl_offload.errors import UserInputError

# Shared by every Llama-style preset: pre-norm RMSNorm, SwiGLU MLP, RoPE, no biases.
_LLAMA_STYLE: dict[str, Any] = {
    "normalization": "RMSNorm",
    "gated_linear_unit": True,
    "activation": "silu",  # not a TransformerConfig field: the model builder maps it to F.silu
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "layernorm_epsilon": 1e-5,
}

_MOE_STYLE: dict[str, Any] = {
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 1e-3,
    "moe_token_dispatcher_type": "alltoall",
}


# The Hugging Face model types this package converts to and from (models/hf_convert.py).
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class Architecture:
    """What a model is: TransformerConfig fields (``transformer``) and GPTModel arguments."""

    name: str
    transformer: dict[str, Any]
    vocab_size: int
    max_position_embeddings: int
    rotary_base: int = 10000
    share_embeddings_and_output_weights: bool = False
    hf_directory: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # ``hf_config_overrides`` as applied on top of config.json, and those of its keys that
    # the mapping above never read (they change nothing here; export-hf still writes them).
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    unread_overrides: tuple[str, ...] = ()

    @property
    def num_moe_experts(self) -> int | None:
        return self.transformer.get("num_moe_experts")


def has_experts(num_moe_experts: Any) -> bool:
    """The one rule for whether a model has experts, applied to its effective
    ``num_moe_experts`` (the preset's, or ``megatron_cfg.model_overrides``'): more than one
    (one expert is a dense MLP). The offload rules, the planner, the workers and the recipe-key
    checks all ask this, so they never disagree about a model."""
    if isinstance(num_moe_experts, bool) or not isinstance(num_moe_experts, int):
        return False
    return num_moe_experts > 1


PRESETS: dict[str, Architecture] = {
    # Trains on 2 CPU cores in seconds (~0.9M parameters); byte-level vocabulary (256 bytes +
    # specials, padded).
    "tiny-dense": Architecture(
        name="tiny-dense",
        transformer={
            **_LLAMA_STYLE,
            "num_layers": 4,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 352,
        },
        vocab_size=384,
        max_position_embeddings=512,
    ),
    "tiny-moe": Architecture(
        name="tiny-moe",
        transformer={
            **_LLAMA_STYLE,
            **_MOE_STYLE,
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 176,
            "num_moe_experts": 4,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 96,
        },
        vocab_size=384,
        max_position_embeddings=512,
    ),
    # The 1.3B Llama-like model of the benchmarks (docs/benchmark.md).
    "llama-1b": Architecture(
        name="llama-1b",
        transformer={
            **_LLAMA_STYLE,
            "num_layers": 16,
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_query_groups": 8,
            "ffn_hidden_size": 5504,
        },
        vocab_size=32000,
        max_position_embeddings=8192,
        rotary_base=500000,
    ),
    # ~0.95B parameters in all, ~0.25B active per token (16 experts, top-2).
    "moe-1b": Architecture(
        name="moe-1b",
        transformer={
            **_LLAMA_STYLE,
            **_MOE_STYLE,
            "num_layers": 16,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "num_query_groups": 8,
            "ffn_hidden_size": 2816,
            "num_moe_experts": 16,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 1024,
        },
        vocab_size=32000,
        max_position_embeddings=8192,
        rotary_base=500000,
    ),
}


class _ReadRecorder(dict[str, Any]):
    """config.json's mapping that remembers which keys the mapping looked at, so that an
    override of a key it never reads is reported instead of silently changing nothing."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


def hf_config(directory: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Hugging Face model directory's config.json with ``hf_config_overrides`` applied as
    NeMo-RL applies them (keyword arguments of ``AutoConfig.from_pretrained``: each top-level
    key replaces config.json's value, a mapping as a whole)."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise UserInputError(f"{config_path}: missing; a Hugging Face model directory needs one")
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserInputError(f"{config_path}: not valid JSON ({exc})") from exc
    return {**hf, **(overrides or {})}


def _from_hf_config(
    directory: Path,
    overrides: dict[str, Any] | None = None,
    overrides_where: str = "policy.hf_config_overrides",
) -> Architecture:
    """Read the architecture of a local Hugging Face model directory from its config.json,
    with ``overrides`` (named ``overrides_where`` in messages) on top."""
    overrides = dict(overrides or {})
    config_path = directory / "config.json"
    hf = _ReadRecorder(hf_config(directory, overrides))
    missing = [
        key
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
        if key not in hf
    ]
    if missing:
        raise UserInputError(f"{config_path}: missing {', '.join(missing)}")
    if "router_aux_loss_coef" in overrides and not isinstance(
        overrides["router_aux_loss_coef"], int | float
    ):
        raise UserInputError(
            f"{overrides_where}.router_aux_loss_coef: must be a number (got: "
            f"{overrides['router_aux_loss_coef']!r})"
        )
    heads = hf["num_attention_heads"]
    transformer: dict[str, Any] = {
        **_LLAMA_STYLE,
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads", heads),
        "ffn_hidden_size": hf.get("intermediate_size", 4 * hf["hidden_size"]),
        "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "add_qkv_bias": bool(hf.get("attention_bias", False)) or hf.get("model_type") == "qwen2",
    }
    if hf.get("head_dim"):
        transformer["kv_channels"] = hf["head_dim"]
    if hf.get("model_type") in ("qwen3", "qwen3_moe"):
        transformer["qk_layernorm"] = True
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts:
        transformer.update(
            _MOE_STYLE,
            num_moe_experts=experts,
            moe_router_topk=hf.get("num_experts_per_tok", 2),
            moe_ffn_hidden_size=hf.get("moe_intermediate_size", transformer["ffn_hidden_size"]),
        )
        # The auxiliary load-balancing loss's weight, as Megatron-Bridge maps it (export-hf
        # writes it back under this name).
        if hf.get("router_aux_loss_coef") is not None:
            transformer["moe_aux_loss_coeff"] = float(hf["router_aux_loss_coef"])
        # Qwen3-MoE without norm_topk_prob keeps the full softmax's top-k probabilities
        # (Megatron: softmax before top-k); Mixtral and norm_topk_prob renormalise them
        # (Megatron's default: softmax over the chosen logits only).
        if hf.get("model_type") == "qwen3_moe" and not hf.get("norm_topk_prob", False):
            transformer["moe_router_pre_softmax"] = True
    # transformers >= 5 writes rope_theta only inside rope_parameters.
    rope = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta") or rope.get("rope_theta")
    scaling = (hf.get("rope_scaling") or {}).get("rope_type") or rope.get("rope_type")
    if scaling not in (None, "default"):
        overridden = [key for key in ("rope_scaling", "rope_parameters") if key in overrides]
        where = f"{overrides_where}.{overridden[0]}" if overridden else str(config_path)
        fix = "remove the override" if overridden else "use a checkpoint without rope_scaling"
        raise UserInputError(
            f"{where}: RoPE scaling '{scaling}' is not supported yet (the model would "
            f"compute different positions); {fix}"
        )
    architecture = Architecture(
        name=str(directory),
        transformer=transformer,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rotary_base=int(rope_theta or 10000),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        hf_directory=str(directory),
        hf_overrides=overrides,
    )
    unread = tuple(key for key in overrides if key not in hf.read)
    return replace(architecture, unread_overrides=unread)


class ModelNotOnMachine(UserInputError):
    """A Hugging Face model id that is neither a local directory nor in the local Hugging Face
    cache. Model hubs are never contacted, so ``validate`` skips the model's checks with a
    warning (the rest of the recipe is still checked) and training commands refuse to start."""


# A Hugging Face repository id: ``org/name``, neither part a path step.
_HF_REPO_ID = re.compile(r"^(?!\.{1,2}/)[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hf_repo_id(name: str) -> bool:
    """``name`` is a Hugging Face repository id (``org/name``), not a path."""
    return bool(_HF_REPO_ID.match(name))


def hf_cache_roots() -> list[Path]:
    """Where a Hugging Face cache may hold models: ``$HF_HUB_CACHE``, ``$HF_HOME/hub`` and
    ``~/.cache/huggingface/hub`` (the library's own order)."""
    roots: list[Path] = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]) / "hub")
    roots.append(Path.home() / ".cache" / "huggingface" / "hub")
    return roots


def cached_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of ``repo_id`` that holds a config.json: the
    one ``refs/main`` names, else the most recently written."""
    for root in hf_cache_roots():
        repo = root / ("models--" + repo_id.replace("/", "--"))
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            named = snapshots / ref.read_text().strip()
            if (named / "config.json").is_file():
                return named
        found = sorted(
            (p for p in snapshots.iterdir() if (p / "config.json").is_file()),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        if found:
            return found[0]
    return None


def architecture_for(
    model_name: str,
    *,
    base_dir: Path | None = None,
    where: str = "policy.model_name",
    hf_overrides: dict[str, Any] | None = None,
) -> Architecture:
    """The architecture named by ``policy.model_name``: a preset or a local HF directory,
    whose config.json ``hf_overrides`` (the section's ``hf_config_overrides``) update.

    A relative directory is looked up from ``base_dir`` (the working directory by default).
    """
    overrides_where = f"{where.rpartition('.')[0] or 'policy'}.hf_config_overrides"
    if model_name in PRESETS:
        if hf_overrides:
            raise UserInputError(
                f"{overrides_where}: preset '{model_name}' is not built from a config.json, so "
                "there is nothing to override; remove the key or give a Hugging Face model "
                f"directory as {where}"
            )
        return PRESETS[model_name]
    candidate = Path(model_name).expanduser()
    if not candidate.is_absolute() and base_dir is not None:
        candidate = base_dir / candidate
    if candidate.is_dir():
        return _from_hf_config(candidate, hf_overrides, overrides_where)
    if is_hf_repo_id(model_name):
        snapshot = cached_snapshot(model_name)
        if snapshot is not None:
            return _from_hf_config(snapshot, hf_overrides, overrides_where)
        roots = " or ".join(str(root) for root in hf_cache_roots()[-2:])
        raise ModelNotOnMachine(
            f"{where}: Hugging Face model '{model_name}' is not on this machine (model hubs are "
            f"not reached); give a local directory holding it as {where}, or put it in the "
            f"Hugging Face cache ({roots})"
        )
    close = difflib.get_close_matches(model_name, PRESETS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UserInputError(
        f"{where}: '{model_name}' is neither a preset nor a local directory; "
        f"{hint}presets: {', '.join(sorted(PRESETS))} (model hubs are not reached: "
        "download a Hugging Face model to a directory and give its path)"
    )


def section_architecture(
    section: dict[str, Any], *, where: str = "policy", base_dir: Path | None = None
) -> Architecture:
    """The architecture of a policy (or teacher) section named ``where``: its ``model_name``
    with its ``hf_config_overrides``, the one way every consumer builds the same model."""
    overrides = section.get("hf_config_overrides")
    return architecture_for(
        str(section["model_name"]),
        base_dir=base_dir,
        where=f"{where}.model_name",
        hf_overrides=overrides if isinstance(overrides, dict) else None,
    )
