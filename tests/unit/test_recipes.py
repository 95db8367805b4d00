"""The exemplar recipes under examples/configs: snapshots of their resolved content, the offload
keys they must spell out, and that every recipe shipped there passes the full preflight check."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_rl_offload.config import megatron_settings
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.model_presets import architecture_for

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
REFERENCES = Path(__file__).resolve().parent / "reference_configs"

# The exemplars NeMo-RL users copy from; each has a resolved snapshot in reference_configs/.
EXEMPLARS = (
    "grpo_math_1B",
    "grpo_math_1B_megatron",
    "sft",
    "dpo",
    "distillation_math",
    "distillation_math_megatron",
)
OFFLOAD_KEYS = (
    *megatron_settings.FGO_KEYS,
    *megatron_settings.CUDA_GRAPH_KEYS,
    "offload_host_memory_budget_gib",
)
ALL_RECIPES = sorted(CONFIGS.glob("**/*.yaml"))


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in path) or "<top level>"


def tree_differences(exemplar: Any, reference: Any, path: tuple[Any, ...] = ()) -> list[str]:
    """Every difference between two loaded YAML trees, one line each, starting with its dotted
    path. Scalars must match in type too (1, 1.0 and true are different recipe values)."""
    if isinstance(exemplar, dict) and isinstance(reference, dict):
        found: list[str] = []
        for key, value in exemplar.items():
            if key in reference:
                found += tree_differences(value, reference[key], (*path, key))
            else:
                found.append(
                    f"{_dotted((*path, key))}: in the exemplar ({value!r}) but missing from the "
                    "reference"
                )
        for key, value in reference.items():
            if key not in exemplar:
                found.append(
                    f"{_dotted((*path, key))}: in the reference ({value!r}) but gone from the "
                    "exemplar"
                )
        return found
    if isinstance(exemplar, list) and isinstance(reference, list):
        found = []
        for index, (mine, theirs) in enumerate(zip(exemplar, reference, strict=False)):
            found += tree_differences(mine, theirs, (*path, index))
        for index in range(len(reference), len(exemplar)):
            found.append(
                f"{_dotted((*path, index))}: in the exemplar ({exemplar[index]!r}) but missing "
                "from the reference"
            )
        for index in range(len(exemplar), len(reference)):
            found.append(
                f"{_dotted((*path, index))}: in the reference ({reference[index]!r}) but gone "
                "from the exemplar"
            )
        return found
    if type(exemplar) is not type(reference) or exemplar != reference:
        return [f"{_dotted(path)}: exemplar has {exemplar!r}, reference has {reference!r}"]
    return []


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict[str, Any]]:
    """Every recipe under examples/configs, loaded with defaults and interpolations resolved,
    keyed by its path relative to examples/configs without .yaml."""
    return {
        str(path.relative_to(CONFIGS).with_suffix("")): load_recipe(path) for path in ALL_RECIPES
    }


# ------------------------------------------------------------------------ reference snapshots


def test_every_exemplar_and_only_they_have_a_reference() -> None:
    assert sorted(path.stem for path in REFERENCES.glob("*.yaml")) == sorted(EXEMPLARS)
    missing = [name for name in EXEMPLARS if not (CONFIGS / f"{name}.yaml").is_file()]
    assert not missing, f"exemplar recipes missing from examples/configs: {missing}"


@pytest.mark.parametrize("name", EXEMPLARS)
def test_reference_is_a_marked_snapshot(name: str) -> None:
    text = (REFERENCES / f"{name}.yaml").read_text(encoding="utf-8")
    header = text.split("\n\n", 1)[0]
    assert header.startswith("# SNAPSHOT"), f"{name}.yaml lost its snapshot header"
    assert f"examples/configs/{name}.yaml" in header
    assert "refresh" in header


@pytest.mark.parametrize("name", EXEMPLARS)
def test_exemplar_matches_its_reference(name: str, resolved: dict[str, dict[str, Any]]) -> None:
    reference = yaml.safe_load((REFERENCES / f"{name}.yaml").read_text(encoding="utf-8"))
    differences = tree_differences(resolved[name], reference)
    assert not differences, (
        f"examples/configs/{name}.yaml no longer resolves to tests/unit/reference_configs/"
        f"{name}.yaml ({len(differences)} difference(s)); if the change is deliberate, refresh "
        "the reference as its header says:\n  " + "\n  ".join(differences)
    )


def test_tree_differences_reports_every_change_by_dotted_path(
    resolved: dict[str, dict[str, Any]],
) -> None:
    """The comparison above is only as good as this walk: it must see changed, removed and added
    keys, list elements and type-only changes, all at once."""
    reference = resolved["grpo_math_1B"]
    exemplar = copy.deepcopy(reference)
    megatron_cfg = exemplar["policy"]["megatron_cfg"]
    megatron_cfg["optimizer"]["lr"] = 1.0e-5  # value changed
    del exemplar["checkpointing"]["save_period"]  # key removed from the exemplar
    megatron_cfg["new_knob"] = 3  # key added to the exemplar
    megatron_cfg["cuda_graph_modules"] = ["attn"]  # list grew
    exemplar["policy"]["train_micro_batch_size"] = 4.0  # same number, other type
    exemplar["policy"]["megatron_cfg"]["sequence_parallel"] = 0  # bool became int

    differences = tree_differences(exemplar, reference)

    assert sorted(line.split(":", 1)[0] for line in differences) == sorted(
        [
            "policy.megatron_cfg.optimizer.lr",
            "checkpointing.save_period",
            "policy.megatron_cfg.new_knob",
            "policy.megatron_cfg.cuda_graph_modules.0",
            "policy.train_micro_batch_size",
            "policy.megatron_cfg.sequence_parallel",
        ]
    )
    by_path = {line.split(":", 1)[0]: line for line in differences}
    assert "gone from the exemplar" in by_path["checkpointing.save_period"]
    assert "missing from the reference" in by_path["policy.megatron_cfg.new_knob"]
    assert tree_differences(reference, copy.deepcopy(reference)) == []


# ------------------------------------------------------------------------ exemplar offload keys


@pytest.mark.parametrize("name", EXEMPLARS)
def test_exemplar_spells_out_every_offload_key(
    name: str, resolved: dict[str, dict[str, Any]]
) -> None:
    """Each exemplar names every offload knob in its own file (not only through defaults:), so
    users see them all, with offloading off and no modules listed."""
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text(encoding="utf-8"))
    megatron_cfg = raw.get("policy", {}).get("megatron_cfg", {})
    missing = [key for key in OFFLOAD_KEYS if key not in megatron_cfg]
    assert not missing, f"{name}.yaml: policy.megatron_cfg does not spell out {missing}"
    for cfg in (megatron_cfg, resolved[name]["policy"]["megatron_cfg"]):
        assert cfg["fine_grained_activation_offloading"] is False
        assert cfg["offload_modules"] is None


# ------------------------------------------------------------------------ every shipped recipe


@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda path: str(path.relative_to(CONFIGS)))
def test_recipe_passes_preflight(path: Path) -> None:
    from nemo_rl_offload.preflight import load_and_check

    report = load_and_check(path)
    assert report.ok, f"{path.relative_to(REPO)} is invalid:\n  " + "\n  ".join(report.errors)
    assert report.algorithm in ("sft", "dpo", "grpo", "distillation")


def test_examples_include_offloading_for_dense_and_moe(
    resolved: dict[str, dict[str, Any]],
) -> None:
    kinds: dict[str, list[str]] = {"dense": [], "moe": []}
    for name, recipe in resolved.items():
        policy = recipe["policy"]
        megatron_cfg = policy["megatron_cfg"]
        if megatron_cfg.get("fine_grained_activation_offloading") is not True:
            continue
        assert megatron_cfg.get("offload_modules"), f"{name}: FGO on with no offload_modules"
        experts = architecture_for(policy["model_name"], base_dir=REPO).num_moe_experts
        kinds["moe" if experts and experts > 1 else "dense"].append(name)
    assert kinds["dense"], f"no recipe with FGO on for a dense model (found: {kinds})"
    assert kinds["moe"], f"no recipe with FGO on for a MoE model (found: {kinds})"
