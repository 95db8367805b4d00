"""A section's ``tokenizer`` keys resolved once: which tokenizer, which chat template, and the
keyword arguments every chat-template call gets.

NeMo-RL's meanings (its ``get_tokenizer``): ``chat_template`` absent or ``"default"`` keeps the
tokenizer's own template; ``null`` is the passthrough template (the messages' contents joined,
nothing added); a value ending in ``.jinja`` names a template file (relative paths from the
working directory); anything else is the Jinja template itself. ``chat_template_kwargs``
(a mapping, or null for none) goes to every chat-template call; a call's own arguments win.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.chat_template_env import check_template_syntax
from nemo_rl_offload.errors import UserInputError

__all__ = ["PASSTHROUGH_CHAT_TEMPLATE", "TokenizerSettings", "tokenizer_settings"]

# NeMo-RL's COMMON_CHAT_TEMPLATES.passthrough_prompt_response: what chat_template: null means.
PASSTHROUGH_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass(frozen=True)
class TokenizerSettings:
    """``name``: ``policy.tokenizer.name`` as written (None: the model's own tokenizer).
    ``chat_template``: the Jinja text to render chats with, None for the tokenizer's own.
    ``chat_template_kwargs``: defaults for every chat-template call."""

    name: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def tokenizer_settings(
    section: Mapping[str, Any], where: str = "policy", base_dir: Path | None = None
) -> TokenizerSettings:
    """``section``'s ``tokenizer`` keys resolved (``where`` names the section in messages,
    ``base_dir`` is where relative template files are read from: the working directory)."""
    cfg = section.get("tokenizer") or {}
    if not isinstance(cfg, Mapping):
        raise UserInputError(f"{where}.tokenizer: must be a mapping (name, chat_template, ...)")
    name = cfg.get("name")
    if name is not None and not isinstance(name, str):
        raise UserInputError(f"{where}.tokenizer.name: must be a string or null, not {name!r}")
    template = (
        _chat_template(cfg["chat_template"], f"{where}.tokenizer.chat_template", base_dir)
        if "chat_template" in cfg
        else None
    )
    return TokenizerSettings(
        name=name,
        chat_template=template,
        chat_template_kwargs=_template_kwargs(
            cfg.get("chat_template_kwargs"), f"{where}.tokenizer.chat_template_kwargs"
        ),
    )


def _chat_template(value: Any, key: str, base_dir: Path | None) -> str | None:
    if value is None:
        return PASSTHROUGH_CHAT_TEMPLATE
    if not isinstance(value, str):
        raise UserInputError(
            f"{key}: must be a Jinja template, a .jinja file, 'default' or null, not {value!r}"
        )
    if value.lower() == "default":
        return None
    if value.endswith(".jinja"):
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UserInputError(
                f"{key}: cannot read the template file {path} ({exc.strerror or exc}); a value "
                "ending in .jinja names a file (relative to the working directory)"
            ) from None
        check_template_syntax(text, f"{key} ({path})")
        return text
    check_template_syntax(value, key)
    return value


def _template_kwargs(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UserInputError(
            f"{key}: must be a mapping of template variables (e.g. {{enable_thinking: false}}) "
            f"or null, not {value!r}"
        )
    bad = [str(k) for k in value if not isinstance(k, str)]
    if bad:
        raise UserInputError(f"{key}: variable names must be strings, not {', '.join(bad)}")
    return dict(value)
