"""Write the key paths of NeMo-RL's recipes, with their types, as this project's sync data.

Why: users bring NeMo-RL's own recipes, so every key they hold must be known to this backend's
schema and get exactly one treatment (config/ignored_keys.py). The recipe files live in
NeMo-RL's repository, which CI does not have; this script extracts the facts once, at a named
NeMo-RL commit, into ``tests/unit/reference_configs/nemo_rl_keys.json``, and
``tests/unit/config/test_nemo_rl_sync.py`` checks them against the schema and the registry.

Which recipes: NeMo-RL's exemplars for the four algorithms (``EXEMPLARS``) and every recipe
under ``examples/configs/recipes/llm/`` whose algorithm is grpo, sft, dpo or distillation and
that trains with the Megatron backend (``policy.megatron_cfg.enabled`` true once its
``defaults:`` chain is resolved). Each is loaded with this package's loader (defaults merged,
``${...}`` resolved); every leaf is recorded as a dotted path with the JSON types it holds and
up to a few of its distinct values (short ones only), so the test can check NeMo-RL's type.

Run from this repository's root, with a NeMo-RL checkout (or an extracted tree) at the commit:

    PYTHONPATH=. python scripts/nemo_rl_keys.py /path/to/NeMo-RL <commit> \\
        > tests/unit/reference_configs/nemo_rl_keys.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.loader import load_recipe, yaml_type
from nemo_rl_offload.errors import UserInputError

EXEMPLARS = (
    "grpo_math_1B",
    "grpo_math_1B_megatron",
    "grpo_math_8B",
    "grpo_math_8B_megatron",
    "grpo_math_70B_megatron",
    "grpo_math_qwen30ba3b_megatron",
    "sft",
    "dpo",
    "distillation_math",
    "distillation_math_megatron",
)
ALGORITHMS = ("grpo", "sft", "dpo", "distillation")
MAX_VALUES = 6  # distinct values kept per path
MAX_VALUE_CHARS = 120  # longer values are recorded by type only


def _leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
    """Dotted leaf paths; an empty mapping is a leaf (its key is still a key)."""
    if isinstance(node, dict) and node:
        found: list[tuple[str, Any]] = []
        for key, value in node.items():
            found += _leaves(value, f"{prefix}.{key}" if prefix else str(key))
        return found
    return [(prefix, node)]


def collect(root: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(recipes, paths) of the NeMo-RL tree at ``root``."""
    configs = root / "examples" / "configs"
    candidates = [configs / f"{name}.yaml" for name in EXEMPLARS]
    candidates += sorted((configs / "recipes" / "llm").glob("*.yaml"))
    recipes: list[dict[str, Any]] = []
    paths: dict[str, dict[str, Any]] = {}
    # Some recipes interpolate ${oc.env:HF_HOME}; its value does not matter for the keys.
    os.environ.setdefault("HF_HOME", "/hf_home")
    for path in candidates:
        relative = str(path.relative_to(root))
        try:
            recipe = load_recipe(path)
        except UserInputError as exc:
            recipes.append({"file": relative, "skipped": exc.problems[0]})
            continue
        algorithms = [name for name in ALGORITHMS if name in recipe]
        megatron = ((recipe.get("policy") or {}).get("megatron_cfg") or {}).get("enabled")
        exemplar = path.parent == configs
        if not algorithms or (not exemplar and megatron is not True):
            continue
        recipes.append({"file": relative, "algorithm": algorithms[0], "megatron": megatron is True})
        for dotted, value in _leaves(recipe, ""):
            entry = paths.setdefault(dotted, {"types": [], "values": [], "recipes": 0})
            entry["recipes"] += 1
            kind = "{}" if value == {} else yaml_type(value)
            if kind not in entry["types"]:
                entry["types"].append(kind)
            text = json.dumps(value, sort_keys=True)
            if (
                len(text) <= MAX_VALUE_CHARS
                and value not in entry["values"]
                and len(entry["values"]) < MAX_VALUES
            ):
                entry["values"].append(value)
    for entry in paths.values():
        entry["types"].sort()
    return recipes, dict(sorted(paths.items()))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} NEMO_RL_ROOT COMMIT", file=sys.stderr)
        return 2
    root, commit = Path(argv[1]), argv[2]
    recipes, paths = collect(root)
    json.dump(
        {
            "about": (
                "Key paths of NeMo-RL's grpo/sft/dpo/distillation recipes (exemplars, and the "
                "Megatron recipes of examples/configs/recipes/llm) after their defaults chains "
                "and interpolations are resolved: for each, the JSON types and a few values it "
                "holds, and in how many recipes. Written by scripts/nemo_rl_keys.py; do not edit "
                "by hand."
            ),
            "nemo_rl_commit": commit,
            "command": "PYTHONPATH=. python scripts/nemo_rl_keys.py NEMO_RL_ROOT COMMIT",
            "recipes": recipes,
            "paths": paths,
        },
        sys.stdout,
        indent=1,
        sort_keys=False,
    )
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
