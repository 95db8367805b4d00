"""Each of these recipe keys has one reader (docs/architecture.md): the package reads it from a
recipe section in one module, and everything else takes the resolved settings. A second
``.get("key")`` or ``["key"]`` read elsewhere fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "nemo_rl_offload"
# The schema and the registry of NeMo-RL keys this backend leaves unused describe keys; the
# DTensor mapping copies sections key by key. None of them resolves a value.
DESCRIBE_KEYS = {"config/schema.py", "config/ignored_keys.py", "config/dtensor_recipes.py"}
# The one module that resolves each key, then the rules that validate the value as the recipe
# gave it (its type, its range, what it must agree with), which resolve nothing.
READERS = {
    "max_new_tokens": {"config/generation_settings.py", "config/value_bounds.py"},
    "sequence_packing": {"config/batching_settings.py", "config/megatron_rules.py"},
    "offload_modules": {"config/megatron_settings.py", "offload/rules.py"},
}
# Reads of the same name out of something that is not a recipe section.
NOT_A_SECTION = {
    "offload_modules": {
        "models/transformer_config.py",  # TransformerConfig's keyword arguments
        "telemetry.py",  # its own result record
    },
}


def _reads(path: Path, key: str) -> list[int]:
    """Lines where ``key`` is read out of a mapping (``.get(key)`` or a loaded subscript)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == key
        ) or (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.slice, ast.Constant)
            and node.slice.value == key
        ):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("key", sorted(READERS))
def test_a_key_is_read_in_its_one_module(key: str) -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in DESCRIBE_KEYS or relative in NOT_A_SECTION.get(key, ()):
            continue
        lines = _reads(path, key)
        if lines:
            found[relative] = lines
    assert set(found) <= READERS[key], {k: v for k, v in found.items() if k not in READERS[key]}
    assert found, f"{key}: its reader is gone; update READERS"


def test_the_scan_finds_a_read(tmp_path: Path) -> None:
    """The scan itself: a ``.get`` read and a subscript read are both found, a write is not."""
    path = tmp_path / "probe.py"
    path.write_text(
        'a = section.get("max_new_tokens")\nb = section["max_new_tokens"]\n'
        'section["max_new_tokens"] = 3\n'
    )
    assert _reads(path, "max_new_tokens") == [1, 2]
