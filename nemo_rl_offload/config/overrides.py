"""Parse command-line overrides written in Hydra's override grammar.

Only parsing lives here; applying an override to a recipe is done by the loader, which knows the
recipe's keys and can suggest the one the user meant. The grammar: docs/recipes.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from nemo_rl_offload.config.safe_yaml import MAX_DEPTH
from nemo_rl_offload.errors import UserInputError

__all__ = ["UNSET", "Override", "OverrideOp", "parse_override", "parse_value"]

OverrideOp = Literal["set", "add", "force", "delete"]


class _Unset:
    """Type of :data:`UNSET`: the value of a ``~key`` override that names no value."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""Value of a delete override written without ``=value``: delete whatever the key holds."""


@dataclass(frozen=True)
class Override:
    """One parsed override.

    ``path`` holds the key segments as written (list indices stay strings such as ``"0"``);
    ``value`` is the parsed value, or :data:`UNSET` for a ``~key`` with no value; ``text`` is the
    argument exactly as the user typed it, used to start every error line about it.
    """

    op: OverrideOp
    path: tuple[str, ...]
    value: Any
    text: str

    @property
    def key(self) -> str:
        """The dotted key, without the ``+``/``++``/``~`` prefix."""
        return ".".join(self.path)


class _ParseError(Exception):
    """Raised inside the value parser; turned into a UserInputError line by parse_override."""


_KEY_SEGMENT = re.compile(r"[\w\-/@]+")
_NULL = re.compile(r"null", re.IGNORECASE)
_TRUE = re.compile(r"true", re.IGNORECASE)
_FALSE = re.compile(r"false", re.IGNORECASE)
_DIGITS = r"\d(?:_?\d)*"
_INT = re.compile(r"[+-]?(?:0|[1-9](?:_?\d)*)")
_FLOAT = re.compile(
    rf"[+-]?(?:"
    rf"(?:(?:{_DIGITS})?\.{_DIGITS}|{_DIGITS}\.)(?:[eE][+-]?{_DIGITS})?"  # 1.5, .5, 5., 5.0e-6
    rf"|{_DIGITS}[eE][+-]?{_DIGITS}"  # 1e-5
    rf"|inf|nan)",
    re.IGNORECASE,
)
_QUOTES = "'\""


def parse_override(text: str) -> Override:
    """Parse one command-line override; raise UserInputError naming the override if malformed."""
    try:
        return _parse_override(text)
    except _ParseError as exc:
        raise UserInputError(f"override '{text}': {exc}") from None


def parse_value(text: str) -> Any:
    """Parse the value part of an override (the text after the first ``=``).

    Raises UserInputError naming the value if it is malformed.
    """
    try:
        return _parse_value(text)
    except _ParseError as exc:
        raise UserInputError(f"value '{text}': {exc}") from None


def _parse_override(text: str) -> Override:
    if not isinstance(text, str):
        raise _ParseError(f"expected text, got {type(text).__name__}")
    body = text.strip()
    if not body:
        raise _ParseError("empty override; write key=value")

    op: OverrideOp
    if body.startswith("~"):
        op, body = "delete", body[1:]
    elif body.startswith("++"):
        op, body = "force", body[2:]
    elif body.startswith("+"):
        op, body = "add", body[1:]
    else:
        op = "set"
    if body[:1] in ("+", "~"):
        raise _ParseError(
            "bad prefix; use +key=value to add, ++key=value to set or add, ~key to delete"
        )

    key, eq, raw_value = body.partition("=")
    path = _parse_key(key.strip())

    if op == "delete":
        value = _parse_value(raw_value) if raw_value.strip() else UNSET
    else:
        if not eq:
            raise _ParseError(
                f"missing '='; write {key.strip()}=value (or ~{key.strip()} to delete the key)"
            )
        value = _parse_value(raw_value)
    return Override(op=op, path=path, value=value, text=text)


def _parse_key(key: str) -> tuple[str, ...]:
    if not key:
        raise _ParseError("empty key; write key=value")
    segments = key.split(".")
    for segment in segments:
        if not segment:
            raise _ParseError(f"bad key '{key}': empty part between dots")
        if not _KEY_SEGMENT.fullmatch(segment):
            bad = next(ch for ch in segment if not _KEY_SEGMENT.fullmatch(ch))
            raise _ParseError(f"bad key '{key}': character {bad!r} is not allowed in a key")
    return tuple(segments)


def _parse_value(raw: str) -> Any:
    text = raw.strip()
    if not text:
        return ""
    parser = _ValueParser(text)
    value = parser.element(top=True)
    parser.skip_ws()
    if not parser.at_end():
        raise _ParseError(f"unexpected {parser.peek()!r} at position {parser.pos + 1} of the value")
    return value


def _scalar(token: str) -> Any:
    """Type an unquoted token the way Hydra does."""
    if "${" in token:
        return token
    if _NULL.fullmatch(token):
        return None
    if _TRUE.fullmatch(token):
        return True
    if _FALSE.fullmatch(token):
        return False
    if _INT.fullmatch(token):
        return int(token)
    if _FLOAT.fullmatch(token):
        return float(token)
    return token


class _ValueParser:
    """A small recursive-descent reader for one override value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0  # lists and dicts open

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_ws(self) -> None:
        while not self.at_end() and self.text[self.pos].isspace():
            self.pos += 1

    def element(self, top: bool = False, dict_key: bool = False) -> Any:
        self.skip_ws()
        ch = self.peek()
        if ch in ("[", "{") and not dict_key:
            # Bounded like a recipe file's nesting: deeper would exhaust Python's recursion.
            if self.depth >= MAX_DEPTH:
                raise _ParseError(
                    f"nested deeper than {MAX_DEPTH} levels of lists and mappings at position "
                    f"{self.pos + 1} of the value; a recipe needs far fewer: flatten it"
                )
            self.depth += 1
            try:
                return self.list_() if ch == "[" else self.dict_()
            finally:
                self.depth -= 1
        if ch and ch in _QUOTES:
            value = self.quoted()
            if top:
                self.skip_ws()
                if not self.at_end():
                    raise _ParseError(
                        "text after the closing quote; quote the whole value or nothing"
                    )
            return value
        return self.primitive(top=top, dict_key=dict_key)

    def quoted(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        out: list[str] = []
        while not self.at_end():
            ch = self.text[self.pos]
            if ch == "\\":
                # A run of backslashes matters only before a quote: an even run is halved and the
                # quote closes the string; an odd run is halved and the quote is literal.
                end = self.pos
                while end < len(self.text) and self.text[end] == "\\":
                    end += 1
                run = end - self.pos
                if end < len(self.text) and self.text[end] == quote:
                    out.append("\\" * (run // 2))
                    if run % 2:
                        out.append(quote)
                        self.pos = end + 1
                    else:
                        self.pos = end  # the quote closes the string below
                    continue
                out.append("\\" * run)
                self.pos = end
                continue
            if ch == quote:
                self.pos += 1
                return "".join(out)
            out.append(ch)
            self.pos += 1
        raise _ParseError(f"unclosed quote {quote}")

    def primitive(self, top: bool, dict_key: bool = False) -> Any:
        start = self.pos
        depth = 0  # nesting of ${...}
        text = self.text
        while self.pos < len(text):
            ch = text[self.pos]
            if ch == "$" and text[self.pos + 1 : self.pos + 2] == "{":
                depth += 1
                self.pos += 2
                continue
            if depth:
                if ch == "}":
                    depth -= 1
                elif ch in _QUOTES:
                    self.quoted()  # quoted argument inside an interpolation
                    continue
                self.pos += 1
                continue
            if ch == ",":
                if top:
                    raise _ParseError(
                        "a comma outside brackets; write [a,b] for a list, "
                        "or quote the value to keep the comma in a string"
                    )
                break
            if ch in "]}":
                if top:
                    raise _ParseError(f"unmatched {ch!r}")
                break
            if ch == ":" and dict_key:
                break
            if ch in "[{":
                raise _ParseError(
                    f"unexpected {ch!r} inside a value; quote the value to keep it as text"
                )
            if ch in _QUOTES:
                raise _ParseError(
                    f"stray quote {ch} inside a value; quote the whole value "
                    "(with the other kind of quote) to keep it as text"
                )
            self.pos += 1
        if depth:
            raise _ParseError("unclosed '${'")
        token = text[start : self.pos].strip()
        if not token:
            what = "key" if dict_key else "element"
            raise _ParseError(f"empty {what} at position {start + 1} of the value")
        return token if dict_key else _scalar(token)

    def list_(self) -> list[Any]:
        self.pos += 1  # [
        items: list[Any] = []
        self.skip_ws()
        if self.peek() == "]":
            self.pos += 1
            return items
        while True:
            items.append(self.element())
            self.skip_ws()
            ch = self.peek()
            if ch == ",":
                self.pos += 1
                self.skip_ws()
                if not self.peek():
                    raise _ParseError("unclosed '['")
                continue
            if ch == "]":
                self.pos += 1
                return items
            if not ch:
                raise _ParseError("unclosed '['")
            raise _ParseError(f"unexpected {ch!r} in a list at position {self.pos + 1}")

    def dict_(self) -> dict[str, Any]:
        self.pos += 1  # {
        items: dict[str, Any] = {}
        self.skip_ws()
        if self.peek() == "}":
            self.pos += 1
            return items
        while True:
            self.skip_ws()
            if not self.peek():
                raise _ParseError("unclosed '{'")
            key = self.element(dict_key=True)
            self.skip_ws()
            if self.peek() != ":":
                if not self.peek():
                    raise _ParseError("unclosed '{'")
                raise _ParseError(f"expected ':' after dict key {key!r}")
            self.pos += 1
            if key in items:
                raise _ParseError(f"dict key {key!r} appears twice")
            items[key] = self.element()
            self.skip_ws()
            ch = self.peek()
            if ch == ",":
                self.pos += 1
                continue
            if ch == "}":
                self.pos += 1
                return items
            if not ch:
                raise _ParseError("unclosed '{'")
            raise _ParseError(f"unexpected {ch!r} in a dict at position {self.pos + 1}")
