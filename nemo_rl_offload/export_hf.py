"""``nemo-rl-offload export-hf``: a training checkpoint as a Hugging Face model directory.

The checkpoint holds one file per model-parallel shard (``policy/model_tp<t>_pp<p>.pt``) but
not the architecture, so the recipe that trained it is read too. The shards of each
tensor-parallel rank are joined across pipeline stages, converted to Hugging Face names and
layouts (``models.hf_convert``), and written with config.json and the tokenizer files of the
model's directory, if it came from one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from nemo_rl_offload.algorithms.common import resolve_checkpoint
from nemo_rl_offload.config.model_presets import HF_MODEL_TYPES as MODEL_TYPES
from nemo_rl_offload.config.model_presets import Architecture, architecture_for
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.preflight import load_and_check

_SHARD = re.compile(r"model_tp(\d+)_pp(\d+)\.pt$")


def default_model_type(architecture: Architecture) -> str:
    """The source directory's model_type when it is one we write, else the closest family."""
    if architecture.hf_directory:
        import json

        source = json.loads((Path(architecture.hf_directory) / "config.json").read_text())
        if source.get("model_type") in MODEL_TYPES:
            return str(source["model_type"])
    t = architecture.transformer
    if t.get("num_moe_experts"):
        return "qwen3_moe" if t.get("qk_layernorm") else "mixtral"
    if t.get("qk_layernorm"):
        return "qwen3"
    return "qwen2" if t.get("add_qkv_bias") else "llama"


def _read_shards(policy_dir: Path) -> list[list[dict[str, Any]]]:
    """The model state dicts as [tensor-parallel rank][pipeline stage]."""
    import torch

    found = {}
    for path in policy_dir.glob("model_tp*_pp*.pt"):
        match = _SHARD.search(path.name)
        if match:
            found[(int(match[1]), int(match[2]))] = path
    if not found:
        raise UserInputError(f"{policy_dir}: no model_tp<t>_pp<p>.pt files; not a checkpoint")
    tp = 1 + max(t for t, _ in found)
    pp = 1 + max(p for _, p in found)
    missing = [f"model_tp{t}_pp{p}.pt" for t in range(tp) for p in range(pp) if (t, p) not in found]
    if missing:
        raise UserInputError(f"{policy_dir}: incomplete checkpoint, missing {', '.join(missing)}")
    shards = []
    for t in range(tp):
        stages = []
        for p in range(pp):
            try:
                state = torch.load(found[(t, p)], map_location="cpu", weights_only=False)
            except Exception as exc:  # a truncated or foreign file
                raise UserInputError(f"{found[(t, p)]}: not readable ({exc})") from exc
            stages.append({k: v for k, v in state["model"].items() if "_extra_state" not in k})
        shards.append(stages)
    return shards


def export(
    config_path: str,
    overrides: list[str],
    *,
    checkpoint: str,
    out: str,
    model_type: str | None = None,
) -> list[str]:
    """Write the checkpoint (a step directory, or a checkpoint_dir: its latest step) as a
    Hugging Face directory ``out``; returns the files written."""
    from nemo_rl_offload.models.hf_checkpoint import merge_pipeline_stages, write_hf_checkpoint
    from nemo_rl_offload.models.hf_convert import hf_config_for, megatron_to_hf

    if model_type is not None and model_type not in MODEL_TYPES:
        raise UserInputError(f"--model-type: '{model_type}' is not one of {', '.join(MODEL_TYPES)}")
    report = load_and_check(config_path, overrides)
    if report.errors:
        raise UserInputError(report.errors)
    policy = report.recipe["policy"]
    architecture = architecture_for(policy["model_name"], base_dir=Path.cwd())
    step_dir = resolve_checkpoint(checkpoint, "--checkpoint")
    shards = [merge_pipeline_stages(stages) for stages in _read_shards(step_dir / "policy")]
    keys = shards[0].keys()
    grouped = any(".experts.linear_fc1.weight" in key for key in keys)
    fused = any(key.endswith("linear_qkv.layer_norm_weight") for key in keys)
    model_type = model_type or default_model_type(architecture)
    try:
        state = megatron_to_hf(
            shards,
            architecture,
            grouped_experts=grouped,
            fused_layernorm=fused,
            model_type=model_type,
        )
    except UserInputError as exc:
        raise UserInputError([f"{step_dir}: {line}" for line in exc.problems]) from exc
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config = hf_config_for(architecture, model_type, torch_dtype=dtype)
    tokenizer = (policy.get("tokenizer") or {}).get("name")
    tokenizer_from = architecture.hf_directory or (
        tokenizer if tokenizer and Path(tokenizer).expanduser().is_dir() else None
    )
    if tokenizer_from is None:
        print(
            "note: the policy uses the built-in byte tokenizer, which transformers cannot load: "
            "no tokenizer files written",
            file=sys.stderr,
        )
    return write_hf_checkpoint(state, config, out, tokenizer_from=tokenizer_from)
