"""Measure the activation ledger (:mod:`nemo_rl_offload.planning.ledger`) of a recipe: build one
layer of each kind of its model as the workers build it, on the CPU, and record what a training
forward saves at two lengths.

Why here: building the model is the models layer's job (:func:`models.builder.build_gpt_model`,
the precision wrapper, chunked log-probabilities); the ledger's data and its reading live in
the offload layer below, which cannot import this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.megatron_settings import EffectiveSettings
from nemo_rl_offload.config.model_shape import layer_kinds
from nemo_rl_offload.models.chunked_logprobs import chunk_settings, install
from nemo_rl_offload.models.parallel import single_rank_megatron
from nemo_rl_offload.planning.ledger import (
    DEFAULT_LENGTHS,
    MODEL,
    LayerKind,
    Ledger,
    entries,
    one_layer_settings,
    parallel_notes,
    tokens_per_microbatch,
)


def build_model(effective: EffectiveSettings, architecture: Any, section: dict[str, Any]) -> Any:
    """The model as a worker builds it (precision wrapper, chunked log-probabilities), on the
    CPU, with RMSNorms that keep what the GPU keeps
    (:mod:`nemo_rl_offload.offload.cuda_norms`)."""
    from nemo_rl_offload.models.builder import build_gpt_model
    from nemo_rl_offload.offload.cuda_norms import with_cuda_rms_norms

    model, _ = build_gpt_model(effective, architecture, on_gpu=False)
    with_cuda_rms_norms(model)  # the norms keep what CUDA's kernel keeps, not the CPU's copies
    chunk, chunked_output_layer = chunk_settings(section)
    install(model, chunk, chunked_output_layer=chunked_output_layer)
    if model.config.bf16 or model.config.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    return model.train()


def measure(model: Any, tokens: int, vocab: int) -> Any:
    """What a training forward of one sequence of ``tokens`` tokens saves (a Recorder)."""
    import torch

    from nemo_rl_offload.models.chunked_logprobs import forward_kwargs
    from nemo_rl_offload.offload.saved_tensors import saved_bytes

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=generator)
    positions = torch.arange(tokens).unsqueeze(0)
    # As training calls it: with the chunked output layer when the recipe has a chunk size.
    kwargs = forward_kwargs(model, has_labels=True)
    return saved_bytes(model, lambda: model(ids, positions, None, labels=ids, **kwargs).sum())


def build_ledger(
    section: dict[str, Any],
    *,
    where: str = "policy",
    base_dir: Path | None = None,
    lengths: tuple[int, int] = DEFAULT_LENGTHS,
) -> Ledger:
    """The ledger of a policy (or teacher) section: one layer of each kind measured on the CPU
    at ``lengths`` tokens, scaled to the section's tokens per micro-batch."""
    from nemo_rl_offload.config.model_presets import section_architecture

    architecture = section_architecture(section, where=where, base_dir=base_dir)
    effective = megatron_settings.effective_settings(
        section, architecture, where=where, te_installed=False
    )
    tokens, source = tokens_per_microbatch(section, where)
    seq = int(section.get("max_total_sequence_length") or tokens)
    chunked = chunk_settings(section)[1]  # the output layer in chunks: no logits kept
    kinds: list[LayerKind] = []
    with single_rank_megatron():
        for kind, layers, overrides in layer_kinds(effective):
            settings = one_layer_settings(effective, overrides)
            model = build_model(settings, architecture, section)
            short, long = (measure(model, n, architecture.vocab_size) for n in lengths)
            del model
            common = {"effective": settings, "seq": seq, "chunked": chunked}
            kinds.append(
                LayerKind(
                    kind, layers, entries(short, long, lengths, in_layer=True, kind=kind, **common)
                )
            )
            if not any(k.kind == MODEL for k in kinds):
                model_entries = entries(short, long, lengths, in_layer=False, kind=MODEL, **common)
                kinds.append(LayerKind(MODEL, 1, model_entries))
    kinds.sort(key=lambda k: k.kind == MODEL)
    dtype = str(section.get("precision") or "float32")
    return Ledger(
        architecture.name, dtype, tokens, source, tuple(lengths), kinds, parallel_notes(effective)
    )
