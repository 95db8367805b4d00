"""``<section>.generation``, read once: what the sampler samples and how it runs.

The one reader of the generation keys (``max_new_tokens``, ``temperature``, ``top_p``,
``top_k``, ``stop_token_ids`` and ``mcore_generation_config``'s engine keys): the algorithms,
the sampler, the server and the memory estimate take these objects, never the recipe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingSettings:
    """One sampler call's settings: the section's, plus what the caller knows (the stop token of
    its tokenizer, greedy or not, the room its prompts leave)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Sample only ids the tokenizer knows (a model's embedding table may be larger).
    vocab_limit: int | None = None


@dataclass(frozen=True)
class EngineSettings:
    """How the sampler runs (not what it samples), from ``mcore_generation_config`` (NeMo-RL's
    key names; docs/generation.md)."""

    cuda_graphs: bool = False
    num_cuda_graphs: int = 4
    # The KV cache of one call may not exceed this (NeMo-RL: the KV cache buffer's size).
    buffer_size_gb: float | None = None


@dataclass(frozen=True)
class GenerationSettings:
    """A policy section's ``generation`` keys. ``max_new_tokens`` None: each call may fill what
    its longest prompt leaves of ``max_total_sequence_length`` (NeMo-RL's default)."""

    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    engine: EngineSettings = EngineSettings()
    # NeMo-Gym validation rollouts' sampling (val_temperature, val_top_p; unset: the above).
    val_temperature: float | None = None
    val_top_p: float | None = None

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> GenerationSettings:
        """From a policy (or teacher) section, whose keys the schema checked."""
        generation = section.get("generation") or {}
        mcore = generation.get("mcore_generation_config") or {}
        graphs = int(mcore.get("num_cuda_graphs") or 0)
        size = mcore.get("buffer_size_gb")
        limit = generation.get("max_new_tokens")
        return cls(
            max_new_tokens=int(limit) if limit is not None else None,
            temperature=float(generation.get("temperature", 1.0)),
            top_p=float(generation.get("top_p", 1.0)),
            top_k=generation.get("top_k"),
            stop_token_ids=tuple(generation.get("stop_token_ids") or ()),
            val_temperature=_optional_float(generation.get("val_temperature")),
            val_top_p=_optional_float(generation.get("val_top_p")),
            engine=EngineSettings(
                cuda_graphs=mcore.get("cuda_graph_impl") not in (None, "none") and graphs > 0,
                num_cuda_graphs=max(graphs, 1),
                buffer_size_gb=float(size) if size is not None else None,
            ),
        )

    def new_tokens(self, longest_prompt: int, max_total_length: int) -> int:
        """New tokens a call may sample after prompts of up to ``longest_prompt`` tokens: the
        section's limit, within what ``max_total_length`` leaves (<= 0: no room)."""
        room = max_total_length - longest_prompt
        return room if self.max_new_tokens is None else min(self.max_new_tokens, room)

    def sampling(
        self,
        *,
        max_new_tokens: int,
        eos_id: int | None,
        greedy: bool = False,
        vocab_limit: int | None = None,
    ) -> SamplingSettings:
        """A call's settings: the section's stops plus ``eos_id`` (when given)."""
        stops = self.stop_token_ids + ((eos_id,) if eos_id is not None else ())
        return SamplingSettings(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            greedy=greedy,
            stop_token_ids=stops,
            vocab_limit=vocab_limit,
        )


def _optional_float(value: Any) -> float | None:
    return float(value) if value else None
