"""``nemo-rl-offload export-hf``: a training checkpoint as a Hugging Face model directory.

The checkpoint holds the weights but not the architecture, so the recipe that trained it is
read too. A checkpoint of the current format (megatron dist_checkpointing, ``policy/`` with
``layout.json``) is read through a model built here, on one CPU rank with tensor and pipeline
parallel size 1 and the local layer spec: dist_checkpointing reshards its whole-model tensors
from whatever layout the run used, and its storage names are those of Transformer Engine's
spec whichever spec trained it, so the model's own state dict comes out as one unsharded
state dict. A checkpoint of the first format (one file per model-parallel shard,
``policy/model_tp<t>_pp<p>.pt``) is read file by file, the stages of each tensor-parallel rank
joined. Either way the weights are converted to Hugging Face names and layouts
(``models.hf_convert``), and written with config.json and the tokenizer files of the model's
directory, if it came from one.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.megatron_settings import SINGLE_RANK_LAYOUT
from nemo_rl_offload.config.model_presets import HF_MODEL_TYPES as MODEL_TYPES
from nemo_rl_offload.config.model_presets import Architecture, hf_config, section_architecture
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy.checkpoint import is_legacy, read_legacy_shard, read_saved
from nemo_rl_offload.policy.checkpoint_dirs import resolve_checkpoint
from nemo_rl_offload.preflight import load_and_check

_SHARD = re.compile(r"model_tp(\d+)_pp(\d+)\.pt$")


def default_model_type(architecture: Architecture) -> str:
    """The source directory's model_type when it is one we write, else the closest family."""
    if architecture.hf_directory:
        source = hf_config(architecture.hf_directory, architecture.hf_overrides)
        if source.get("model_type") in MODEL_TYPES:
            return str(source["model_type"])
    t = architecture.transformer
    if t.get("num_moe_experts"):
        return "qwen3_moe" if t.get("qk_layernorm") else "mixtral"
    if t.get("qk_layernorm"):
        return "qwen3"
    return "qwen2" if t.get("add_qkv_bias") else "llama"


def export_config(architecture: Architecture, model_type: str, *, torch_dtype: str) -> dict:
    """The exported config.json. The recipe's hf_config_overrides describe the trained model:
    those the mapping read are in the architecture already, the rest are written as given."""
    from nemo_rl_offload.models.hf_convert import hf_config_for

    config = hf_config_for(architecture, model_type, torch_dtype=torch_dtype)
    return {**config, **architecture.hf_overrides}


def _read_shards(policy_dir: Path) -> list[list[dict[str, Any]]]:
    """A first-format checkpoint's model state dicts as [tensor-parallel rank][pipeline
    stage]."""
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
            state = read_legacy_shard(found[(t, p)])
            stages.append({k: v for k, v in state["model"].items() if "_extra_state" not in k})
        shards.append(stages)
    return shards


# The model that reads a checkpoint for export: one CPU rank, no parallelism, the local spec.
_EXPORT_LAYOUT = {
    **SINGLE_RANK_LAYOUT,
    "fine_grained_activation_offloading": False,
    "offload_modules": None,
}


def _read_dist_checkpoint(
    policy_dir: Path, policy: dict[str, Any], architecture: Architecture
) -> dict[str, Any]:
    """The whole model's weights (one unsharded state dict) of a current-format checkpoint."""
    import torch

    from nemo_rl_offload.config import megatron_settings
    from nemo_rl_offload.models.builder import build_gpt_model
    from nemo_rl_offload.models.lora import merged_state_dict
    from nemo_rl_offload.models.parallel import single_rank_megatron
    from nemo_rl_offload.policy import checkpoint

    saved = read_saved(policy_dir)  # one line if it is not a checkpoint
    section = copy.deepcopy(policy)
    section["megatron_cfg"] = {**(section.get("megatron_cfg") or {}), **_EXPORT_LAYOUT}
    if torch.distributed.is_initialized():
        raise RuntimeError("export-hf reads a checkpoint in a process of its own")
    with single_rank_megatron(seed=0):
        effective = megatron_settings.effective_settings(section, architecture, te_installed=False)
        model, _ = build_gpt_model(effective, architecture, on_gpu=False)
        if saved.quant_cfg is not None:
            _quantized_as_saved(model, policy, saved.quant_cfg, policy_dir)
        checkpoint.load(
            policy_dir,
            model=model,
            optimizer=None,
            scheduler=None,
            distributed_optimizer=False,
            on_gpu=False,
            weights_only=True,
        )
        # LoRA adapters are folded into their linears' weights (W + alpha/dim * B A).
        state = merged_state_dict(model) if effective.lora is not None else model.state_dict()
        # A quantization-aware policy exports its trained weights; its quantizers' state
        # (their ranges) stays in the checkpoint.
        return {
            k: v for k, v in state.items() if "_extra_state" not in k and "_quantizer." not in k
        }


def _quantized_as_saved(model: Any, policy: dict[str, Any], saved: str, policy_dir: Path) -> None:
    """Give ``model`` the quantizers of the run that wrote ``policy_dir`` (its entries are
    ModelOpt's layout), with the recipe's ``policy.quant_cfg``; the checkpoint holds their
    ranges."""
    from nemo_rl_offload.models import quantization

    value = policy.get("quant_cfg")
    if not value:
        raise UserInputError(
            f"{policy_dir}: written by a quantization-aware run (policy.quant_cfg: {saved}); "
            f"give the recipe that trained it, or add ++policy.quant_cfg={saved}"
        )
    import torch

    config = quantization.resolve(value, [Path.cwd()])
    # Any tokens calibrate: the checkpoint's ranges replace what they give.
    placeholder = [torch.ones(1, 8, dtype=torch.long)]
    quantization.quantize(
        model, config, placeholder, on_gpu=False, pipeline_or_context_parallel=False
    )


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
    from nemo_rl_offload.models.hf_checkpoint import (
        MTP_PREFIX,
        merge_pipeline_stages,
        write_hf_checkpoint,
    )
    from nemo_rl_offload.models.hf_convert import megatron_to_hf

    if model_type is not None and model_type not in MODEL_TYPES:
        raise UserInputError(f"--model-type: '{model_type}' is not one of {', '.join(MODEL_TYPES)}")
    report = load_and_check(config_path, overrides)
    if report.errors:
        raise UserInputError(report.errors)
    policy = report.recipe["policy"]
    architecture = section_architecture(policy, base_dir=Path.cwd())
    step_dir = resolve_checkpoint(checkpoint, "--checkpoint")
    policy_dir = step_dir / "policy"
    if is_legacy(policy_dir):
        shards = [merge_pipeline_stages(stages) for stages in _read_shards(policy_dir)]
    else:
        shards = [_read_dist_checkpoint(policy_dir, policy, architecture)]
    if any(key.startswith(MTP_PREFIX) for key in shards[0]):
        shards = [
            {k: v for k, v in shard.items() if not k.startswith(MTP_PREFIX)} for shard in shards
        ]
        print(
            "note: the multi-token prediction block (policy.megatron_cfg.mtp_num_layers) has no "
            "place in a Hugging Face checkpoint of this model type: left out of the export "
            "(the checkpoint keeps it)",
            file=sys.stderr,
        )
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
    config = export_config(architecture, model_type, torch_dtype=dtype)
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
