"""vLLM's hermes tool calls and qwen3 reasoning in megatron-core's parser interface, their
registration beside megatron-core's own, and the server-side chat template."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nemo_rl_offload.serving import parsers
from nemo_rl_offload.serving.parsers import HermesToolParser, Qwen3ReasoningParser

REPO = Path(__file__).resolve().parents[3]


def test_hermes_tool_calls_become_openai_tool_calls_and_the_text_before_them_content():
    text = (
        'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        '<tool_call>{"name": "log", "arguments": {}}</tool_call>'
    )
    content, info = HermesToolParser.parse(text)
    assert content == "Let me add."
    calls = info["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["add", "log"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>',  # not JSON
        '<tool_call>["add"]</tool_call>',  # not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ],
)
def test_text_without_valid_hermes_calls_stays_whole_content(text):
    assert HermesToolParser.parse(text) == (text, {})


def test_an_unterminated_hermes_call_is_still_a_call():
    content, info = HermesToolParser.parse('ok <tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content == "ok " and info["tool_calls"][0]["function"]["name"] == "f"


def test_qwen3_reasoning_splits_at_the_end_tag_and_without_it_is_all_content():
    assert Qwen3ReasoningParser.parse("<think>add them</think>5") == (
        "5",
        {"reasoning": "add them"},
    )
    assert Qwen3ReasoningParser.parse("add them</think>5") == ("5", {"reasoning": "add them"})
    assert Qwen3ReasoningParser.parse("just 5") == ("just 5", {})
    assert Qwen3ReasoningParser.parse("<think>still thinking") == ("<think>still thinking", {})


def test_registration_adds_beside_megatron_cores_parsers_and_never_shadows_one(monkeypatch):
    from megatron.core.tokenizers.text.parsers import PARSER_MAPPING

    before = dict(PARSER_MAPPING)
    monkeypatch.setattr(
        "megatron.core.tokenizers.text.parsers.PARSER_MAPPING", dict(before), raising=True
    )
    from megatron.core.tokenizers.text import parsers as mcore_parsers

    parsers.register()
    parsers.register()  # idempotent
    assert {k: v for k, v in mcore_parsers.PARSER_MAPPING.items() if k in before} == before
    assert mcore_parsers.PARSER_MAPPING["hermes-tool"] is HermesToolParser
    mcore_parsers.PARSER_MAPPING["qwen3-reasoning"] = object
    with pytest.raises(RuntimeError, match="now defines a response parser named 'qwen3-reasoning'"):
        parsers.register()


def test_the_recipe_rules_name_exactly_the_parsers_served():
    """config.http_server lists the names without importing megatron-core; here the list meets
    the two registries."""
    from megatron.core.tokenizers.text.parsers import PARSER_MAPPING

    from nemo_rl_offload.config import http_server

    assert set(http_server.MEGATRON_PARSERS) == set(PARSER_MAPPING) - set(parsers.OWN_PARSERS)
    assert set(http_server.OWN_PARSERS) == set(parsers.OWN_PARSERS)
    served = set(http_server.parser_names())
    vllm_names = http_server.VLLM_EQUIVALENTS.values()
    assert {name for kind in vllm_names for name in kind.values()} <= served


@pytest.fixture
def hf_tokenizer(tmp_path):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from make_hf_model import char_tokenizer
    finally:
        sys.path.remove(str(REPO / "examples"))
    char_tokenizer().save_pretrained(tmp_path)
    from nemo_rl_offload.data.tokenizer import HFTokenizer

    return HFTokenizer(str(tmp_path))


def test_the_servers_chat_template_and_its_defaults_render_chats(hf_tokenizer):
    from nemo_rl_offload.data.tokenizer import ByteTokenizer
    from nemo_rl_offload.errors import UserInputError
    from nemo_rl_offload.serving.http_server import ServingTokenizer

    template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[a]{% endif %}{% if thinking %}<t>{% endif %}"
    )
    serving = ServingTokenizer(
        hf_tokenizer, chat_template=template, template_defaults={"thinking": True}
    )
    messages = [{"role": "user", "content": "hi"}]
    assert serving.chat_template == template
    assert hf_tokenizer.decode(serving.apply_chat_template(messages)) == "[user]hi[a]<t>"
    # a request's chat_template_kwargs win over the server's defaults
    off = serving.apply_chat_template(messages, thinking=False)
    assert hf_tokenizer.decode(off) == "[user]hi[a]"
    with pytest.raises(UserInputError, match="needs a Hugging Face tokenizer"):
        ServingTokenizer(ByteTokenizer(), chat_template=template)
