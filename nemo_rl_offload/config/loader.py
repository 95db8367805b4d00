"""Load a NeMo-RL-style recipe: YAML file, ``defaults:`` inheritance, overrides, interpolation.

:func:`load_recipe` reads the YAML, follows ``defaults:``, applies command-line overrides and
resolves ``${...}``, and returns plain data. Every user mistake becomes a UserInputError line
that starts with where it is; nothing is ever written. The steps: docs/recipes.md.
"""

from __future__ import annotations

import datetime
import difflib
import inspect
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_rl_offload.config.overrides import UNSET, Override, parse_override
from nemo_rl_offload.config.safe_yaml import load_yaml, yaml_problem
from nemo_rl_offload.errors import UserInputError

__all__ = [
    "apply_overrides",
    "deep_merge",
    "load_recipe",
    "register_resolvers",
    "resolve_interpolations",
]

DEFAULTS_KEY = "defaults"


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Load the recipe at ``path``, apply ``overrides`` and return fully resolved plain data."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of strings, not one string")
    data = _load_with_defaults(os.fspath(path), (), [0])
    data = apply_overrides(data, overrides)
    return resolve_interpolations(data)


def recipe_files(path: str | os.PathLike[str]) -> list[Path]:
    """The recipe file and every file its ``defaults:`` reach, the recipe first (for keys that
    name files relative to where a recipe lives, e.g. ``config.quantization``). A file that
    cannot be read ends its branch: :func:`load_recipe` reports it."""
    found: list[Path] = []
    seen: set[Path] = set()
    pending = [os.fspath(path)]
    while pending:
        current = os.path.normpath(pending.pop(0))
        if Path(current).resolve() in seen or not os.path.isfile(current):
            continue
        seen.add(Path(current).resolve())
        found.append(Path(current))
        try:
            data = _read_yaml(current)
            entries = _defaults_entries(current, data.get(DEFAULTS_KEY))
        except UserInputError:
            continue
        pending += [
            e if os.path.isabs(e) else os.path.join(os.path.dirname(current), e) for e in entries
        ]
    return found


# --------------------------------------------------------------------------------------------
# Reading files and following defaults


# Files read for one recipe through ``defaults:`` (a file inherited twice counts twice): a
# chain of files each naming the next several times would otherwise be read exponentially often.
MAX_DEFAULTS_READS = 1000


def _load_with_defaults(
    display: str, ancestors: tuple[tuple[str, str], ...], reads: list[int]
) -> dict[str, Any]:
    """Load one file and everything it inherits. ``ancestors`` holds (real path, shown path) of
    the files that led here, root first, to detect cycles; ``reads`` counts the files read."""
    reads[0] += 1
    if reads[0] > MAX_DEFAULTS_READS:
        root = ancestors[0][1] if ancestors else display
        raise UserInputError(
            f"{root}: defaults: more than {MAX_DEFAULTS_READS} files read through defaults "
            f"(reached at {display}); a file is inherited many times over: name each parent once"
        )
    data = _read_yaml(display)
    entries = _defaults_entries(display, data.pop(DEFAULTS_KEY, None))
    chain = (*ancestors, (os.path.realpath(display), display))

    merged: dict[str, Any] = {}
    for entry in entries:
        parent = entry if os.path.isabs(entry) else os.path.join(os.path.dirname(display), entry)
        parent = os.path.normpath(parent)
        parent_real = os.path.realpath(parent)
        for i, (real, _) in enumerate(chain):
            if real == parent_real:
                names = [shown for _, shown in chain[i:]] + [parent]
                raise UserInputError(f"{display}: defaults form a cycle: {' -> '.join(names)}")
        if not os.path.exists(parent):
            raise UserInputError(
                f"{display}: defaults entry '{entry}' does not exist (looked for {parent})"
            )
        if not os.path.isfile(parent):
            raise UserInputError(
                f"{display}: defaults entry '{entry}' is not a file (looked at {parent})"
            )
        merged = _merge_level(merged, _load_with_defaults(parent, chain, reads))
    return _merge_level(merged, data)


OVERRIDE_MARKER = "_override_"


def _merge_level(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """deep_merge, except that a top-level section of ``override`` holding
    ``_override_: true`` replaces ``base``'s section whole, as NeMo-RL's loader does (a recipe
    swaps a parent's data or env section without inheriting its keys)."""
    override = dict(override)
    base = dict(base)
    for key, value in list(override.items()):
        if isinstance(value, dict) and OVERRIDE_MARKER in value:
            if value[OVERRIDE_MARKER] is True:
                base.pop(key, None)
            override[key] = {k: v for k, v in value.items() if k != OVERRIDE_MARKER}
    return deep_merge(base, override)


def _defaults_entries(display: str, value: Any) -> list[str]:
    if value is None:
        return []
    where = f"{display}: {DEFAULTS_KEY}"
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise UserInputError(
            f"{where}: must be a file path or a list of file paths, not {_kind(value)}"
        )
    problems = []
    for i, entry in enumerate(value):
        if not isinstance(entry, str):
            problems.append(
                f"{where}.{i}: must be a file path (text), not {_kind(entry)}"
                + (
                    "; Hydra-style group defaults are not supported, name the parent file"
                    if isinstance(entry, dict)
                    else ""
                )
            )
        elif not entry.strip():
            problems.append(f"{where}.{i}: empty file path")
    if problems:
        raise UserInputError(problems)
    return [entry.strip() for entry in value]


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise UserInputError(f"{path}: no such recipe file")
    if os.path.isdir(path):
        raise UserInputError(f"{path}: is a directory, not a recipe file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise UserInputError(f"{path}: not UTF-8 text; is this a YAML recipe?") from None
    except OSError as exc:
        raise UserInputError(f"{path}: cannot read: {exc.strerror or exc}") from None

    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise UserInputError(yaml_problem(path, exc)) from None

    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserInputError(
            f"{path}: the top level must be a mapping of keys to values, not {_kind(data)}"
        )
    problems: list[str] = []
    _check_plain(data, (), f"{path}: ", problems)
    if problems:
        raise UserInputError(problems)
    return data


def _check_plain(node: Any, here: tuple[Any, ...], prefix: str, problems: list[str]) -> None:
    """Report keys and values that YAML produced but a recipe cannot hold (dates, sets, ...)."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = _dotted((*here, key))
            if isinstance(key, bool) or not isinstance(key, str | int):
                hint = (
                    " (YAML reads yes/no/on/off/true/false as booleans)"
                    if isinstance(key, bool)
                    else ""
                )
                problems.append(
                    f"{prefix}{where}: key {key!r} is {_kind(key)}, not text{hint}; quote it"
                )
            _check_plain(value, (*here, key), prefix, problems)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_plain(value, (*here, i), prefix, problems)
    elif node is None or isinstance(node, bool | int | float | str):
        return
    elif isinstance(node, datetime.date):
        problems.append(
            f"{prefix}{_dotted(here)}: YAML reads {node.isoformat()} as a date; "
            "quote it to keep it as text"
        )
    else:
        problems.append(
            f"{prefix}{_dotted(here)}: unsupported value of type {type(node).__name__}; "
            "use text, a number, a boolean, null, a list or a mapping"
        )


# --------------------------------------------------------------------------------------------
# Merging


def deep_merge(base: dict[Any, Any], override: dict[Any, Any]) -> dict[Any, Any]:
    """Return a new dict: ``override`` merged onto ``base``.

    Where both hold a mapping under the same key the two are merged key by key; otherwise the
    value from ``override`` replaces the one in ``base`` (lists are replaced, not concatenated).
    Neither argument is changed, and the result shares no dicts or lists with them.
    """
    if not isinstance(base, dict) or not isinstance(override, dict):
        raise TypeError("deep_merge needs two dicts")
    result = {key: _copy(value) for key, value in base.items()}
    for key, value in override.items():
        if isinstance(result.get(key), dict) and isinstance(value, dict):
            result[key] = deep_merge(result[key], value)
        else:
            result[key] = _copy(value)
    return result


def _copy(value: Any) -> Any:
    """Copy dicts and lists all the way down. Unlike copy.deepcopy this does not keep YAML
    anchors shared, so an override of one aliased place does not change the others."""
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value


# --------------------------------------------------------------------------------------------
# Overrides


class _ApplyError(Exception):
    """One problem applying one override; the message follows the override text."""


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with the command-line ``overrides`` applied in order.

    Every malformed or inapplicable override is reported, all together, in one UserInputError.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of strings, not one string")
    result = _copy(data)
    problems: list[str] = []
    for text in overrides:
        try:
            override = parse_override(text)
        except UserInputError as exc:
            problems.extend(exc.problems)
            continue
        try:
            _apply(result, override)
        except _ApplyError as exc:
            problems.append(f"{override.text}: {exc}")
    if problems:
        raise UserInputError(problems)
    return result


def _apply(root: dict[str, Any], ov: Override) -> None:
    create = ov.op in ("add", "force")
    node: Any = root
    for depth, segment in enumerate(ov.path[:-1]):
        node = _step(node, segment, ov.path[:depth], ov, create)

    here = ov.path[:-1]
    last = ov.path[-1]
    if isinstance(node, dict):
        key = _find_key(node, last)
        if ov.op == "set":
            if key is None:
                raise _ApplyError(_missing_key(node, last, here, ov))
            node[key] = _copy(ov.value)
        elif ov.op == "add":
            if key is not None:
                raise _ApplyError(_already_exists(ov))
            node[last] = _copy(ov.value)
        elif ov.op == "force":
            node[last if key is None else key] = _copy(ov.value)
        else:
            if key is None:
                raise _ApplyError(_missing_key(node, last, here, ov))
            _check_delete_value(node[key], ov)
            del node[key]
    elif isinstance(node, list):
        if ov.op == "add":
            if _is_index(last) and int(last) < len(node):
                raise _ApplyError(_already_exists(ov))
            raise _ApplyError(
                f"{_dotted(here)} is a list; + cannot add list elements, "
                f"set the whole list instead ({_dotted(here)}=[...])"
            )
        index = _index(node, last, here)
        if ov.op == "delete":
            _check_delete_value(node[index], ov)
            del node[index]
        else:
            node[index] = _copy(ov.value)
    else:
        raise _ApplyError(_not_a_mapping(node, last, here))


def _step(node: Any, segment: str, here: tuple[str, ...], ov: Override, create: bool) -> Any:
    """Go from ``node`` (at path ``here``) to its child ``segment``, creating dicts if asked."""
    if isinstance(node, dict):
        key = _find_key(node, segment)
        if key is None:
            if not create:
                raise _ApplyError(_missing_key(node, segment, here, ov))
            node[segment] = {}
            return node[segment]
        return node[key]
    if isinstance(node, list):
        return node[_index(node, segment, here)]
    raise _ApplyError(_not_a_mapping(node, segment, here))


def _find_key(node: dict[Any, Any], segment: str) -> Any:
    """The key of ``node`` that ``segment`` names (YAML may have made it an int), or None."""
    if segment in node:
        return segment
    if re.fullmatch(r"-?\d+", segment):
        number = int(segment)
        for key in node:
            if isinstance(key, int) and not isinstance(key, bool) and key == number:
                return key
    return None


def _is_index(segment: str) -> bool:
    return segment.isascii() and segment.isdigit()


def _index(node: list[Any], segment: str, here: tuple[str, ...]) -> int:
    where = _dotted(here)
    if not node:
        raise _ApplyError(f"{where} is an empty list; it has no element '{segment}'")
    if not _is_index(segment):
        raise _ApplyError(
            f"{where} is a list; '{segment}' is not an element index (use 0 to {len(node) - 1})"
        )
    index = int(segment)
    if index >= len(node):
        raise _ApplyError(
            f"{where} has {len(node)} element{'s' if len(node) != 1 else ''}; "
            f"index {index} is out of range (use 0 to {len(node) - 1})"
        )
    return index


def _missing_key(node: dict[Any, Any], segment: str, here: tuple[str, ...], ov: Override) -> str:
    where = _dotted(here) if here else "the top level of the recipe"
    message = f"no such key '{segment}' in {where}"
    close = difflib.get_close_matches(segment, [str(key) for key in node], n=1)
    if close:
        message += f"; did you mean '{close[0]}'?"
    if ov.op == "delete":
        return message + " (nothing to delete)"
    return message + " (use +key=value to add a new key)"


def _already_exists(ov: Override) -> str:
    value_text = ov.text.partition("=")[2]
    key = ov.key
    return (
        f"{key} already exists; write {key}={value_text} to change it "
        f"(or ++{key}={value_text} to set it whether or not it exists)"
    )


def _not_a_mapping(node: Any, segment: str, here: tuple[str, ...]) -> str:
    return (
        f"{_dotted(here)} is {_short_repr(node)} ({_kind(node)}), not a mapping, "
        f"so it has no key '{segment}'"
    )


def _check_delete_value(current: Any, ov: Override) -> None:
    if ov.value is UNSET:
        return
    if not _same_value(current, ov.value):
        raise _ApplyError(
            f"{ov.key} is {_short_repr(current)}, not {_short_repr(ov.value)}; not deleted"
        )


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# --------------------------------------------------------------------------------------------
# Interpolation


def _numbers(name: str, args: tuple[Any, ...], least: int) -> tuple[Any, ...]:
    if len(args) < least:
        raise ValueError(f"{name} needs at least {least} number{'s' if least != 1 else ''}")
    for arg in args:
        if isinstance(arg, bool) or not isinstance(arg, int | float):
            raise ValueError(f"{name}: {arg!r} is not a number")
    return args


def _mul(*args: Any) -> Any:
    product: Any = 1
    for arg in _numbers("mul", args, 1):
        product *= arg
    return product


def _add(*args: Any) -> Any:
    return sum(_numbers("add", args, 1))


def _div(*args: Any) -> Any:
    if len(args) != 2:
        raise ValueError(f"div needs exactly 2 numbers, got {len(args)}")
    numerator, denominator = _numbers("div", args, 2)
    if denominator == 0:
        raise ValueError("div: division by zero")
    return numerator / denominator


def _max(*args: Any) -> Any:
    return max(_numbers("max", args, 1))


def _min(*args: Any) -> Any:
    return min(_numbers("min", args, 1))


_RESOLVERS: dict[str, Callable[..., Any]] = {
    "mul": _mul,
    "add": _add,
    "div": _div,
    "max": _max,
    "min": _min,
}


def register_resolvers() -> None:
    """Register the arithmetic resolvers with OmegaConf. Safe to call any number of times."""
    register = getattr(OmegaConf, "register_resolver", None)
    # OmegaConf 2.4 renamed register_new_resolver to register_resolver; before 2.4 a method of
    # that name, if present, is the old string-only API, which has no ``replace`` argument.
    if register is None or "replace" not in inspect.signature(register).parameters:
        register = OmegaConf.register_new_resolver
    for name, function in _RESOLVERS.items():
        register(name, function, replace=True)


def resolve_interpolations(data: dict[str, Any]) -> dict[str, Any]:
    """Resolve every ``${...}`` in ``data`` and return new plain data (no OmegaConf objects).

    Each value that cannot be resolved is reported as
    ``<dotted path>: cannot resolve '<text>': <reason>``, all in one UserInputError. A value
    that reads an environment variable unset here keeps its ``${oc.env:NAME}`` text (see
    :func:`unset_environment`).
    """
    if not isinstance(data, dict):
        raise TypeError("resolve_interpolations needs a dict")
    register_resolvers()

    problems: list[str] = []
    _check_plain(data, (), "", problems)
    if problems:
        raise UserInputError(problems)
    data = _keep_unset_environment(data)

    # A syntax error in an interpolation surfaces when the config is created, so check each
    # string on its own first and leave the bad ones out of the config; then try every other
    # interpolated value on its own, so that each failure is reported with its own path.
    bad_syntax: dict[tuple[Any, ...], str] = {}
    for here, text in _interpolated_strings(data, ()):
        try:
            OmegaConf.create({"value": text})
        except Exception as exc:
            bad_syntax[here] = f"invalid interpolation syntax: {_reason(exc)}"
    sanitized = _copy(data)
    for here in bad_syntax:
        _set_at(sanitized, here, None)
    try:
        cfg = OmegaConf.create(sanitized)
    except Exception as exc:  # not expected after the checks above
        raise UserInputError(f"recipe: cannot build the config: {_reason(exc)}") from None

    _find_failures(data, cfg, (), bad_syntax, problems)
    if problems:
        raise UserInputError(problems)
    try:
        result = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # not expected after every value resolved on its own
        raise UserInputError(f"recipe: cannot resolve interpolations: {_reason(exc)}") from None
    assert isinstance(result, dict)
    return result


# ``${oc.env:NAME}`` without a default: NeMo-RL resolves it on its cluster when the run starts.
_ENV_READ = re.compile(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}")


def _keep_unset_environment(node: Any) -> Any:
    """Escape each ``${oc.env:NAME}`` whose variable is unset here, so that it resolves to its
    own text: the value (and any that interpolates it) is unknown on this machine, which
    :func:`unset_environment` finds for the checks to report, instead of failing the load."""
    if isinstance(node, dict):
        return {key: _keep_unset_environment(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_keep_unset_environment(value) for value in node]
    if isinstance(node, str) and "${" in node:
        # Not one already escaped by the recipe (``\${...}``), which is text already.
        return re.sub(
            r"(?<!\\)" + _ENV_READ.pattern,
            lambda m: m.group(0) if m.group(1) in os.environ else "\\" + m.group(0),
            node,
        )
    return node


def unset_environment(data: Any, here: tuple[Any, ...] = ()) -> list[tuple[str, list[str]]]:
    """(dotted path, variable names) of each loaded value that reads an environment variable
    unset on this machine (kept as ``${oc.env:NAME}`` text by the loader)."""
    found: list[tuple[str, list[str]]] = []
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in items:
        path = (*here, key)
        if isinstance(value, dict | list):
            found.extend(unset_environment(value, path))
        elif isinstance(value, str):
            names = [name for name in _ENV_READ.findall(value) if name not in os.environ]
            if names:
                found.append((_dotted(path), list(dict.fromkeys(names))))
    return found


def _interpolated_strings(node: Any, here: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], str]]:
    found: list[tuple[tuple[Any, ...], str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(_interpolated_strings(value, (*here, key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_interpolated_strings(value, (*here, i)))
    elif isinstance(node, str) and "${" in node:
        found.append((here, node))
    return found


def _find_failures(
    node: Any,
    cfg: DictConfig | ListConfig,
    here: tuple[Any, ...],
    bad_syntax: dict[tuple[Any, ...], str],
    problems: list[str],
) -> None:
    """Walk the plain data beside its config and try every interpolated value on its own."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        path = (*here, key)
        if isinstance(value, dict | list):
            _find_failures(value, cfg[key], path, bad_syntax, problems)
        elif path in bad_syntax:
            problems.append(f"{_dotted(path)}: cannot resolve '{value}': {bad_syntax[path]}")
        elif isinstance(value, str) and "${" in value:
            try:
                cfg[key]
            except Exception as exc:
                problems.append(f"{_dotted(path)}: cannot resolve '{value}': {_reason(exc)}")


def _set_at(root: Any, path: tuple[Any, ...], value: Any) -> None:
    node = root
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _reason(exc: BaseException) -> str:
    reason = _first_line(str(exc)) or type(exc).__name__
    # "ValueError raised while resolving interpolation: div: division by zero" -> the cause.
    return re.sub(r"^\w+ raised while resolving interpolation: ", "", reason)


# --------------------------------------------------------------------------------------------
# Small helpers


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in path)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def yaml_type(value: Any) -> str:
    """The YAML type of a loaded value by its short name (``null``, ``bool``, ``int``,
    ``float``, ``str``, ``list``, ``dict``; another Python type by its class name): the one
    classification that error messages and the NeMo-RL key list (scripts/nemo_rl_keys.py)
    share, so the two cannot disagree about what a value is."""
    if value is None:
        return "null"
    for kind in (bool, int, float, str, list, dict):  # bool before int: True is an int
        if isinstance(value, kind):
            return kind.__name__
    return type(value).__name__


_KIND_IN_PROSE = {
    "null": "null",
    "bool": "a boolean",
    "int": "an integer",
    "float": "a number",
    "str": "text",
    "list": "a list",
    "dict": "a mapping",
}


def _kind(value: Any) -> str:
    kind = yaml_type(value)
    return _KIND_IN_PROSE.get(kind, f"a {kind}")


def _short_repr(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
