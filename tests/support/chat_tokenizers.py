"""Tiny local Hugging Face tokenizers with chat templates, for the processor and chat-template
tests and for producing their expected ids with NeMo-RL's own code (tests/data/processors).

All three are byte-level BPE over the 256 byte values (ids 0..255) with a few merges, so that
how a text is split into turns changes its ids:
- ``llama``: Llama-3-like specials and template (bos written by the template, a system header
  always, ``date_string`` from the template's kwargs, tools in the system header); encoding a
  text with the tokenizer's own specials adds the bos token, as Llama's does.
- ``qwen``: Qwen-like specials and template (no bos token, a default system message, tool turns
  as user turns, ``enable_thinking: false`` adding an empty think block to the generation
  prompt only).
- ``byte``: the byte tokenizer's vocabulary (no merges; <pad>, <bos>, <eos> at 256..258) with
  its template: the Hugging Face twin of nemo_rl_offload's ByteTokenizer.
"""

from __future__ import annotations

from pathlib import Path

LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system_message = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}"
    "{% else %}{% set system_message = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{% if date_string is defined %}{{ 'Today Date: ' + date_string + '\\n\\n' }}{% endif %}"
    "{% if tools %}{{ 'Tools: ' + tools | tojson + '\\n\\n' }}{% endif %}"
    "{{ system_message + '<|eot_id|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] or '') | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

QWEN_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content']"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>\\n' + call['function'] | tojson + '\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

# Merges that tie characters across the places where turns are split (``s`` + ``t`` joins "is"
# and "the" when a passthrough template abuts them), so ids depend on the split.
_MERGES = [
    ("s", "t"),
    ("Ċ", "Ċ"),
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "s"),
    ("Ġ", "is"),
    ("Ġ", "4"),
    ("a", "s"),
    ("as", "s"),
    ("ass", "is"),
    ("Ġ", "2"),
    ("+", "2"),
]

KINDS = ("llama", "qwen", "byte")


def _byte_chars() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # GPT-2's byte-to-character table, ordered by byte value.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {}
    extra = 0
    for value in range(256):
        if value in printable:
            table[value] = chr(value)
        else:
            table[value] = chr(256 + extra)
            extra += 1
    assert set(table.values()) == set(alphabet)
    return [table[value] for value in range(256)]


def build(kind: str):
    """The ``kind`` tokenizer (one of :data:`KINDS`) as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    vocab = {char: index for index, char in enumerate(chars)}
    merges = [] if kind == "byte" else _MERGES
    for left, right in merges:
        vocab[left + right] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    if kind == "llama":
        specials = [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ]
        core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        bos = core.token_to_id("<|begin_of_text|>")
        core.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)],
        )
        tokens = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        template = LLAMA_TEMPLATE
    elif kind == "qwen":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        tokens = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        template = QWEN_TEMPLATE
    elif kind == "byte":
        from nemo_rl_offload.data.tokenizer import BYTE_CHAT_TEMPLATE

        specials = ["<pad>", "<bos>", "<eos>"]
        core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        tokens = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
        template = BYTE_CHAT_TEMPLATE
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; one of {KINDS}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **tokens)
    tokenizer.chat_template = template
    return tokenizer


def save(kind: str, directory: str | Path) -> Path:
    """The ``kind`` tokenizer saved to ``directory`` (a local Hugging Face tokenizer dir)."""
    path = Path(directory)
    build(kind).save_pretrained(path)
    return path
