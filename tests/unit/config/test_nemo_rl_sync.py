"""NeMo-RL's recipes load as they are: every key they hold is known to the schema, with
NeMo-RL's type, and gets exactly one treatment.

The facts come from ``tests/unit/reference_configs/nemo_rl_keys.json`` (written by
``scripts/nemo_rl_keys.py`` at a named NeMo-RL commit: the key paths of NeMo-RL's exemplars and
of its Megatron grpo/sft/dpo/distillation recipes, with their types and some values) and from
unchanged copies of the exemplars in ``tests/unit/reference_configs/nemo_rl/``. A treatment is:

- ``implemented``: the key's name is read by the package (the schema walk's test) and it is
  not in the registry;
- ``warned`` / ``refused``: the key, or the section holding it, is in
  ``config/ignored_keys.py`` (a warning line, or an error naming what to set, at any value that
  is not inert).
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest
from pydantic import TypeAdapter, ValidationError

from nemo_rl_offload.config import ignored_keys
from nemo_rl_offload.config.environment import Capabilities
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.schema import MASTER_CONFIGS
from nemo_rl_offload.offload.capabilities import detect
from nemo_rl_offload.preflight import check_recipe

from .test_schema_walk import NOT_READERS, PACKAGE, string_literals

REFERENCE = Path(__file__).resolve().parents[1] / "reference_configs"
KEYS = json.loads((REFERENCE / "nemo_rl_keys.json").read_text())
EXEMPLARS = REFERENCE / "nemo_rl"
OPEN = "open"  # a path inside a section NeMo-RL leaves open


def _members(hint: Any) -> list[Any]:
    """The alternatives of a (NotRequired, Optional, union) annotation."""
    origin = get_origin(hint)
    if origin in (typing.NotRequired, typing.Required):
        return _members(get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in get_args(hint) for m in _members(arg)]
    return [hint]


def _is_open(cls: Any) -> bool:
    config = getattr(cls, "__pydantic_config__", None) or {}
    return config.get("extra") == "allow"


def schema_type(path: str) -> Any:
    """The schema's annotation of ``path`` (a union over the algorithms' master configs),
    ``OPEN`` inside an open section, or None when the schema does not know the path."""
    found: list[Any] = []
    for master in MASTER_CONFIGS.values():
        current: list[Any] = [master]
        for part in path.split("."):
            following: list[Any] = []
            for hint in current:
                for member in _members(hint):
                    if typing.is_typeddict(member):
                        hints = get_type_hints(member)
                        if part in hints:
                            following.append(hints[part])
                        elif _is_open(member):
                            following.append(OPEN)
                    elif member is OPEN or get_origin(member) is dict:
                        following.append(OPEN)
            current = following
            if not current:
                break
        found += current
    if not found:
        return None
    typed = [hint for hint in found if hint is not OPEN]
    return typed[0] if typed else OPEN


def registry_entries(path: str) -> list[str]:
    parts = path.split(".")
    prefixes = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return [prefix for prefix in prefixes if prefix in ignored_keys.IGNORED]


@pytest.fixture(scope="module")
def literals() -> set[str]:
    return string_literals(PACKAGE, NOT_READERS)


def treatment(path: str, literals: set[str]) -> str | None:
    """``implemented``, ``warned`` or ``refused``; None when the path has none (a failure)."""
    entries = registry_entries(path)
    if entries:
        return ignored_keys.IGNORED[entries[-1]].treatment
    if path.rpartition(".")[0] in ignored_keys.PASSED_THROUGH:
        return "implemented"  # the megatron-core dataclass takes the section whole
    # Inside an open section (env_vars, model_overrides) the section's reader takes every key.
    while schema_type(path) is OPEN:
        path = path.rpartition(".")[0]
    return "implemented" if path.rsplit(".", 1)[-1] in literals else None


def test_the_key_list_names_its_nemo_rl_commit():
    assert len(KEYS["nemo_rl_commit"]) == 40
    assert KEYS["paths"] and KEYS["recipes"]
    assert not [recipe for recipe in KEYS["recipes"] if "skipped" in recipe]


def test_every_nemo_rl_key_is_known_to_the_schema_with_nemo_rls_type():
    unknown, mistyped = [], []
    for path, facts in KEYS["paths"].items():
        hint = schema_type(path)
        if hint is None:
            unknown.append(path)
            continue
        if hint is OPEN:
            continue
        adapter = TypeAdapter(hint)
        for value in facts["values"]:
            try:
                adapter.validate_python(value, strict=True)
            except ValidationError:
                mistyped.append(f"{path}={value!r}")
    assert not unknown, f"NeMo-RL keys the schema does not know: {unknown}"
    assert not mistyped, f"NeMo-RL values the schema's type refuses: {mistyped}"


def test_every_nemo_rl_key_has_exactly_one_treatment(literals):
    none = [path for path in KEYS["paths"] if treatment(path, literals) is None]
    assert not none, f"NeMo-RL keys neither read by the package nor in the registry: {none}"
    doubled = [path for path in KEYS["paths"] if len(registry_entries(path)) > 1]
    assert not doubled, f"listed twice in the registry (a key and its section): {doubled}"


def test_a_typo_in_a_nemo_rl_section_still_fails_with_did_you_mean():
    from nemo_rl_offload.config.validate import schema_problems

    recipe = load_recipe(EXEMPLARS / "grpo_math_1B_megatron.yaml")
    recipe["grpo"]["overlong_filterin"] = False
    recipe["policy"]["sequence_packng"] = {"enabled": False}
    recipe["loss_fn"]["use_kl_in_rewards"] = False
    problems = schema_problems(recipe, "grpo")
    assert "grpo.overlong_filterin: unknown key; did you mean 'overlong_filtering'?" in problems
    assert any(p.startswith("policy.sequence_packng: unknown key; did you mean") for p in problems)
    assert any(
        p.startswith("loss_fn.use_kl_in_rewards: unknown key; did you mean") for p in problems
    )


# ------------------------------------------------------------------- the exemplars themselves

# Without Transformer Engine, as on this project's machines (sequence parallelism runs on the
# local layer spec).
_CAPS = Capabilities(
    megatron_version=detect().megatron_version,
    te_version=None,
    offload_module_names=detect().offload_module_names,
    offload_module_names_source=detect().offload_module_names_source,
)
_MISSING_MODEL = "is not on this machine"
# What each exemplar gets without the Hugging Face models (sequence parallelism runs on the
# local spec too). DTensor recipes run their DTensor settings on megatron-core
# (config/dtensor_recipes.py); their inactive megatron_cfg (dpo.yaml's tensor parallel size 2
# on one GPU, distillation's pipeline stages) gives nothing.
EXPECTED_ERRORS: dict[str, list[str]] = {
    "grpo_math_1B_megatron.yaml": [],
    "grpo_math_8B_megatron.yaml": [],
    "grpo_math_70B_megatron.yaml": [],
    "grpo_math_qwen30ba3b_megatron.yaml": [],
    "grpo_math_1B.yaml": [],
    "grpo_math_8B.yaml": [],
    "sft.yaml": [],
    "dpo.yaml": [],
    # Context parallelism (DTensor's and Megatron's), in policy and teacher.
    "distillation_math.yaml": [],
    "distillation_math_megatron.yaml": [],
}


@pytest.fixture(autouse=True)
def _no_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_the_exemplar_copies_are_the_ones_the_key_list_was_made_from():
    listed = {Path(r["file"]).name for r in KEYS["recipes"] if "/recipes/" not in r["file"]}
    assert listed == set(EXPECTED_ERRORS)
    assert {p.name for p in EXEMPLARS.glob("*.yaml")} == set(EXPECTED_ERRORS)


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_each_nemo_rl_exemplar_validates(name):
    recipe = load_recipe(EXEMPLARS / name)
    report = check_recipe(recipe, caps=_CAPS, megatron_crosscheck=False)
    expected = EXPECTED_ERRORS[name]
    assert len(report.errors) == len(expected), report.errors
    for line, start in zip(report.errors, expected, strict=True):
        assert line.startswith(start), (line, start)
    assert not any("unknown key" in line for line in report.errors)
    if not expected:
        # Only because the Hugging Face model is not on this machine, and said once.
        missing = [line for line in report.warnings if _MISSING_MODEL in line]
        assert len(missing) == 1 + ("teacher" in recipe), report.warnings
        assert missing[0].startswith("warning: policy.model_name: Hugging Face model")


@pytest.mark.parametrize(
    "name",
    ["grpo_math_1B.yaml", "grpo_math_8B.yaml", "sft.yaml", "dpo.yaml", "distillation_math.yaml"],
)
def test_a_dtensor_exemplar_says_once_per_section_that_it_runs_on_megatron_core(name):
    recipe = load_recipe(EXEMPLARS / name)
    report = check_recipe(recipe, caps=_CAPS, megatron_crosscheck=False)
    for where in ("policy", "teacher"):
        said = [
            line
            for line in report.warnings
            if line.startswith(f"warning: {where}.dtensor_cfg: NeMo-RL's DTensor settings run")
        ]
        assert len(said) == (where in recipe), report.warnings
        if where in recipe:
            assert report.recipe[where]["megatron_cfg"]["enabled"] is True


def test_a_dtensor_exemplar_with_cp_1_validates_as_the_issue_says():
    recipe = load_recipe(
        EXEMPLARS / "distillation_math.yaml",
        [
            "policy.dtensor_cfg.context_parallel_size=1",
            "teacher.dtensor_cfg.context_parallel_size=1",
        ],
    )
    report = check_recipe(recipe, caps=_CAPS, megatron_crosscheck=False)
    assert report.ok, report.errors


def test_a_dtensor_exemplar_switched_to_megatron_validates():
    recipe = load_recipe(
        EXEMPLARS / "grpo_math_1B.yaml",
        ["policy.dtensor_cfg.enabled=false", "policy.megatron_cfg.enabled=true"],
    )
    report = check_recipe(recipe, caps=_CAPS, megatron_crosscheck=False)
    assert report.ok, report.errors


def test_a_run_refuses_what_validate_only_warns_about():
    recipe = load_recipe(EXEMPLARS / "grpo_math_1B_megatron.yaml")
    report = check_recipe(recipe, caps=_CAPS, megatron_crosscheck=False, starting=True)
    assert any(line.startswith("policy.model_name: Hugging Face model") for line in report.errors)
    assert any(line.startswith("data.default.prompt_file: ") for line in report.errors)
    validated = check_recipe(
        load_recipe(EXEMPLARS / "grpo_math_1B_megatron.yaml"), caps=_CAPS, megatron_crosscheck=False
    )
    assert validated.ok and any(
        line.startswith("warning: data.default.prompt_file: ") for line in validated.warnings
    )
