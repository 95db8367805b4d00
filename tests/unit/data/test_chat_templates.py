"""Chat templates on both tokenizers: the byte tokenizer's Jinja template keeps its layout and
agrees with its Hugging Face twin; text-then-encode equals the id path; the recipe's template
and its keyword arguments apply as NeMo-RL applies them."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.chat_tokenizers import build, save

from nemo_rl_offload.config.tokenizer_settings import PASSTHROUGH_CHAT_TEMPLATE
from nemo_rl_offload.data.tokenizer import (
    BYTE_CHAT_TEMPLATE,
    ByteTokenizer,
    ChatTokenizer,
    HFTokenizer,
    load_tokenizer,
)

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo <eos> 数学"},
        {"role": "assistant", "content": "It is 4."},
    ],
    [
        {"role": "user", "content": "Add 2 and 2."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "add", "arguments": '{"a": "é"}'}}, {"id": "x"}],
        },
        {"role": "tool", "content": "4"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "<adds> & 'é'"}}]


def test_the_byte_layout_is_the_one_its_comment_describes() -> None:
    tok = ByteTokenizer()
    text = tok.apply_chat_template(CHATS[2], tools=TOOLS, tokenize=False)
    assert text == (
        '<|tools|>\n[{"function": {"description": "<adds> & \'\\u00e9\'", "name": "add"}, '
        '"type": "function"}]\n'
        "<|user|>\nAdd 2 and 2.\n"
        '<|assistant|>\n<tool_call>{"arguments": "{\\"a\\": \\"\\u00e9\\"}", "name": "add"}'
        "</tool_call><tool_call>null</tool_call><eos>"
        "<|tool|>\n4\n"
        "<|assistant|>\n"
    )
    ids = tok.apply_chat_template(CHATS[2], tools=TOOLS)
    assert ids[-len("<|assistant|>\n") :] == list(b"<|assistant|>\n")
    assert ids.count(tok.eos_id) == 1
    assert isinstance(tok, ChatTokenizer) and tok.chat_template == BYTE_CHAT_TEMPLATE


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_byte_text_then_encode_is_the_id_path_and_its_hugging_face_twin(
    chat, generation_prompt: bool, tools
) -> None:
    tok, twin = ByteTokenizer(), build("byte")
    kwargs = {"tools": tools, "add_generation_prompt": generation_prompt}
    text = tok.apply_chat_template(chat, tokenize=False, **kwargs)
    ids = tok.apply_chat_template(chat, **kwargs)
    assert tok.encode(text) == ids
    assert twin.apply_chat_template(chat, tokenize=False, **kwargs) == text
    assert list(twin.apply_chat_template(chat, tokenize=True, **kwargs)["input_ids"]) == ids


def test_byte_specials_in_text_encode_as_their_ids() -> None:
    tok = ByteTokenizer()
    assert tok.encode("a<eos>b<bos><pad>") == [97, 258, 98, 257, 256]
    assert tok.encode("<eo s>") == list(b"<eo s>")
    assert tok.encode("x", add_special_tokens=True) == [120]  # it adds none of its own
    ids = [257, 104, 105, 258]
    assert tok.encode(tok.decode(ids, skip_special=False)) == ids
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")


def test_byte_templates_and_their_keyword_arguments() -> None:
    chat = CHATS[1]
    passthrough = ByteTokenizer(chat_template=PASSTHROUGH_CHAT_TEMPLATE)
    assert passthrough.apply_chat_template(chat, tokenize=False) == (
        "Be brief.héllo <eos> 数学It is 4."
    )
    template = "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    tok = ByteTokenizer(chat_template=template, chat_template_kwargs={"greeting": "hi"})
    assert tok.apply_chat_template(chat[:1], tokenize=False) == "hi|Be brief."
    # a call's own arguments win over the recipe's defaults
    assert tok.apply_chat_template(chat[:1], tokenize=False, greeting="yo") == "yo|Be brief."
    # a call's chat_template replaces the tokenizer's for that call only
    once = tok.apply_chat_template(chat[:1], tokenize=False, chat_template="{{ bos_token }}")
    assert once == "<bos>" and tok.chat_template == template
    # a variable named like a special token replaces it, as in Hugging Face's rendering
    renamed = tok.apply_chat_template(
        chat[:1], tokenize=False, chat_template="{{ bos_token }}", bos_token="[B]"
    )
    assert renamed == "[B]"


def test_the_generation_tag_renders_its_body() -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    assert (
        ByteTokenizer(chat_template=template).apply_chat_template(CHATS[0], tokenize=False)
        == "What is 2+2?"
    )


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save("qwen", tmp_path_factory.mktemp("qwen"))


def test_hugging_face_text_then_encode_is_the_id_path(qwen_dir: Path) -> None:
    tok = HFTokenizer(str(qwen_dir))
    assert isinstance(tok, ChatTokenizer)
    for chat in CHATS[:2]:
        text = tok.apply_chat_template(chat, tokenize=False, tools=TOOLS)
        assert isinstance(text, str) and text.startswith("<|im_start|>system\n")
        assert tok.encode(text) == tok.apply_chat_template(chat, tools=TOOLS)
    assert (tok.bos_token, tok.eos_token) == (None, "<|im_end|>")


def test_hugging_face_template_kwargs_are_defaults_a_call_overrides(qwen_dir: Path) -> None:
    plain = HFTokenizer(str(qwen_dir))
    off = HFTokenizer(str(qwen_dir), chat_template_kwargs={"enable_thinking": False})
    think = "<think>\n\n</think>\n\n"
    assert not plain.apply_chat_template(CHATS[0], tokenize=False).endswith(think)
    assert off.apply_chat_template(CHATS[0], tokenize=False).endswith(think)
    on = off.apply_chat_template(CHATS[0], tokenize=False, enable_thinking=True)
    assert not on.endswith(think)


def test_the_recipes_template_replaces_the_directorys(qwen_dir: Path) -> None:
    tok = HFTokenizer(str(qwen_dir), chat_template=PASSTHROUGH_CHAT_TEMPLATE)
    assert tok.chat_template == PASSTHROUGH_CHAT_TEMPLATE
    assert tok.apply_chat_template(CHATS[1], tokenize=False) == "Be brief.héllo <eos> 数学It is 4."
    assert HFTokenizer(str(qwen_dir)).chat_template == build("qwen").chat_template


def test_load_tokenizer_passes_the_template_settings(qwen_dir: Path) -> None:
    settings = {"chat_template": "{{ x }}", "chat_template_kwargs": {"x": "y"}}
    byte = load_tokenizer(None, None, **settings)
    assert byte.apply_chat_template(CHATS[0], tokenize=False) == "y"
    hf = load_tokenizer(None, str(qwen_dir), **settings)
    assert hf.apply_chat_template(CHATS[0], tokenize=False) == "y"
    assert load_tokenizer(None, None).chat_template == BYTE_CHAT_TEMPLATE


def test_policy_tokenizer_applies_resolved_settings_only_when_given() -> None:
    from nemo_rl_offload.config.tokenizer_settings import tokenizer_settings
    from nemo_rl_offload.policy.tokenizer import policy_tokenizer

    policy = {"model_name": "tiny-dense", "tokenizer": {"chat_template": None}}
    assert policy_tokenizer(policy).chat_template == BYTE_CHAT_TEMPLATE
    resolved = policy_tokenizer(policy, tokenizer_settings(policy))
    assert resolved.chat_template == PASSTHROUGH_CHAT_TEMPLATE
