"""Tokenizers: a byte-level one for the tiny presets and a wrapper for local Hugging Face ones.

The byte tokenizer needs no files and no extra packages, which is what lets the tiny presets
train anywhere (CPU included). Its 384-id vocabulary matches the presets' ``vocab_size``: 256
byte values, three specials, and unused ids up to 383 (a multiple of 128, padding the embedding).
A Hugging Face tokenizer is only loaded from a local directory (model hubs are never reached) and
``transformers`` is imported only then, so the package works without it.

Both render chats with a Jinja chat template, as NeMo-RL's processors call it
(``apply_chat_template(messages, tokenize=False, ...)`` then ``encode``, or ``tokenize=True``
for the ids at once; the two agree). The recipe's ``policy.tokenizer.chat_template`` replaces
the tokenizer's own template and ``chat_template_kwargs`` are every call's defaults
(:mod:`nemo_rl_offload.config.tokenizer_settings` resolves them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from nemo_rl_offload.config.chat_template_env import compiled_template
from nemo_rl_offload.config.model_presets import (
    ModelNotOnMachine,
    cached_snapshot,
    hf_cache_roots,
    is_hf_repo_id,
)
from nemo_rl_offload.errors import UserInputError

__all__ = ["ByteTokenizer", "ChatTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainers need from a tokenizer; both implementations below provide it."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """What NeMo-RL's processors need besides :class:`Tokenizer`: the specials' text and the
    chat template; both implementations below provide it."""

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str: ...

    def encode(
        self,
        text: str,
        add_bos: bool = False,
        add_eos: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> Any: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad (256), bos (257) and eos (258).

    As in a Hugging Face tokenizer, the specials' names in text (``<eos>``...) encode as their
    ids, so a rendered chat template encodes to the ids the template means. ``chat_template``
    replaces :data:`BYTE_CHAT_TEMPLATE`; ``chat_template_kwargs`` are every render's defaults.
    """

    NUM_BYTES = 256
    PAD_ID = 256
    BOS_ID = 257
    EOS_ID = 258
    VOCAB_SIZE = 384
    _SPECIAL_NAMES = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}
    _SPECIAL_IDS = {text: token for token, text in _SPECIAL_NAMES.items()}
    _SPECIAL_RE = re.compile("(" + "|".join(map(re.escape, _SPECIAL_IDS)) + ")")

    def __init__(
        self,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._template = chat_template
        self._template_kwargs = dict(chat_template_kwargs or {})

    @property
    def name(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def pad_id(self) -> int:
        return self.PAD_ID

    @property
    def bos_id(self) -> int:
        return self.BOS_ID

    @property
    def eos_id(self) -> int:
        return self.EOS_ID

    @property
    def bos_token(self) -> str:
        return self._SPECIAL_NAMES[self.BOS_ID]

    @property
    def eos_token(self) -> str:
        return self._SPECIAL_NAMES[self.EOS_ID]

    @property
    def pad_token(self) -> str:
        return self._SPECIAL_NAMES[self.PAD_ID]

    def encode(
        self,
        text: str,
        add_bos: bool = False,
        add_eos: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """``text``'s bytes, with ``<pad>``/``<bos>``/``<eos>`` as their ids. The tokenizer adds
        no specials of its own, so ``add_special_tokens`` (Hugging Face's default rule) adds
        nothing; ``add_bos``/``add_eos`` add them explicitly."""
        ids: list[int] = []
        for piece in self._SPECIAL_RE.split(text):
            special = self._SPECIAL_IDS.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids += piece.encode("utf-8")
        if add_bos:
            ids.insert(0, self.BOS_ID)
        if add_eos:
            ids.append(self.EOS_ID)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Bytes become text (invalid UTF-8, e.g. a sequence cut mid-character, is replaced with
        U+FFFD rather than failing); ids from 256 up are dropped, or shown as ``<eos>``-style
        names when ``skip_special`` is false."""
        parts: list[str] = []
        run = bytearray()
        for raw in ids:
            token = int(raw)
            if not 0 <= token < self.VOCAB_SIZE:
                raise ValueError(f"token id {token} is outside the byte vocabulary 0..383")
            if token < self.NUM_BYTES:
                run.append(token)
                continue
            if skip_special:
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            parts.append(self._SPECIAL_NAMES.get(token, f"<unused_{token}>"))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    @property
    def chat_template(self) -> str:
        return BYTE_CHAT_TEMPLATE if self._template is None else self._template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> Any:
        """``messages`` rendered by the chat template (``chat_template`` for this call only):
        the text with ``tokenize=False``, else its ids."""
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            **self._template_kwargs,
            **template_kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        text = compiled_template(chat_template or self.chat_template).render(variables)
        return self.encode(text) if tokenize else text


# What the tiny presets (which have no tokenizer files) render chats as: tools as JSON up front,
# then each message as ``<|role|>`` and a newline, its text and its tool calls as JSON in
# <tool_call> tags; an assistant turn ends with the end-of-sequence token (as a sampled turn
# does, so a conversation's earlier turns tokenize as they were sampled), any other with a
# newline; the generation prompt is ``<|assistant|>`` and a newline.
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|tools|>\\n' + tools | tojson(ensure_ascii=True, sort_keys=True) + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{{ message.get('content') or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>' + call.get('function') | tojson(ensure_ascii=True, sort_keys=True)"
    " + '</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token if message['role'] == 'assistant' else '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class HFTokenizer:
    """A local Hugging Face tokenizer directory behind the :class:`Tokenizer` interface."""

    def __init__(
        self,
        path: str,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._path = str(path)
        self._template_kwargs = dict(chat_template_kwargs or {})
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UserInputError(
                f"{self._path}: loading a Hugging Face tokenizer needs the transformers package; "
                "pip install transformers"
            ) from None
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(self._path, local_files_only=True)
        except Exception as exc:  # transformers raises many types; all mean "not loadable"
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserInputError(
                f"{self._path}: not a loadable Hugging Face tokenizer directory ({reason}); "
                "it needs tokenizer.json or the tokenizer files of its model"
            ) from None
        if self._tok.eos_token_id is None:
            raise UserInputError(
                f"{self._path}: the tokenizer defines no eos token; generation needs one to stop, "
                "so set eos_token in tokenizer_config.json"
            )
        if chat_template is not None:  # the recipe's template replaces the directory's
            self._tok.chat_template = chat_template

    @property
    def name(self) -> str:
        return self._path

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too, unlike the tokenizer's own vocab_size attribute.
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        # Many causal-LM tokenizers define no pad token; padded positions are masked anyway.
        pad = self._tok.pad_token_id
        return self.eos_id if pad is None else int(pad)

    @property
    def bos_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def bos_token(self) -> str | None:
        return self._tok.bos_token

    @property
    def eos_token(self) -> str:
        return str(self._tok.eos_token)

    def encode(
        self,
        text: str,
        add_bos: bool = False,
        add_eos: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Specials are added here, not by the tokenizer, so both tokenizers behave the same;
        ``add_bos`` is a no-op for tokenizers without a bos token (Qwen, for one).
        ``add_special_tokens`` adds what the tokenizer itself adds to a text (its own rule, as
        ``tokenizer(text)`` does). Special tokens written in ``text`` encode as their ids."""
        raw = self._tok.encode(text, add_special_tokens=add_special_tokens)
        ids = [int(i) for i in raw]
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @property
    def chat_template(self) -> str | None:
        """The chat template: the recipe's, else the directory's (None when neither has one)."""
        return getattr(self._tok, "chat_template", None)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> Any:
        """``messages`` rendered by the chat template (a ``chat_template`` keyword for this
        call only): the text with ``tokenize=False``, else its ids."""
        kwargs = {**self._template_kwargs, **template_kwargs}
        if kwargs.get("chat_template") is None and self.chat_template is None:
            raise UserInputError(
                f"policy.tokenizer.chat_template: the tokenizer in {self._path} has no chat "
                "template; set policy.tokenizer.chat_template to a Jinja template or a .jinja "
                "file (null: the passthrough template)"
            )
        if not tokenize:
            return str(
                self._tok.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **kwargs,
                )
            )
        encoded = self._tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **kwargs,
        )
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
        return [int(i) for i in ids]


def tokenizer_source(name: str | None, model_name: str | None) -> str | None:
    """Where ``policy.tokenizer.name`` comes from: ``"model"`` (the model's own), ``"byte"``, or
    a local directory holding a Hugging Face tokenizer. Raises :class:`ModelNotOnMachine` for a
    Hugging Face id that is not in the local cache (``validate`` warns, a run refuses) and
    UserInputError for anything else.

    ``None``, or the policy's own ``model_name`` (NeMo-RL's recipes write
    ``${policy.model_name}``), means the model's own: the byte tokenizer for presets, the
    directory's tokenizer for a Hugging Face model. A Hugging Face id (``org/name``) is read
    from the local Hugging Face cache, as a model is; model hubs are never reached."""
    if name is None or name == model_name:
        return "model"
    if name == "byte":
        return "byte"
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if is_hf_repo_id(name):
        snapshot = cached_snapshot(name)
        if snapshot is not None:
            return str(snapshot)
        roots = " or ".join(str(root) for root in hf_cache_roots()[-2:])
        raise ModelNotOnMachine(
            f"policy.tokenizer.name: Hugging Face tokenizer '{name}' is not on this machine "
            "(model hubs are not reached); give a local directory holding it, or put it in the "
            f"Hugging Face cache ({roots})"
        )
    raise UserInputError(
        f"policy.tokenizer.name: '{name}' is neither 'byte', the policy's model_name, a local "
        "directory nor a Hugging Face id; use null (the model's own tokenizer), 'byte', or "
        "the path of a Hugging Face tokenizer directory"
    )


def load_tokenizer(
    name: str | None,
    hf_directory: str | None,
    model_name: str | None = None,
    *,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Tokenizer:
    """The tokenizer for ``policy.tokenizer.name`` given the model's HF directory, if any, and
    the policy's ``model_name`` (:func:`tokenizer_source` says which names are accepted), with
    the resolved ``chat_template`` (None: the tokenizer's own) and ``chat_template_kwargs``."""
    source = tokenizer_source(name, model_name)
    template = {"chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs}
    if source == "model":
        if hf_directory is None:
            return ByteTokenizer(**template)
        return HFTokenizer(hf_directory, **template)
    if source == "byte":
        return ByteTokenizer(**template)
    return HFTokenizer(source, **template)
