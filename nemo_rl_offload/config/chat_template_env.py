"""The Jinja environment chat templates run in, as Hugging Face's ``apply_chat_template`` sets it.

One environment for checking a recipe's template (when the recipe is resolved) and for rendering
chats with tokenizers that are not Hugging Face ones (the byte tokenizer): sandboxed, blocks
trimmed, ``loopcontrols``, a ``tojson`` filter that does not escape HTML (with transformers'
arguments), ``raise_exception`` and ``strftime_now``, and the ``{% generation %}`` tag rendering
its body. ``jinja2`` is imported only when a template is used.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from nemo_rl_offload.errors import UserInputError

__all__ = ["check_template_syntax", "compiled_template"]


@lru_cache(maxsize=1)
def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserInputError(
            "chat templates need the jinja2 package (a dependency of transformers); "
            "pip install jinja2"
        ) from None

    class GenerationTag(jinja2.ext.Extension):
        """Transformers' ``{% generation %}`` (marks assistant text); here it renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@lru_cache(maxsize=32)
def compiled_template(text: str) -> Any:
    """``text`` compiled (cached: a run renders one or two templates many times)."""
    return _environment().from_string(text)


def check_template_syntax(text: str, key: str) -> None:
    """One line naming ``key`` when ``text`` is not a Jinja template (skipped without jinja2:
    rendering says what is missing)."""
    try:
        import jinja2
    except ImportError:
        return
    try:
        _environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise UserInputError(
            f"{key}: not a valid Jinja template (line {exc.lineno}: {exc.message}); fix the "
            "template, or use 'default' for the tokenizer's own"
        ) from None
