"""Read YAML a user hands in (recipes, ModelOpt recipe files) without hanging or crashing.

YAML's safe loader builds no objects, but it still lets a file of a few hundred bytes
describe billions of values through aliases ("billion laughs": each level repeats the one
before), nest deeper than Python's recursion allows, refer to itself (``&a [*a]``), or
repeat a key (the later one silently replacing the first, a whole section's keys lost). Each
of these is refused here while the file is composed, before anything walks the data, as a
``yaml.MarkedYAMLError`` whose mark is where the limit was crossed: callers report it as
``file:line:column: problem`` like any other YAML error.

The limits are far above any recipe's (the largest in examples/configs is a few thousand
values, six levels deep) and far below what costs memory or time.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent, CollectionStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = [
    "MAX_DEPTH",
    "MAX_VALUES",
    "SafeYamlLoader",
    "YamlLimitError",
    "load_yaml",
    "yaml_problem",
]

# Values in the document once every alias is expanded (each scalar, list and mapping counts 1).
MAX_VALUES = 200_000
# Lists and mappings inside one another.
MAX_DEPTH = 64

_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlLimitError(ComposerError):
    """A document over one of the limits, or one that refers to itself."""


class SafeYamlLoader(yaml.SafeLoader):
    """YAML's safe loader with the document's size after alias expansion and its nesting
    bounded, self-references and repeated keys refused, and exponent-only numbers
    (``1e-8``) read as floats as YAML 1.2 and OmegaConf (NeMo-RL's loader) read them."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._values = 0  # values so far, aliases counted expanded
        self._depth = 0
        self._open_anchors: set[str] = set()  # anchors of collections being composed
        self._sizes: dict[int, int] = {}  # id(node) -> values once expanded

    def compose_document(self) -> Any:
        self._values, self._depth = 0, 0
        self._open_anchors.clear()
        self._sizes.clear()
        return super().compose_document()

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            return self._compose_alias(event, parent, index)
        if self._depth >= MAX_DEPTH:
            raise YamlLimitError(
                None,
                None,
                f"nested deeper than {MAX_DEPTH} levels of lists and mappings; "
                "a recipe needs far fewer: flatten it",
                event.start_mark,
            )
        anchor = event.anchor if isinstance(event, CollectionStartEvent) else None
        if anchor is not None:
            self._open_anchors.add(anchor)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open_anchors.discard(anchor)
        if isinstance(node, MappingNode):
            self._check_keys(node)
        self._values += 1
        self._sizes[id(node)] = 1 + sum(self._sizes.get(id(child), 1) for child in _children(node))
        self._check_values(event.start_mark)
        return node

    def _compose_alias(self, event: AliasEvent, parent: Node | None, index: Any) -> Node:
        if event.anchor in self._open_anchors:
            raise YamlLimitError(
                None,
                None,
                f"alias *{event.anchor} refers to the list or mapping that contains it (a "
                "value that holds itself has no end); copy the values it needs instead",
                event.start_mark,
            )
        node = super().compose_node(parent, index)
        self._values += self._sizes.get(id(node), 1)
        self._check_values(event.start_mark)
        return node

    def _check_values(self, mark: Any) -> None:
        if self._values > MAX_VALUES:
            raise YamlLimitError(
                None,
                None,
                f"expands to more than {MAX_VALUES} values once its aliases (*name) are "
                "expanded (an alias repeating aliases multiplies them); a recipe needs far "
                "fewer: repeat less through aliases",
                mark,
            )

    def _check_keys(self, node: MappingNode) -> None:
        """Refuse a key given twice in one mapping, naming both lines; keys brought in by a
        ``<<:`` merge may be overridden, as YAML intends. Checked on the composed node, before
        construction flattens merges into it."""
        seen: dict[Any, ScalarNode] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            first = seen.get(key)
            if first is not None:
                raise ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping, at lines "
                    f"{first.start_mark.line + 1} and {key_node.start_mark.line + 1} (the "
                    "second would silently replace the first and all it holds); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node


SafeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def load_yaml(text: str) -> Any:
    """The one document in ``text``, read with :class:`SafeYamlLoader`; raises
    ``yaml.YAMLError`` (a ``MarkedYAMLError`` with the line for every limit)."""
    return yaml.load(text, Loader=SafeYamlLoader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(path: str, exc: yaml.YAMLError) -> str:
    """One line for a YAML error of the file at ``path``: ``path:line:column: problem``."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        lines = str(exc).strip().splitlines()
        return f"{path}: invalid YAML: {lines[0].strip() if lines else type(exc).__name__}"
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or exc.context or "invalid YAML"
    if exc.problem and exc.context:
        context = exc.context
        if exc.context_mark is not None and exc.context_mark is not mark:
            context += f" started at line {exc.context_mark.line + 1}"
        problem = f"{problem} ({context})"
    if mark is None:
        return f"{path}: {problem}"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: {problem}"
