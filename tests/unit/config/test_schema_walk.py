"""No accepted key is silently ignored: every key of every schema section (all four
algorithms' recipes, dotted paths) is read somewhere in the package, or listed in
``config.ignored_keys`` with the reason, which ``validate`` then reports.

"Read" means the key's name is a string literal of the package's code (``cfg.get("name")``,
``cfg["name"]``, a tuple of names), not counting ``schema.py`` (which declares the keys),
``ignored_keys.py`` (which lists them) and docstrings. The check is by name, so a key shares its
reader with keys of the same name in other sections.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any, NotRequired, TypedDict, get_type_hints

import pytest

from nemo_rl_offload.config import ignored_keys
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.schema import MASTER_CONFIGS
from nemo_rl_offload.config.validate import _typed_dict_members
from nemo_rl_offload.preflight import check_recipe

PACKAGE = Path(__file__).resolve().parents[3] / "nemo_rl_offload"
NOT_READERS = {PACKAGE / "config" / "schema.py", PACKAGE / "config" / "ignored_keys.py"}


def string_literals(root: Path, exclude: set[Path]) -> set[str]:
    """Every string constant of the package's code, docstrings left out."""
    found: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        if path in exclude:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        found |= {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        }
    return found


def schema_paths(cls: type, prefix: str = "") -> list[str]:
    """Every key of a TypedDict and of the sections it nests, as dotted paths."""
    paths = []
    for key, hint in get_type_hints(cls).items():
        path = f"{prefix}{key}"
        paths.append(path)
        for section in _typed_dict_members(hint):
            paths += schema_paths(section, f"{path}.")
    return paths


def _passed_through(path: str, passed_through: dict[str, str]) -> bool:
    section, _, key = path.rpartition(".")
    target = passed_through.get(section)
    if target is None:
        return False
    module, _, name = target.rpartition(".")
    return key in getattr(importlib.import_module(module), name).__annotations__


def unaccounted(
    masters: dict[str, type],
    literals: set[str],
    registry: dict[str, Any],
    passed_through: dict[str, str],
) -> list[str]:
    """The keys that no code reads and that the registry (a key or one of its parent
    sections) does not list."""
    missing = []
    for master in masters.values():
        for path in schema_paths(master):
            parents = {".".join(path.split(".")[:n]) for n in range(1, path.count(".") + 2)}
            if path.rsplit(".", 1)[-1] in literals or parents & registry.keys():
                continue
            if _passed_through(path, passed_through) or path in missing:
                continue
            missing.append(path)
    return missing


@pytest.fixture(scope="module")
def literals() -> set[str]:
    return string_literals(PACKAGE, NOT_READERS)


def test_every_schema_key_is_read_or_listed_as_ignored(literals):
    missing = unaccounted(
        MASTER_CONFIGS, literals, ignored_keys.IGNORED, ignored_keys.PASSED_THROUGH
    )
    assert not missing, (
        "accepted by the schema but neither read by the package nor listed in "
        f"config/ignored_keys.py: {missing}"
    )


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("checkpoint_must_save_by", "checkpointing.checkpoint_must_save_by"),
        ("logprob_batch_size", "policy.logprob_batch_size"),
        ("monitor_gpus", "logger.monitor_gpus"),
        ("num_val_samples_to_print", "logger.num_val_samples_to_print"),
        ("max_input_seq_length", "data.max_input_seq_length"),
    ],
)
def test_removing_a_keys_reader_fails_the_walk(literals, name, path):
    assert name in literals  # read today
    missing = unaccounted(
        MASTER_CONFIGS, literals - {name}, ignored_keys.IGNORED, ignored_keys.PASSED_THROUGH
    )
    assert path in missing


class _Inner(TypedDict):
    read_here: int
    zz_never_read: NotRequired[int]


class _Synthetic(TypedDict):
    section: _Inner
    zz_listed: NotRequired[bool]
    zz_listed_section: NotRequired[_Inner | None]


def test_the_walk_finds_an_unread_key_in_a_nested_section():
    literals = {"section", "read_here"}
    registry = {"zz_listed": "why", "zz_listed_section": "why"}
    assert unaccounted({"x": _Synthetic}, literals, registry, {}) == ["section.zz_never_read"]
    assert unaccounted({"x": _Synthetic}, literals, {}, {}) == [
        "section.zz_never_read",
        "zz_listed",
        "zz_listed_section",
        "zz_listed_section.zz_never_read",
    ]


def test_a_passed_through_section_is_read_by_its_dataclass_fields():
    ddp = "policy.megatron_cfg.distributed_data_parallel_config"
    pytest.importorskip("megatron.core")
    assert _passed_through(f"{ddp}.grad_reduce_in_fp32", ignored_keys.PASSED_THROUGH)
    assert not _passed_through(f"{ddp}.zz_not_a_field", ignored_keys.PASSED_THROUGH)


# --------------------------------------------------------------- the registry's validate lines


def test_a_listed_key_set_to_a_value_that_matters_warns():
    errors, warnings = ignored_keys.check({"policy": {"generation_batch_size": 32}})
    assert errors == []
    assert warnings == [
        "warning: policy.generation_batch_size: ignored by this backend: generation samples "
        "each data-parallel rank's prompts as one batch"
    ]


def test_a_listed_key_at_an_inert_value_says_nothing():
    recipe = {
        "policy": {"generation_batch_size": None, "generation": {"stop_strings": None}},
        "loss_fn": {"zero_outside_topk": True},  # no distillation.topk_logits_k: full vocabulary
        "grpo": {"max_rollout_turns": 1, "val_batch_size": 256, "max_val_samples": 256},
        "teacher": {"max_grad_norm": 1.0},
    }
    assert ignored_keys.check(recipe) == ([], [])


@pytest.mark.parametrize(
    ("recipe", "line"),
    [
        (
            {"loss_fn": {"zero_outside_topk": True}, "distillation": {"topk_logits_k": 64}},
            "loss_fn.zero_outside_topk: true is not supported by this backend",
        ),
        ({"grpo": {"max_rollout_turns": 2}}, "grpo.max_rollout_turns: 2 is not supported"),
        (
            {"policy": {"generation": {"stop_strings": ["\n"]}}},
            "stop tokens' ids in generation.stop_token_ids",
        ),
    ],
)
def test_a_listed_key_whose_ignoring_would_change_training_is_refused(recipe, line):
    errors, warnings = ignored_keys.check(recipe)
    assert len(errors) == 1 and line in errors[0], errors
    assert warnings == []


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_freeze_moe_router_is_implemented_not_listed(model):
    """It freezes an MoE model's routers (tests/unit/models/test_freeze_moe_router.py)."""
    recipe = {"policy": {"model_name": model, "megatron_cfg": {"freeze_moe_router": True}}}
    assert ignored_keys.check(recipe) == ([], [])


def _decode_graphs(model: str, **megatron_cfg: Any) -> dict[str, Any]:
    mcore = {"cuda_graph_impl": "local", "num_cuda_graphs": 4}
    return {
        "policy": {
            "model_name": model,
            "megatron_cfg": megatron_cfg,
            "generation": {"backend": "megatron", "mcore_generation_config": mcore},
        }
    }


@pytest.mark.parametrize(
    "recipe",
    [
        _decode_graphs("tiny-moe", expert_model_parallel_size=2),
        _decode_graphs("tiny-moe", model_overrides={"moe_expert_capacity_factor": 1.0}),
        _decode_graphs("tiny-moe")
        | {"policy": {**_decode_graphs("tiny-moe")["policy"], "router_replay": {"enabled": True}}},
        _decode_graphs("tiny-dense", pipeline_model_parallel_size=2),
        _decode_graphs("tiny-dense", tensor_model_parallel_size=2, sequence_parallel=True),
    ],
    ids=[
        "expert_parallel",
        "token_dropping",
        "recorded_routes",
        "pipeline",
        "sequence_parallel",
    ],
)
def test_decode_graphs_the_sampler_cannot_capture_are_warned(recipe):
    errors, warnings = ignored_keys.check(recipe)
    assert errors == []
    assert len(warnings) == 1, warnings
    assert "mcore_generation_config.cuda_graph_impl" in warnings[0]
    assert "decode steps run eagerly" in warnings[0]


@pytest.mark.parametrize(
    "recipe",
    [
        _decode_graphs("tiny-dense"),
        _decode_graphs("tiny-dense", tensor_model_parallel_size=2),
        _decode_graphs("tiny-moe"),  # the dense expert path (models/moe_decode.py)
        _decode_graphs("tiny-moe", model_overrides={"moe_grouped_gemm": True}),
        _decode_graphs("tiny-moe") | {"policy": {"model_name": "tiny-moe"}},
    ],
    ids=["dense", "tensor_parallel", "experts", "grouped_experts", "graphs_not_asked"],
)
def test_decode_graphs_that_run_or_are_not_asked_for_are_not_warned(recipe):
    assert ignored_keys.check(recipe) == ([], [])


def test_validate_reports_a_listed_key_of_a_whole_recipe():
    pytest.importorskip("megatron.core")
    recipe = load_recipe("examples/configs/tiny/sft.yaml", ["++policy.generation_batch_size=8"])
    report = check_recipe(recipe, megatron_crosscheck=False)
    assert report.ok, report.errors
    assert any(
        line.startswith("warning: policy.generation_batch_size:") for line in report.warnings
    )
    plain = check_recipe(load_recipe("examples/configs/tiny/sft.yaml"), megatron_crosscheck=False)
    assert not any("ignored by this backend" in line for line in plain.warnings), plain.warnings


@pytest.mark.parametrize(
    "key,value", [("moe_router_enable_expert_bias", True), ("moe_aux_loss_coeff", 0.01)]
)
@pytest.mark.parametrize("model,warned", [("tiny-moe", True), ("tiny-dense", False)])
def test_moe_keys_nemo_rl_does_not_read_warn_on_an_moe_model(key, value, model, warned):
    """NeMo-RL's Megatron setup reads neither key (the model's config decides): ignored with one
    warning naming model_overrides, never refused (its Nemotron-3 Super recipes set them)."""
    recipe = {"policy": {"model_name": model, "megatron_cfg": {key: value}}}
    errors, warnings = ignored_keys.check(recipe)
    assert errors == []
    assert len(warnings) == int(warned)
    if warned:
        assert f"model_overrides.{key}" in warnings[0]
