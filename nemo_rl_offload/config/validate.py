"""Schema validation of a loaded recipe, reported as ``dotted.path: message (got: value)``.

pydantic validates the TypedDicts of :mod:`nemo_rl_offload.config.schema`; this module turns its
errors into lines a user can act on: the YAML path of the key, what is wrong, the value found, and
for an unknown key the closest known one.
"""

from __future__ import annotations

import difflib
import functools
import types
import typing
from typing import Any, get_args, get_origin, get_type_hints

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from nemo_rl_offload.config import value_bounds
from nemo_rl_offload.config.schema import MASTER_CONFIGS
from nemo_rl_offload.errors import UserInputError

_MAX_SHOWN = 60


def detect_algorithm(recipe: dict[str, Any]) -> str:
    """Which algorithm a recipe is for: the one algorithm section it has (sft, dpo, grpo or
    distillation), as in NeMo-RL where each recipe has exactly one."""
    present = [name for name in MASTER_CONFIGS if name in recipe]
    if len(present) == 1:
        return present[0]
    if not present:
        raise UserInputError(
            "recipe: no algorithm section; add one of "
            + ", ".join(MASTER_CONFIGS)
            + " (e.g. 'grpo:' with its settings)"
        )
    raise UserInputError(
        f"recipe: several algorithm sections ({', '.join(present)}); keep exactly one"
    )


def show_value(value: Any) -> str:
    """A value the way a YAML user writes it, shortened when long."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = repr(value)
    else:
        text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


@functools.cache
def _adapter(algorithm: str) -> TypeAdapter:
    return TypeAdapter(MASTER_CONFIGS[algorithm])


def _typed_dict_members(tp: Any) -> list[type]:
    """The TypedDict classes a (possibly Optional / NotRequired / container) type leads to."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return [member for arg in get_args(tp) for member in _typed_dict_members(arg)]
    if origin in (typing.NotRequired, typing.Required):
        return _typed_dict_members(get_args(tp)[0])
    if typing.is_typeddict(tp):
        return [tp]
    return []


def _keys_at(root: type, path: tuple[str | int, ...]) -> list[str]:
    """Known keys of the section at ``path`` (a chain of keys from the master config)."""
    candidates: list[type] = [root]
    for key in path:
        following: list[type] = []
        for cls in candidates:
            hints = get_type_hints(cls)
            if isinstance(key, str) and key in hints:
                following += _typed_dict_members(hints[key])
        candidates = following
    return sorted({key for cls in candidates for key in get_type_hints(cls)})


# A bound a value broke (pydantic's error type), as the line says it.
_BOUNDS = {
    "greater_than_equal": ("ge", "must be at least {}"),
    "greater_than": ("gt", "must be more than {}"),
    "less_than_equal": ("le", "must be at most {}"),
    "less_than": ("lt", "must be less than {}"),
}


def _members(tp: Any) -> list[Any]:
    """The alternatives of a (NotRequired, Optional, union) annotation, Annotated kept."""
    origin = get_origin(tp)
    if origin in (typing.NotRequired, typing.Required):
        return _members(get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return [member for arg in get_args(tp) for member in _members(arg)]
    return [tp]


@functools.cache
def _bound_fix(root: type, path: tuple[str | int, ...]) -> str | None:
    """The fix the schema's named type of ``path`` gives (its Field's description): the key's
    annotation followed down ``path``, into list items and mapping values where it goes."""
    current: list[Any] = [root]
    for key in path:
        following: list[Any] = []
        for member in (m for tp in current for m in _members(tp)):
            base = get_args(member)[0] if get_origin(member) is typing.Annotated else member
            if typing.is_typeddict(base) and isinstance(key, str):
                hints = get_type_hints(base, include_extras=True)
                following += [hints[key]] if key in hints else []
            elif get_origin(base) is list and isinstance(key, int):
                following += list(get_args(base)[:1])
            elif get_origin(base) is dict:
                following += list(get_args(base)[1:2])
        current = following
    for member in (m for tp in current for m in _members(tp)):
        if get_origin(member) is typing.Annotated:
            for extra in get_args(member)[1:]:
                if isinstance(extra, FieldInfo) and extra.description:
                    return extra.description
    return None


def _bound_line(algorithm: str, path: tuple[str | int, ...], error: dict[str, Any]) -> str:
    """``key: must be at least 1 (got: 0); set a positive count (...)``: the bound broken, the
    value, and the fix the key's named type gives."""
    kind, value = error["type"], error.get("input")
    if kind == "finite_number":
        said = "must be a finite number"
    else:
        name, text = _BOUNDS[kind]
        bound = (error.get("ctx") or {}).get(name)
        said = text.format(f"{bound:g}" if isinstance(bound, float) else show_value(bound))
    fix = _bound_fix(MASTER_CONFIGS[algorithm], path)
    dotted = ".".join(str(part) for part in path)
    return f"{dotted}: {said} (got: {show_value(value)})" + (f"; {fix}" if fix else "")


def _has_child(node: Any, key: Any) -> bool:
    if isinstance(node, dict):
        return key in node
    return isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node)


def _data_path(recipe: Any, loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    """The part of pydantic's ``loc`` that names real keys: it also holds union branch names
    (``int``, ``typed-dict``...), which are skipped; a missing key, last in ``loc``, is kept."""
    path: list[str | int] = []
    node = recipe
    for index, key in enumerate(loc):
        if _has_child(node, key):
            path.append(key)
            node = node[key]
        elif index == len(loc) - 1 and isinstance(node, dict) and isinstance(key, str):
            path.append(key)
    return tuple(path)


def _line(algorithm: str, recipe: dict[str, Any], error: dict[str, Any]) -> str:
    path = _data_path(recipe, tuple(error["loc"]))
    dotted = ".".join(str(part) for part in path) or "recipe"
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        known = _keys_at(MASTER_CONFIGS[algorithm], path[:-1])
        close = difflib.get_close_matches(str(path[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "known keys: " + ", ".join(known)
        return f"{dotted}: unknown key; {hint}"
    if kind == "missing":
        return f"{dotted}: required key is missing"
    if kind == "finite_number" or kind in _BOUNDS:
        return _bound_line(algorithm, path, error)
    if kind == "int_type" and isinstance(value, float):  # 1e26, 4.0: YAML floats
        fix = _bound_fix(MASTER_CONFIGS[algorithm], path)
        return f"{dotted}: must be a whole number (got: {show_value(value)})" + (
            f"; {fix}" if fix else ""
        )
    if kind == "list_type" and isinstance(value, str):
        return (
            f"{dotted}: must be a list, not a single string (got: {show_value(value)}); "
            f"write [{value}]"
        )
    message = error["msg"]
    return f"{dotted}: {message[0].lower()}{message[1:]} (got: {show_value(value)})"


def schema_problems(recipe: dict[str, Any], algorithm: str) -> list[str]:
    """Every schema violation of ``recipe`` as one line each (empty when it is valid), then
    the bounds one key sets for another (:mod:`.value_bounds`) that the schema cannot say."""
    try:
        _adapter(algorithm).validate_python(recipe)
    except ValidationError as exc:
        errors = exc.errors()
        reached = [_reached(recipe, tuple(error["loc"])) for error in errors]
        lines: dict[str, str] = {}  # one line per path: a union reports each branch
        for error, path in zip(errors, reached, strict=True):
            # A union branch that did not take the value (``list[...]`` for a mapping) beside
            # the branch that did and found what is wrong inside it: that branch's lines only.
            tagged = error["type"] != "missing" and len(path) < len(error["loc"])
            if tagged and any(
                len(other) > len(path) and other[: len(path)] == path for other in reached
            ):
                continue
            line = _line(algorithm, recipe, error)
            lines.setdefault(line.split(":", 1)[0], line)
        return [*lines.values(), *value_bounds.problems(recipe, algorithm)]
    return value_bounds.problems(recipe, algorithm)


def _reached(recipe: Any, loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    """The keys of ``loc`` that are in ``recipe`` (union branch names and a missing key left
    out)."""
    path: list[str | int] = []
    node = recipe
    for key in loc:
        if _has_child(node, key):
            path.append(key)
            node = node[key]
    return tuple(path)
