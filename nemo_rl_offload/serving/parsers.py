"""Response parsers megatron-core lacks, in its parser interface: vLLM's ``hermes`` tool
calls and ``qwen3`` reasoning, which NeMo-RL's vLLM recipes name in
``vllm_cfg.http_server_serving_chat_kwargs``.

megatron-core's endpoints look parsers up by name in its ``PARSER_MAPPING`` registry;
:func:`register` adds these under names megatron-core does not use (it never replaces one of
its own: a name it gains later is refused loudly, so its parser is never shadowed). vLLM's
names map to megatron-core's where megatron-core has the same parser (:data:`VLLM_EQUIVALENTS`).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

__all__ = ["OWN_PARSERS", "HermesToolParser", "Qwen3ReasoningParser", "register"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)


class HermesToolParser:
    """vLLM's ``hermes`` tool-call format: JSON objects ``{"name": ..., "arguments": ...}``
    inside ``<tool_call>`` tags (Qwen 2.5/3 and Hermes chat templates write it). The content
    is the text before the first tag. As vLLM does, text whose calls are not all valid JSON
    objects with a name is returned whole as content with no tool calls (the call was not
    made: NeMo-RL's invalid-tool-call penalty looks for the tags in the content)."""

    @staticmethod
    def parse(text: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        if "<tool_call>" not in text:
            return text, {}
        calls = []
        for closed, open_ended in _TOOL_CALL.findall(text):
            try:
                call = json.loads((closed or open_ended).strip())
            except ValueError:
                return text, {}
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, {}
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": json.dumps(arguments, ensure_ascii=False),
                    },
                }
            )
        return text[: text.index("<tool_call>")], {"tool_calls": calls}


class Qwen3ReasoningParser:
    """vLLM's ``qwen3`` reasoning: text up to ``</think>`` (after any ``<think>``) is the
    reasoning and the rest the content. Unlike DeepSeek-R1's parser, an output without
    ``</think>`` is all content (Qwen3 with thinking off writes no tags)."""

    @staticmethod
    def parse(text: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        _, opened, after = text.partition("<think>")
        remaining = after if opened else text
        if "</think>" not in remaining:
            return text, {}
        reasoning, _, content = remaining.partition("</think>")
        return content, ({"reasoning": reasoning} if reasoning else {})


# This backend's parsers under config.http_server's names (megatron-core does not use them).
OWN_PARSERS: dict[str, type] = {
    "hermes-tool": HermesToolParser,
    "qwen3-reasoning": Qwen3ReasoningParser,
}


def register() -> None:
    """Add :data:`OWN_PARSERS` to megatron-core's registry (idempotent)."""
    from megatron.core.tokenizers.text.parsers import PARSER_MAPPING

    for name, parser in OWN_PARSERS.items():
        present = PARSER_MAPPING.get(name)
        if present is None:
            PARSER_MAPPING[name] = parser
        elif present is not parser:
            raise RuntimeError(
                f"megatron-core now defines a response parser named {name!r}; this backend's "
                "own parser of that name would shadow it: rename this backend's"
            )
