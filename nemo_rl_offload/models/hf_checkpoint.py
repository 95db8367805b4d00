"""Hugging Face checkpoint directories on disk: read their weights into the policy's Megatron
model, and write Megatron weights back as one.

The tensor layouts (fused QKV, gate/up, tensor-parallel shards) are ``hf_convert``'s job; this
module finds and checks the files, picks this rank's part (its tensor-parallel shard and its
pipeline stage's layers), and writes directories atomically. Only safetensors checkpoints are
read (pickle-based ``pytorch_model.bin`` files can run code when loaded).

Every problem with a directory is one line that names the file: a missing or unreadable shard,
a tensor the index promises but the shard lacks, a tensor whose shape disagrees with
config.json (the converter's check, prefixed with the directory).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.model_presets import Architecture
from nemo_rl_offload.errors import UserInputError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
MAX_SHARD_BYTES = 5 * 2**30


def _load_safetensors(path: Path, *, meta: bool) -> dict[str, Any]:
    """The file's tensors; with ``meta``, only their names and shapes (as tensors on the meta
    device, read from the header without loading the data)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        if not meta:
            return load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            return {
                name: torch.empty(handle.get_slice(name).get_shape(), device="meta")
                for name in handle.keys()  # noqa: SIM118 (safe_open is not a mapping)
            }
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise UserInputError(f"{path}: not a readable safetensors file ({exc})") from exc


def check_hf_directory(architecture: Architecture) -> None:
    """Before any worker starts: the directory's weight files exist and are readable, and
    their tensors' names and shapes fit config.json (checked on headers only, no data read)."""
    from nemo_rl_offload.models.hf_convert import hf_to_megatron

    directory = Path(architecture.hf_directory or "")
    try:
        hf_to_megatron(read_hf_weights(directory, meta=True), architecture)
    except UserInputError as exc:
        if all(line.startswith(str(directory)) for line in exc.problems):
            raise
        raise UserInputError([f"{directory}: {line}" for line in exc.problems]) from exc


def read_hf_weights(directory: str | Path, *, meta: bool = False) -> dict[str, Any]:
    """Every tensor of the checkpoint in ``directory`` (one file, or shards with an index);
    with ``meta``, their names and shapes only."""
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserInputError(
                f"{index_path}: not a safetensors index (needs a 'weight_map': {exc})"
            ) from exc
        state: dict[str, Any] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = directory / shard
            if not shard_path.is_file():
                count = sum(1 for name in weight_map.values() if name == shard)
                raise UserInputError(
                    f"{shard_path}: missing; {INDEX_FILE} lists it for {count} tensors"
                )
            state.update(_load_safetensors(shard_path, meta=meta))
        promised = [name for name, shard in weight_map.items() if name not in state]
        if promised:
            raise UserInputError(
                f"{directory / weight_map[promised[0]]}: lacks {promised[0]}, which "
                f"{INDEX_FILE} places there ({len(promised)} such tensors)"
            )
        return state
    single = directory / SINGLE_FILE
    if single.is_file():
        return _load_safetensors(single, meta=meta)
    if any(directory.glob("pytorch_model*.bin")):
        raise UserInputError(
            f"{directory}: holds pytorch_model*.bin weights; only safetensors checkpoints are "
            "read (re-save with transformers' save_pretrained, which writes safetensors)"
        )
    raise UserInputError(
        f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}; the directory holds no weights (set "
        "policy.init_checkpoint, or save the model with save_pretrained)"
    )


def _layer_layout(config: Any) -> tuple[bool, bool]:
    """(grouped experts, Transformer Engine's fused layernorm naming) of a built model."""
    return bool(config.num_moe_experts and config.moe_grouped_gemm), (
        config.transformer_impl == "transformer_engine"
    )


def load_into_model(model: Any, architecture: Architecture) -> None:
    """Load ``architecture.hf_directory``'s weights into ``model`` (this rank's GPTModel,
    unwrapped): its tensor-parallel shard, its pipeline stage's layers."""
    from megatron.core import parallel_state

    from nemo_rl_offload.models.hf_convert import hf_to_megatron
    from nemo_rl_offload.models.lora import is_adapter_key

    directory = Path(architecture.hf_directory or "")
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        raise UserInputError(
            f"{directory}: loading Hugging Face weights with expert_model_parallel_size > 1 is "
            "not supported yet; use expert parallel size 1 (tensor and pipeline parallelism "
            "work), or convert once and start from policy.init_checkpoint"
        )
    grouped, fused = _layer_layout(model.config)
    try:
        converted = hf_to_megatron(
            read_hf_weights(directory),
            architecture,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            grouped_experts=grouped,
            fused_layernorm=fused,
        )
    except UserInputError as exc:
        raise UserInputError([f"{directory}: {line}" for line in exc.problems]) from exc
    own = model.state_dict()
    offsets = {local: layer.layer_number - 1 for local, layer in enumerate(model.decoder.layers)}
    state = {}
    for key, current in own.items():
        if key.endswith("_extra_state") or is_adapter_key(key) or key.startswith(MTP_PREFIX):
            # LoRA adapters and the multi-token prediction block (none of the Hugging Face
            # formats read here has one) start from their initialisation.
            state[key] = current
            continue
        source = _global_key(key, offsets)
        if source not in converted and key == "output_layer.weight":
            source = "embedding.word_embeddings.weight"  # tied: the last stage's copy
        if source not in converted:
            raise UserInputError(
                f"{directory}: the checkpoint gives no weights for {key} (layout mismatch "
                "between config.json and the weights)"
            )
        tensor = converted[source]
        if tuple(tensor.shape) != tuple(current.shape):
            raise UserInputError(
                f"{directory}: {source} has shape {list(tensor.shape)} after conversion, the "
                f"model expects {list(current.shape)}"
            )
        state[key] = tensor.to(dtype=current.dtype)
    model.load_state_dict(state, strict=True)


_LAYERS = "decoder.layers."
# The multi-token prediction block's keys (policy.megatron_cfg.mtp_num_layers).
MTP_PREFIX = "mtp."


def _layer_number(key: str) -> int | None:
    """The layer index in a ``decoder.layers.<n>...`` key, None for other keys."""
    return int(key[len(_LAYERS) :].split(".", 1)[0]) if key.startswith(_LAYERS) else None


def _renumbered(key: str, number: int) -> str:
    """``key`` (a ``decoder.layers.<n>...`` key) with layer index ``number``."""
    return f"{_LAYERS}{number}.{key[len(_LAYERS) :].split('.', 1)[1]}"


def _global_key(key: str, offsets: Mapping[int, int]) -> str:
    """``decoder.layers.<local>...`` of this pipeline stage -> the whole model's layer index."""
    local = _layer_number(key)
    return key if local is None else _renumbered(key, offsets[local])


def merge_pipeline_stages(stages: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One tensor-parallel rank's state dicts of every pipeline stage (in stage order) as one
    state dict with the whole model's layer numbers."""
    merged: dict[str, Any] = {}
    offset = 0
    for stage in stages:
        numbers = {_layer_number(key) for key in stage} - {None}
        for key, tensor in stage.items():
            local = _layer_number(key)
            merged.setdefault(key if local is None else _renumbered(key, local + offset), tensor)
        offset += len(numbers)
    return merged


def write_hf_checkpoint(
    state: Mapping[str, Any],
    config: Mapping[str, Any],
    out_dir: str | Path,
    *,
    tokenizer_from: str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``state`` (HF names) as safetensors, ``config`` as config.json, and the tokenizer
    files found in ``tokenizer_from``, into the new directory ``out_dir``; returns the file
    names. Everything is written to a temporary directory first and renamed at the end, so a
    failure leaves nothing half-written; an existing non-empty ``out_dir`` is refused."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"--out: {out} exists and is not empty; give a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shards: list[dict[str, Any]] = [{}]
        size = 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.contiguous()
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for number, shard in enumerate(shards, start=1):
                name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({tensor_name: name for tensor_name in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            (tmp / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        (tmp / "config.json").write_text(json.dumps(dict(config), indent=2))
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                source = Path(tokenizer_from) / name
                if source.is_file():
                    shutil.copy2(source, tmp / name)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(p.name for p in out.iterdir())
