"""Every value bounded where the schema defines it (issue 45): each bound accepts its edge value
and refuses the value just past it in one line naming the key, the bound, the value and the fix;
the bounds one key sets for another (config/value_bounds.py) likewise; every violation is
reported at once, one line each, and ``validate`` prints them without a traceback."""

from __future__ import annotations

import copy
import json
import typing
from io import StringIO
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import pytest
from pydantic import TypeAdapter, ValidationError

from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.schema import MASTER_CONFIGS, MAX_COUNT, MAX_SEED
from nemo_rl_offload.config.validate import _members, schema_problems

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny"
MCFG = "policy.megatron_cfg"
OPT = f"{MCFG}.optimizer"
GEN = "policy.generation"
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def tiny() -> dict[str, dict[str, Any]]:
    names = ("grpo", "sft", "dpo", "distillation")
    return {name: load_recipe(TINY / f"{name}.yaml") for name in names}


def with_value(recipe: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of ``recipe`` with ``dotted`` set to ``value`` (sections made where missing)."""
    recipe = copy.deepcopy(recipe)
    *parents, last = dotted.split(".")
    node = recipe
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return recipe


def lines_for(recipe: dict[str, Any], dotted: str, algorithm: str = "grpo") -> list[str]:
    """schema_problems' lines about ``dotted`` or a key under it (a bad value elsewhere is not
    this test's)."""
    return [
        line
        for line in schema_problems(recipe, algorithm)
        if line.startswith((f"{dotted}:", f"{dotted}."))
    ]


# key, values accepted at the edge, values just past it, the start of the refusal's message
BOUNDS = [
    ("grpo.num_prompts_per_step", [1, MAX_COUNT], [0, -1], "must be at least 1"),
    ("grpo.num_generations_per_prompt", [1], [0], "must be at least 1"),
    ("grpo.max_num_steps", [1], [-1, 0], "must be at least 1"),
    ("grpo.max_num_epochs", [1], [0], "must be at least 1"),
    ("grpo.val_period", [0, -1, 1], [-2], "must be at least -1"),
    ("grpo.val_batch_size", [1, None], [0], "must be at least 1"),
    ("grpo.seed", [0, MAX_SEED], [-1], "must be at least 0"),
    ("grpo.seed", [], [MAX_SEED + 1], f"must be at most {MAX_SEED}"),
    ("policy.train_global_batch_size", [1, MAX_COUNT], [0, -8], "must be at least 1"),
    ("policy.train_global_batch_size", [], [MAX_COUNT + 1], f"must be at most {MAX_COUNT}"),
    ("policy.train_micro_batch_size", [1], [0, -1], "must be at least 1"),
    ("policy.train_micro_batch_size", [], [10**26], f"must be at most {MAX_COUNT}"),
    ("policy.generation_batch_size", [1], [0], "must be at least 1"),
    ("policy.max_total_sequence_length", [8, MAX_COUNT], [0, -4], "must be at least 1"),
    (f"{GEN}.max_new_tokens", [1], [0, -1], "must be at least 1"),
    (f"{GEN}.temperature", [1e-6, 2.0], [0.0, -1.0], "must be more than 0"),
    (f"{GEN}.temperature", [], [NAN, INF], "must be a finite number"),
    (f"{GEN}.top_p", [1.0, 1e-6], [0.0], "must be more than 0"),
    (f"{GEN}.top_p", [], [1.0000001, 5.0], "must be at most 1"),
    (f"{GEN}.top_k", [-1, None, 1, 50], [-2], "must be at least -1"),
    (f"{GEN}.top_k", [], [0], "0 keeps no token"),
    (f"{GEN}.val_top_k", [], [0], "0 keeps no token"),
    (f"{OPT}.lr", [1e-30, 1.0], [0.0, -5e-6], "must be more than 0"),
    (f"{OPT}.lr", [], [NAN, INF, -INF], "must be a finite number"),
    (f"{OPT}.min_lr", [0.0], [-1e-9], "must be at least 0"),
    (f"{OPT}.weight_decay", [0.0], [-0.01], "must be at least 0"),
    (f"{OPT}.adam_beta1", [0.0, 0.999], [-0.1], "must be at least 0"),
    (f"{OPT}.adam_beta2", [], [1.0], "must be less than 1"),
    (f"{OPT}.adam_eps", [1e-30], [0.0], "must be more than 0"),
    (f"{OPT}.clip_grad", [0.0, 1.0, None], [-1.0], "must be at least 0"),  # 0: off (NeMo-RL's)
    (f"{OPT}.optimizer_offload_fraction", [0.0, 1.0], [1.5, -0.5], "must be"),
    (f"{MCFG}.scheduler.lr_warmup_iters", [0], [-1], "must be at least 0"),
    (f"{MCFG}.scheduler.lr_decay_iters", [1, None], [0], "must be at least 1"),
    (f"{MCFG}.tensor_model_parallel_size", [1], [0], "must be at least 1"),
    ("cluster.num_cpu_workers", [1], [0, -2], "must be at least 1"),
    ("cluster.gpus_per_node", [0], [-1], "must be at least 0"),  # 0: CPU workers
    ("cluster.num_nodes", [1], [0], "must be at least 1"),
    ("cluster.master_port_range_low", [1, 65535], [0], "must be at least 1"),
    ("cluster.master_port_range_high", [], [65536], "must be at most 65535"),
    ("checkpointing.save_period", [1], [0, -5], "must be at least 1"),
    ("checkpointing.keep_top_k", [1, None], [-3, 0], "must be at least 1"),
    ("data.num_train_samples", [1], [0], "must be at least 1"),
    ("data.num_val_samples", [0], [-1], "must be at least 0"),
    ("data.max_input_seq_length", [MAX_COUNT, None], [MAX_COUNT + 1], "must be at most"),
    ("loss_fn.reference_policy_kl_penalty", [0.0], [-0.01], "must be at least 0"),
    ("loss_fn.ratio_clip_max", [], [NAN], "must be a finite number"),
    ("grpo.advantage_clip_low", [-100.0, None], [-INF], "must be a finite number"),
]


@pytest.mark.parametrize(
    "key,good,bad,message", BOUNDS, ids=[f"{row[0]}:{row[3]}" for row in BOUNDS]
)
def test_each_bound_accepts_its_edge_and_refuses_past_it(tiny, key, good, bad, message):
    for value in good:
        assert lines_for(with_value(tiny["grpo"], key, value), key) == [], (key, value)
    for value in bad:
        lines = lines_for(with_value(tiny["grpo"], key, value), key)
        assert len(lines) == 1, (key, value, lines)
        assert lines[0].startswith(f"{key}: {message}"), lines
        assert "\n" not in lines[0]


def test_a_bound_line_names_the_value_and_the_fix(tiny):
    (line,) = lines_for(with_value(tiny["grpo"], "grpo.num_prompts_per_step", 0), "grpo")
    assert line == (
        f"grpo.num_prompts_per_step: must be at least 1 (got: 0); set a positive count (1 to "
        f"{MAX_COUNT})"
    )
    (line,) = lines_for(with_value(tiny["grpo"], f"{OPT}.lr", NAN), OPT)
    assert line == f"{OPT}.lr: must be a finite number (got: nan); set a finite number above 0"
    (line,) = lines_for(with_value(tiny["grpo"], f"{GEN}.top_p", 5.0), GEN)
    assert (
        line
        == f"{GEN}.top_p: must be at most 1 (got: 5.0); set a number above 0, at most 1 (1: off)"
    )


def test_a_bound_inside_a_list_names_the_item(tiny):
    key = f"{MCFG}.offload_sequence_length_buckets"
    recipe = with_value(tiny["grpo"], key, [64, 10**13])
    assert lines_for(recipe, key) == [
        f"{key}.1: must be at most {MAX_COUNT} (got: 10000000000000); set a value from "
        f"-{MAX_COUNT} to {MAX_COUNT}"
    ]


def test_the_teachers_section_is_bounded_as_the_policys(tiny):
    recipe = with_value(tiny["distillation"], "teacher.train_micro_batch_size", 0)
    recipe = with_value(recipe, "teacher.megatron_cfg.optimizer", {"optimizer": "adam", "lr": 1.0})
    recipe = with_value(recipe, "teacher.megatron_cfg.optimizer.min_lr", 2.0)
    assert lines_for(recipe, "teacher", "distillation") == [
        "teacher.train_micro_batch_size: must be at least 1 (got: 0); set a positive count (1 to "
        f"{MAX_COUNT})",
        "teacher.megatron_cfg.optimizer.min_lr: 2 is above lr 1 (the schedule decays from lr down "
        "to min_lr); set it to at most 1",
    ]


# ------------------------------------------------------------------------- one key, another


CROSS = [
    # key set, edge accepted, just past it, the key the line names, its start
    (f"{OPT}.min_lr", 1.0e-4, 1.1e-4, f"{OPT}.min_lr", "0.00011 is above lr 0.0001"),
    ("policy.train_micro_batch_size", 256, 257, "policy.train_micro_batch_size", "257 is more"),
    (f"{GEN}.max_new_tokens", 64, 65, f"{GEN}.max_new_tokens", "65 is more than"),
    ("cluster.master_port_range_low", 2000, 2001, "cluster.master_port_range_low", "2001 is above"),
]


@pytest.mark.parametrize("key,edge,past,named,start", CROSS, ids=[row[0] for row in CROSS])
def test_a_value_another_key_bounds(tiny, key, edge, past, named, start):
    """tiny grpo: lr 1e-4, train_global_batch_size 256, max_total_sequence_length 64; the
    port range's high end is set to 2000 here. Equal is accepted (NeMo-RL's recipes set
    max_new_tokens to max_total_sequence_length itself)."""
    base = with_value(tiny["grpo"], "cluster.master_port_range_high", 2000)
    assert lines_for(with_value(base, key, edge), named) == []
    (line,) = lines_for(with_value(base, key, past), named)
    assert line.startswith(f"{named}: {start}") and "; set it to at most" in line


@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
def test_a_validation_micro_batch_within_its_batch(tiny, algorithm):
    recipe = with_value(tiny[algorithm], f"{algorithm}.val_global_batch_size", 8)
    key = f"{algorithm}.val_micro_batch_size"
    assert lines_for(with_value(recipe, key, 8), key, algorithm) == []
    (line,) = lines_for(with_value(recipe, key, 9), key, algorithm)
    assert line.startswith(f"{key}: 9 is more than val_global_batch_size 8")


def test_a_value_the_schema_refuses_gets_no_second_line(tiny):
    """min_lr against a NaN lr, or a micro-batch of 1e26 against its batch: the schema's
    line only."""
    recipe = with_value(tiny["grpo"], f"{OPT}.lr", NAN)
    assert lines_for(recipe, f"{OPT}.min_lr") == []
    recipe = with_value(tiny["grpo"], "policy.train_micro_batch_size", 10**26)
    assert len(lines_for(recipe, "policy.train_micro_batch_size")) == 1


def test_every_violation_at_once_one_line_each(tiny):
    bad = {
        "grpo.num_prompts_per_step": 0,
        "grpo.max_num_steps": -1,
        f"{OPT}.lr": NAN,
        "cluster.num_cpu_workers": 0,
        "checkpointing.save_period": 0,
        "checkpointing.keep_top_k": -3,
        "policy.max_total_sequence_length": -4,
        f"{GEN}.top_k": 0,
    }
    recipe = tiny["grpo"]
    for key, value in bad.items():
        recipe = with_value(recipe, key, value)
    lines = schema_problems(recipe, "grpo")
    assert sorted(line.split(":", 1)[0] for line in lines) == sorted(bad)


# ----------------------------------------------------------------------- validate end to end


def validate(*args: str) -> tuple[int, str]:
    from nemo_rl_offload.cli import main

    out, err = StringIO(), StringIO()
    code = main(["validate", "--no-estimate", *args], out=out, err=err)
    assert "Traceback" not in out.getvalue() + err.getvalue()
    return code, err.getvalue()


def test_validate_prints_six_lines_for_six_bad_overrides():
    """The issue's probe: six bad overrides gave one line, naming a different key."""
    overrides = {
        "grpo.num_prompts_per_step": "0",
        "grpo.max_num_steps": "-1",
        f"{OPT}.lr": "nan",
        "cluster.num_cpu_workers": "0",
        "checkpointing.save_period": "0",
        "checkpointing.keep_top_k": "-3",
    }
    code, err = validate(
        "--config", str(TINY / "grpo.yaml"), *(f"{k}={v}" for k, v in overrides.items())
    )
    lines = [line for line in err.splitlines() if not line.startswith("warning:")]
    assert code == 2
    assert len(lines) == 6, lines
    assert sorted(line.split(":", 1)[0] for line in lines) == sorted(overrides)


@pytest.mark.parametrize(
    "override,line",
    [
        (
            "policy.train_micro_batch_size=100000000000000000000000000",
            f"policy.train_micro_batch_size: must be at most {MAX_COUNT} (got: "
            f"100000000000000000000000000); set a positive count (1 to {MAX_COUNT})",
        ),
        (
            f"{OPT}.lr=-5e-6",
            f"{OPT}.lr: must be more than 0 (got: -5e-06); set a finite number above 0",
        ),
    ],
)
def test_validate_refuses_an_impossible_number_in_one_line(override, line):
    code, err = validate("--config", str(TINY / "grpo.yaml"), override)
    assert code == 2
    assert [e for e in err.splitlines() if not e.startswith("warning:")] == [line]


def test_validate_still_accepts_the_tiny_recipes_at_the_edges():
    code, err = validate(
        "--config",
        str(TINY / "grpo.yaml"),
        f"{GEN}.max_new_tokens=64",  # = max_total_sequence_length
        "++policy.generation.top_k=-1",
        "checkpointing.keep_top_k=null",
        f"{OPT}.clip_grad=0.0",
        "grpo.val_period=-1",
    )
    assert code == 0, err


def bounded_types(path: str) -> list[Any]:
    """The schema's annotations of ``path`` over the master configs, bounds kept (Annotated)."""
    found: list[Any] = []
    for master in MASTER_CONFIGS.values():
        current: list[Any] = [master]
        for part in path.split("."):
            following = []
            for hint in current:
                for member in _members(hint):
                    base = get_args(member)[0] if get_origin(member) is Annotated else member
                    if typing.is_typeddict(base):
                        hints = get_type_hints(base, include_extras=True)
                        following += [hints[part]] if part in hints else []
            current = following
        found += current
    return found


def test_nemo_rls_recorded_values_are_within_the_bounds():
    """Every value NeMo-RL's recipes hold (the committed key list, 104 recipes) passes its
    key's bounds: none of NeMo-RL's recipes is refused for a number (e.g. clip_grad 0.0,
    val_period -1, lr_warmup_iters 0, keep_top_k 1000000 are all NeMo-RL's)."""
    keys = json.loads((REPO / "tests/unit/reference_configs/nemo_rl_keys.json").read_text())
    refused, checked = [], 0
    for path, facts in keys["paths"].items():
        types = [member for hint in bounded_types(path) for member in _members(hint)]
        if not types:
            continue  # an open section's key
        for value in facts["values"]:
            checked += 1
            if not any(_passes(tp, value) for tp in types):
                refused.append(f"{path}={value!r}")
    assert checked > 300 and not refused


def _passes(tp: Any, value: Any) -> bool:
    try:
        TypeAdapter(tp).validate_python(value, strict=True)
    except ValidationError:
        return False
    return True
