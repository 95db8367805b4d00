"""The policy section's tokenizer, checked against its model before any worker starts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.model_presets import section_architecture
from nemo_rl_offload.config.tokenizer_settings import TokenizerSettings
from nemo_rl_offload.data.tokenizer import Tokenizer, load_tokenizer
from nemo_rl_offload.errors import UserInputError


def policy_tokenizer(
    policy: Mapping[str, Any], settings: TokenizerSettings | None = None
) -> Tokenizer:
    """The policy section's tokenizer, checked against its model (and the model's Hugging Face
    directory checked, so that a bad one fails here rather than in the workers).

    ``settings`` (:func:`~nemo_rl_offload.config.tokenizer_settings.tokenizer_settings` of the
    section) sets its chat template and the template's keyword arguments; without them the
    tokenizer keeps its own template and no defaults."""
    architecture = section_architecture(policy, base_dir=Path.cwd())
    if settings is None:
        tokenizer_cfg = policy.get("tokenizer") or {}
        settings = TokenizerSettings(name=tokenizer_cfg.get("name"))
    tokenizer = load_tokenizer(
        settings.name,
        architecture.hf_directory,
        policy.get("model_name"),
        chat_template=settings.chat_template,
        chat_template_kwargs=settings.chat_template_kwargs,
    )
    if tokenizer.vocab_size > architecture.vocab_size:
        raise UserInputError(
            f"policy.tokenizer.name: the tokenizer has {tokenizer.vocab_size} tokens but "
            f"{policy['model_name']} only {architecture.vocab_size}; use the model's tokenizer"
        )
    if architecture.hf_directory and not policy.get("init_checkpoint"):
        from nemo_rl_offload.models.hf_checkpoint import check_hf_directory

        check_hf_directory(architecture)
    return tokenizer
