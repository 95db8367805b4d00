"""Recipe loading: YAML, defaults inheritance, overrides, interpolation."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_offload.config.loader import (
    apply_overrides,
    deep_merge,
    load_recipe,
    register_resolvers,
    resolve_interpolations,
)
from nemo_rl_offload.errors import UserInputError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def problems_of(path: Path | str, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(UserInputError) as info:
        load_recipe(path, overrides)
    return info.value.problems


def assert_plain(value: Any, where: str = "root") -> None:
    """Fail if anything in ``value`` is not a plain dict, list or scalar."""
    if isinstance(value, dict):
        assert type(value) is dict, f"{where}: {type(value)}"
        for key, item in value.items():
            assert type(key) in (str, int), f"{where}: key {key!r}"
            assert_plain(item, f"{where}.{key}")
    elif isinstance(value, list):
        assert type(value) is list, f"{where}: {type(value)}"
        for i, item in enumerate(value):
            assert_plain(item, f"{where}.{i}")
    else:
        assert value is None or type(value) in (bool, int, float, str), f"{where}: {type(value)}"


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return write(
        tmp_path / "recipe.yaml",
        """
        policy:
          model_name: meta-llama/Llama-3.2-1B
          precision: bf16
          train_micro_batch_size: 2
          max_total_sequence_length: 1024
          megatron_cfg:
            enabled: true
            fine_grained_activation_offloading: false
            offload_modules: [core_attn, attn_proj]
            tensor_model_parallel_size: 1
          scheduler:
            - name: torch.optim.lr_scheduler.LinearLR
              kwargs: {start_factor: 0.1, end_factor: 1.0}
            - name: torch.optim.lr_scheduler.ConstantLR
              kwargs: {factor: 1.0}
          optimizer:
            lr: 5.0e-6
            weight_decay: 0.01
        grpo:
          num_prompts_per_step: 32
          seed: 42
        logger:
          wandb_enabled: false
          name: null
        """,
    )


# ------------------------------------------------------------------------------------------------
# Reading YAML


def test_plain_load(recipe: Path) -> None:
    data = load_recipe(recipe)
    assert data["policy"]["model_name"] == "meta-llama/Llama-3.2-1B"
    assert data["policy"]["optimizer"]["lr"] == 5.0e-6
    assert data["policy"]["megatron_cfg"]["offload_modules"] == ["core_attn", "attn_proj"]
    assert data["logger"]["name"] is None
    assert_plain(data)


def test_accepts_path_as_string(recipe: Path) -> None:
    assert load_recipe(str(recipe)) == load_recipe(recipe)


def test_file_is_not_modified(recipe: Path) -> None:
    before = recipe.read_bytes()
    load_recipe(recipe, ["policy.precision=fp16", "+extra=1", "~grpo.seed"])
    assert recipe.read_bytes() == before
    assert sorted(p.name for p in recipe.parent.iterdir()) == ["recipe.yaml"]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert problems_of(path) == [f"{path}: no such recipe file"]


def test_directory_is_not_a_recipe(tmp_path: Path) -> None:
    [line] = problems_of(tmp_path)
    assert line.startswith(f"{tmp_path}: ")
    assert "directory" in line


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", "a: 1\nb: [1, 2\nc: 3\n")
    [line] = problems_of(path)
    assert line.startswith(f"{path}:3:2: ")
    assert "expected ',' or ']'" in line


def test_yaml_indentation_error_has_line(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", "a:\n  b: 1\n c: 2\n")
    [line] = problems_of(path)
    assert line.startswith(f"{path}:3:")


@pytest.mark.parametrize(("text", "kind"), [("- 1\n- 2\n", "a list"), ("just text\n", "text")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path / "r.yaml", text)
    assert problems_of(path) == [
        f"{path}: the top level must be a mapping of keys to values, not {kind}"
    ]


def test_empty_file_is_empty_recipe(tmp_path: Path) -> None:
    assert load_recipe(write(tmp_path / "r.yaml", "# nothing\n")) == {}


def test_unsupported_yaml_values_are_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path / "r.yaml", "run:\n  date: 2024-01-01\non: 1\n")
    problems = problems_of(path)
    assert len(problems) == 2
    assert problems[0].startswith(f"{path}: run.date: ")
    assert "date" in problems[0] and "quote it" in problems[0]
    assert problems[1].startswith(f"{path}: True: ")
    assert "boolean" in problems[1]


def test_numbers_read_as_nemo_rl_reads_them(tmp_path: Path) -> None:
    """NeMo-RL's recipes write ``adam_eps: 1e-8``: a float there (OmegaConf), so here too;
    quoted text and words that merely start like a number stay text."""
    path = write(
        tmp_path / "r.yaml",
        """
        eps: 1e-8
        rate: 1E-3
        big: +5e3
        dotted: 1.0e-5
        under: 1_0e2
        whole: 7
        quoted: "1e-3"
        word: 1e3x
        """,
    )
    data = load_recipe(path)
    assert data["eps"] == 1e-8 and type(data["eps"]) is float
    assert data["rate"] == 1e-3 and data["big"] == 5e3 and data["dotted"] == 1e-5
    assert data["under"] == 1000.0 and type(data["under"]) is float
    assert data["whole"] == 7 and type(data["whole"]) is int
    assert data["quoted"] == "1e-3" and data["word"] == "1e3x"


def test_anchors_and_merge_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path / "r.yaml",
        """
        base: &base
          lr: 1.0e-5
          betas: [0.9, 0.95]
        actor:
          <<: *base
          lr: 2.0e-5
        critic: *base
        """,
    )
    data = load_recipe(path)
    assert data["actor"] == {"lr": 2.0e-5, "betas": [0.9, 0.95]}
    assert data["critic"] == {"lr": 1.0e-5, "betas": [0.9, 0.95]}


def test_override_of_an_aliased_node_changes_only_that_place(tmp_path: Path) -> None:
    path = write(
        tmp_path / "r.yaml",
        """
        base: &base {lr: 1, betas: [1, 2]}
        critic: *base
        """,
    )
    data = load_recipe(path, ["critic.lr=5", "critic.betas.0=7"])
    assert data["critic"] == {"lr": 5, "betas": [7, 2]}
    assert data["base"] == {"lr": 1, "betas": [1, 2]}


# ------------------------------------------------------------------------------------------------
# defaults inheritance


def test_three_level_chain_across_directories(tmp_path: Path) -> None:
    write(
        tmp_path / "examples" / "configs" / "grpo_math_1B.yaml",
        """
        policy:
          precision: bf16
          lr: 1.0
          modules: [a, b, c]
          megatron_cfg: {tp: 1, pp: 1}
        grpo: {seed: 1}
        from_root: root
        """,
    )
    write(
        tmp_path / "examples" / "configs" / "megatron" / "grpo_megatron.yaml",
        """
        defaults: ../grpo_math_1B.yaml
        policy:
          lr: 2.0
          megatron_cfg: {pp: 2, cp: 1}
        from_middle: middle
        """,
    )
    leaf = write(
        tmp_path / "recipes" / "llm" / "leaf.yaml",
        """
        defaults: ../../examples/configs/megatron/grpo_megatron.yaml
        policy:
          modules: [x]
          megatron_cfg: {tp: 4}
        grpo: {seed: 3}
        """,
    )
    data = load_recipe(leaf)
    assert data == {
        "policy": {
            "precision": "bf16",
            "lr": 2.0,
            "modules": ["x"],
            "megatron_cfg": {"tp": 4, "pp": 2, "cp": 1},
        },
        "grpo": {"seed": 3},
        "from_root": "root",
        "from_middle": "middle",
    }
    assert "defaults" not in data


def test_relative_defaults_do_not_depend_on_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "cfg" / "parent.yaml", "a: 1\nb: 1\n")
    write(tmp_path / "cfg" / "child.yaml", "defaults: parent.yaml\nb: 2\n")
    monkeypatch.chdir(tmp_path)
    assert load_recipe("cfg/child.yaml") == {"a": 1, "b": 2}
    monkeypatch.chdir(tmp_path / "cfg")
    assert load_recipe("child.yaml") == {"a": 1, "b": 2}


def test_absolute_default_path(tmp_path: Path) -> None:
    parent = write(tmp_path / "elsewhere" / "p.yaml", "a: 1\n")
    child = write(tmp_path / "c" / "child.yaml", f"defaults: {parent}\nb: 2\n")
    assert load_recipe(child) == {"a": 1, "b": 2}


def test_list_defaults_merge_in_order(tmp_path: Path) -> None:
    write(tmp_path / "one.yaml", "x: one\nonly_one: 1\nd: {k1: 1, k: one}\n")
    write(tmp_path / "two.yaml", "x: two\nonly_two: 2\nd: {k2: 2, k: two}\n")
    child = write(tmp_path / "child.yaml", "defaults: [one.yaml, two.yaml]\n")
    assert load_recipe(child) == {
        "x": "two",
        "only_one": 1,
        "only_two": 2,
        "d": {"k1": 1, "k": "two", "k2": 2},
    }
    swapped = write(tmp_path / "swapped.yaml", "defaults: [two.yaml, one.yaml]\n")
    assert load_recipe(swapped)["x"] == "one"
    assert load_recipe(swapped)["d"]["k"] == "one"


def test_child_wins_over_parents(tmp_path: Path) -> None:
    write(
        tmp_path / "p.yaml",
        "s: parent\nl: [1, 2, 3]\nd: {a: 1, b: {c: 1, d: 1}}\nn: {x: 1}\nv: 1\n",
    )
    child = write(
        tmp_path / "c.yaml",
        "defaults: p.yaml\ns: child\nl: [9]\nd: {b: {c: 2}, e: 5}\nn: null\nv: {now: dict}\n",
    )
    assert load_recipe(child) == {
        "s": "child",
        "l": [9],
        "d": {"a": 1, "b": {"c": 2, "d": 1}, "e": 5},
        "n": None,
        "v": {"now": "dict"},
    }


def test_diamond_is_not_a_cycle(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "a: 1\n")
    write(tmp_path / "l.yaml", "defaults: base.yaml\nl: 1\n")
    write(tmp_path / "r.yaml", "defaults: base.yaml\nr: 1\n")
    top = write(tmp_path / "top.yaml", "defaults: [l.yaml, r.yaml]\n")
    assert load_recipe(top) == {"a": 1, "l": 1, "r": 1}


def test_cycle_names_the_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "a.yaml", "defaults: b.yaml\nx: 1\n")
    write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    monkeypatch.chdir(tmp_path)
    assert problems_of("a.yaml") == ["b.yaml: defaults form a cycle: a.yaml -> b.yaml -> a.yaml"]


def test_self_cycle(tmp_path: Path) -> None:
    path = write(tmp_path / "self.yaml", "defaults: self.yaml\n")
    assert problems_of(path) == [f"{path}: defaults form a cycle: {path} -> {path}"]


def test_missing_parent_names_the_referencing_file(tmp_path: Path) -> None:
    write(tmp_path / "ok.yaml", "defaults: sub/missing.yaml\n")
    child = write(tmp_path / "child.yaml", "defaults: ok.yaml\n")
    [line] = problems_of(child)
    assert line.startswith(f"{tmp_path / 'ok.yaml'}: ")
    assert "'sub/missing.yaml' does not exist" in line
    assert str(tmp_path / "sub" / "missing.yaml") in line


@pytest.mark.parametrize(
    ("defaults", "fragment"),
    [
        ("5", "defaults: must be a file path or a list of file paths, not an integer"),
        ("{a: b}", "defaults: must be a file path or a list of file paths, not a mapping"),
        ("[p.yaml, 3]", "defaults.1: must be a file path (text), not an integer"),
        ("[{policy: x}]", "Hydra-style group defaults are not supported"),
        ("['']", "defaults.0: empty file path"),
    ],
)
def test_bad_defaults_value(tmp_path: Path, defaults: str, fragment: str) -> None:
    write(tmp_path / "p.yaml", "a: 1\n")
    child = write(tmp_path / "c.yaml", f"defaults: {defaults}\n")
    [line] = problems_of(child)
    assert line.startswith(f"{child}: defaults")
    assert fragment in line


def test_syntax_error_in_parent_names_the_parent(tmp_path: Path) -> None:
    parent = write(tmp_path / "p.yaml", "a: [1\n")
    child = write(tmp_path / "c.yaml", "defaults: p.yaml\n")
    [line] = problems_of(child)
    assert line.startswith(f"{parent}:2:")


# ------------------------------------------------------------------------------------------------
# deep_merge


def test_deep_merge_is_pure() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "k": 1}
    override = {"a": {"b": 2, "d": {"e": 3}}, "n": [4]}
    result = deep_merge(base, override)
    assert result == {"a": {"b": 2, "c": [1, 2], "d": {"e": 3}}, "k": 1, "n": [4]}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "k": 1}
    assert override == {"a": {"b": 2, "d": {"e": 3}}, "n": [4]}
    result["a"]["c"].append(3)
    result["a"]["d"]["e"] = 0
    result["n"].append(5)
    assert base["a"]["c"] == [1, 2]
    assert override["a"]["d"] == {"e": 3}
    assert override["n"] == [4]


def test_deep_merge_replaces_non_mappings() -> None:
    assert deep_merge({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}
    assert deep_merge({"a": {"x": 1}}, {"a": 5}) == {"a": 5}
    assert deep_merge({"a": 5}, {"a": {"x": 1}}) == {"a": {"x": 1}}
    assert deep_merge({"a": {"x": 1}}, {"a": None}) == {"a": None}


# ------------------------------------------------------------------------------------------------
# Overrides


def test_set_values_of_every_type(recipe: Path) -> None:
    data = load_recipe(
        recipe,
        [
            "logger.name=null",
            "logger.wandb_enabled=true",
            "policy.megatron_cfg.enabled=false",
            "grpo.seed=7",
            "policy.optimizer.lr=1e-5",
            "policy.optimizer.weight_decay=5.0e-6",
            "policy.megatron_cfg.offload_modules=[core_attn,attn_proj, moe_act]",
            "policy.model_name='123'",
            'policy.precision="b f 16"',
            "grpo.num_prompts_per_step=",
            "policy.scheduler=[]",
            "policy.megatron_cfg.tensor_model_parallel_size={a: 1, b: x}",
        ],
    )
    assert data["logger"]["name"] is None
    assert data["logger"]["wandb_enabled"] is True
    assert data["policy"]["megatron_cfg"]["enabled"] is False
    assert data["grpo"]["seed"] == 7 and type(data["grpo"]["seed"]) is int
    assert data["policy"]["optimizer"]["lr"] == 1e-5
    assert data["policy"]["optimizer"]["weight_decay"] == 5.0e-6
    assert data["policy"]["megatron_cfg"]["offload_modules"] == [
        "core_attn",
        "attn_proj",
        "moe_act",
    ]
    assert data["policy"]["model_name"] == "123"
    assert data["policy"]["precision"] == "b f 16"
    assert data["grpo"]["num_prompts_per_step"] == ""
    assert data["policy"]["scheduler"] == []
    assert data["policy"]["megatron_cfg"]["tensor_model_parallel_size"] == {"a": 1, "b": "x"}


def test_set_nested_list_value(recipe: Path) -> None:
    data = load_recipe(recipe, ["policy.megatron_cfg.offload_modules=[[1, 2], [a]]"])
    assert data["policy"]["megatron_cfg"]["offload_modules"] == [[1, 2], ["a"]]


def test_value_may_contain_equals(recipe: Path) -> None:
    data = load_recipe(recipe, ["logger.name=run=1_lr=2e-5"])
    assert data["logger"]["name"] == "run=1_lr=2e-5"


def test_add_creates_parents(recipe: Path) -> None:
    data = load_recipe(recipe, ["+policy.megatron_cfg.new_key=3", "+brand.new.section=x"])
    assert data["policy"]["megatron_cfg"]["new_key"] == 3
    assert data["brand"] == {"new": {"section": "x"}}


def test_force_sets_and_adds(recipe: Path) -> None:
    data = load_recipe(recipe, ["++grpo.seed=9", "++grpo.extra.deep=true"])
    assert data["grpo"] == {"num_prompts_per_step": 32, "seed": 9, "extra": {"deep": True}}


def test_delete(recipe: Path) -> None:
    data = load_recipe(recipe, ["~grpo.seed", "~policy.megatron_cfg"])
    assert data["grpo"] == {"num_prompts_per_step": 32}
    assert "megatron_cfg" not in data["policy"]


def test_delete_with_matching_value(recipe: Path) -> None:
    data = load_recipe(recipe, ["~grpo.seed=42"])
    assert "seed" not in data["grpo"]


def test_delete_with_other_value_is_an_error(recipe: Path) -> None:
    assert problems_of(recipe, ("~grpo.seed=41",)) == [
        "~grpo.seed=41: grpo.seed is 42, not 41; not deleted"
    ]
    assert problems_of(recipe, ("~logger.wandb_enabled=0",)) == [
        "~logger.wandb_enabled=0: logger.wandb_enabled is False, not 0; not deleted"
    ]


def test_delete_missing_key_is_an_error(recipe: Path) -> None:
    assert problems_of(recipe, ("~grpo.sed",)) == [
        "~grpo.sed: no such key 'sed' in grpo; did you mean 'seed'? (nothing to delete)"
    ]


def test_overrides_apply_in_order(recipe: Path) -> None:
    data = load_recipe(recipe, ["grpo.seed=1", "grpo.seed=2", "+new=1", "~new", "++new=3"])
    assert data["grpo"]["seed"] == 2
    assert data["new"] == 3


def test_typo_suggests_closest_key(recipe: Path) -> None:
    text = "policy.megatron_cfg.fine_grained_activation_offload=true"
    assert problems_of(recipe, (text,)) == [
        f"{text}: no such key 'fine_grained_activation_offload' in policy.megatron_cfg; "
        "did you mean 'fine_grained_activation_offloading'? (use +key=value to add a new key)"
    ]


def test_typo_in_a_parent_key(recipe: Path) -> None:
    [line] = problems_of(recipe, ("polcy.precision=fp16",))
    assert line == (
        "polcy.precision=fp16: no such key 'polcy' in the top level of the recipe; "
        "did you mean 'policy'? (use +key=value to add a new key)"
    )


def test_set_missing_key_without_close_match(recipe: Path) -> None:
    assert problems_of(recipe, ("grpo.zzzzzz=1",)) == [
        "grpo.zzzzzz=1: no such key 'zzzzzz' in grpo (use +key=value to add a new key)"
    ]


def test_add_existing_key_is_an_error(recipe: Path) -> None:
    [line] = problems_of(recipe, ("+grpo.seed=3",))
    assert line.startswith("+grpo.seed=3: grpo.seed already exists; ")
    assert "grpo.seed=3" in line.split("already exists")[1]
    assert "++grpo.seed=3" in line


def test_setting_through_a_non_mapping_is_an_error(recipe: Path) -> None:
    for text in ("grpo.seed.x=1", "+grpo.seed.x=1", "++grpo.seed.x.y=1", "~grpo.seed.x"):
        assert problems_of(recipe, (text,)) == [
            f"{text}: grpo.seed is 42 (an integer), not a mapping, so it has no key 'x'"
        ]


def test_list_index_override(recipe: Path) -> None:
    data = load_recipe(
        recipe,
        [
            "policy.scheduler.0.kwargs.start_factor=2",
            "++policy.scheduler.1.kwargs.factor=0.5",
            "policy.megatron_cfg.offload_modules.1=mlp",
        ],
    )
    assert data["policy"]["scheduler"][0]["kwargs"] == {"start_factor": 2, "end_factor": 1.0}
    assert data["policy"]["scheduler"][1]["kwargs"] == {"factor": 0.5}
    assert data["policy"]["megatron_cfg"]["offload_modules"] == ["core_attn", "mlp"]


def test_list_element_delete(recipe: Path) -> None:
    data = load_recipe(recipe, ["~policy.megatron_cfg.offload_modules.0"])
    assert data["policy"]["megatron_cfg"]["offload_modules"] == ["attn_proj"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("policy.scheduler.2.name=x", "policy.scheduler has 2 elements; index 2 is out of range"),
        ("policy.scheduler.first.name=x", "'first' is not an element index (use 0 to 1)"),
        ("+policy.scheduler.5=x", "+ cannot add list elements"),
        ("+policy.scheduler.0={}", "policy.scheduler.0 already exists"),
    ],
)
def test_bad_list_index(recipe: Path, text: str, fragment: str) -> None:
    [line] = problems_of(recipe, (text,))
    assert line.startswith(f"{text}: ")
    assert fragment in line


def test_bad_overrides_are_reported_together_in_order(recipe: Path) -> None:
    overrides = (
        "grpo.sed=1",  # missing key
        "a..b=1",  # malformed key
        "grpo.seed=3",  # fine
        "+grpo.seed=4",  # already exists (after the line above)
        "policy.megatron_cfg.offload_modules=[core_attn",  # unbalanced
        "grpo.seed.x=1",  # through a non-mapping
    )
    problems = problems_of(recipe, overrides)
    assert len(problems) == 5
    assert problems[0].startswith("grpo.sed=1: no such key 'sed' in grpo")
    assert problems[1] == "override 'a..b=1': bad key 'a..b': empty part between dots"
    assert problems[2].startswith("+grpo.seed=4: grpo.seed already exists")
    assert problems[3] == (
        "override 'policy.megatron_cfg.offload_modules=[core_attn': unclosed '['"
    )
    assert problems[4].startswith("grpo.seed.x=1: grpo.seed is 3 (an integer)")


def test_apply_overrides_does_not_change_its_input() -> None:
    data = {"a": {"b": [1, 2]}}
    result = apply_overrides(data, ["a.b.0=5", "+a.c=1"])
    assert result == {"a": {"b": [5, 2], "c": 1}}
    assert data == {"a": {"b": [1, 2]}}


def test_override_value_is_not_shared_between_places() -> None:
    result = apply_overrides({"a": 1, "b": 2}, ["a=[1]", "b=[1]"])
    result["a"].append(2)
    assert result["b"] == [1]


def test_overrides_must_not_be_one_string(recipe: Path) -> None:
    with pytest.raises(TypeError):
        load_recipe(recipe, "grpo.seed=1")  # type: ignore[arg-type]


def test_defaults_key_is_gone_before_overrides(tmp_path: Path) -> None:
    write(tmp_path / "p.yaml", "a: 1\n")
    child = write(tmp_path / "c.yaml", "defaults: p.yaml\n")
    [line] = problems_of(child, ("defaults=x",))
    assert line.startswith("defaults=x: no such key 'defaults'")


# ------------------------------------------------------------------------------------------------
# Interpolation


@pytest.fixture
def interpolated(tmp_path: Path) -> Path:
    return write(
        tmp_path / "r.yaml",
        """
        policy:
          precision: bf16
          micro: 2
          grad_acc: 4
          gbs: ${mul:${policy.micro},${policy.grad_acc}}
          dtype: ${.precision}
          name: run_${.precision}_${grpo.seed}
          half: ${div:${.micro},4}
          whole: ${div:8,2}
          total: ${add:1,2,${.micro}}
          biggest: ${max:3,${.micro},7.5}
          smallest: ${min:3,${.micro}}
          nested:
            up: ${..micro}
            up_up: ${...grpo.seed}
          copy: ${grpo}
          items: ["${..micro}", "${..precision}", literal]
        grpo:
          seed: 42
        escaped: \\${not.an.interpolation}
        """,
    )


def test_interpolation(interpolated: Path) -> None:
    data = load_recipe(interpolated)
    policy = data["policy"]
    assert policy["gbs"] == 8 and type(policy["gbs"]) is int
    assert policy["dtype"] == "bf16"
    assert policy["name"] == "run_bf16_42"
    assert policy["half"] == 0.5
    assert policy["whole"] == 4.0 and type(policy["whole"]) is float
    assert policy["total"] == 5
    assert policy["biggest"] == 7.5
    assert policy["smallest"] == 2
    assert policy["nested"] == {"up": 2, "up_up": 42}
    assert policy["copy"] == {"seed": 42}
    assert policy["items"] == [2, "bf16", "literal"]
    assert data["escaped"] == "${not.an.interpolation}"
    assert_plain(data)


def test_interpolation_sees_overrides(interpolated: Path) -> None:
    data = load_recipe(interpolated, ["policy.micro=3", "+policy.lr_tag=${policy.gbs}"])
    assert data["policy"]["gbs"] == 12
    assert data["policy"]["lr_tag"] == 12
    assert data["policy"]["nested"]["up"] == 3


def test_interpolation_across_inherited_files(tmp_path: Path) -> None:
    write(tmp_path / "p.yaml", "a: 2\nb: ${mul:${a},10}\n")
    child = write(tmp_path / "c.yaml", "defaults: p.yaml\na: 5\n")
    assert load_recipe(child) == {"a": 5, "b": 50}


def test_interpolation_failures_name_each_path(tmp_path: Path) -> None:
    path = write(
        tmp_path / "r.yaml",
        """
        ok: 1
        policy:
          missing: ${policy.nope}
          list: [1, "${nowhere}"]
          unknown: ${frobnicate:1}
          zero: ${div:1,0}
          text: ${mul:abc,2}
          syntax: ${oops
          relative: ${.nope}
          fine: ${ok}
        """,
    )
    problems = problems_of(path)
    assert problems == [
        "policy.missing: cannot resolve '${policy.nope}': "
        "Interpolation key 'policy.nope' not found",
        "policy.list.1: cannot resolve '${nowhere}': Interpolation key 'nowhere' not found",
        "policy.unknown: cannot resolve '${frobnicate:1}': "
        "Unsupported interpolation type frobnicate",
        "policy.zero: cannot resolve '${div:1,0}': div: division by zero",
        "policy.text: cannot resolve '${mul:abc,2}': mul: 'abc' is not a number",
        problems[5],
        problems[6],
    ]
    assert problems[5].startswith("policy.syntax: cannot resolve '${oops': ")
    assert "syntax" in problems[5].split(": ", 2)[2]
    assert problems[6].startswith("policy.relative: cannot resolve '${.nope}': ")
    assert "not found" in problems[6]


def test_bad_interpolation_from_override_names_the_key(recipe: Path) -> None:
    assert problems_of(recipe, ("grpo.seed=${grpo.sed}",)) == [
        "grpo.seed: cannot resolve '${grpo.sed}': Interpolation key 'grpo.sed' not found"
    ]


def test_resolve_interpolations_directly() -> None:
    data = {"a": 3, "b": {"c": "${mul:${a},2}", "d": ["${...a}"]}}
    result = resolve_interpolations(data)
    assert result == {"a": 3, "b": {"c": 6, "d": [3]}}
    assert data["b"]["c"] == "${mul:${a},2}"
    assert_plain(result)


def test_resolvers_registration_is_idempotent() -> None:
    register_resolvers()
    register_resolvers()
    assert resolve_interpolations({"x": "${add:1,2}", "y": "${max:1,9}"}) == {"x": 3, "y": 9}


def test_result_contains_no_omegaconf_objects(interpolated: Path) -> None:
    data = load_recipe(interpolated, ["+extra={a: [1, {b: ${policy.copy}}]}"])
    assert data["extra"] == {"a": [1, {"b": {"seed": 42}}]}
    assert_plain(data)
    from omegaconf import Container

    def walk(value: Any) -> None:
        assert not isinstance(value, Container)
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(data)


def test_assert_plain_helper_can_fail() -> None:
    from omegaconf import OmegaConf

    with pytest.raises(AssertionError):
        assert_plain({"a": OmegaConf.create({"b": 1})})
    with pytest.raises(AssertionError):
        assert_plain({"a": [object()]})


def test_load_does_not_depend_on_cwd_for_absolute_paths(
    recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    assert load_recipe(os.fspath(recipe))["grpo"]["seed"] == 42
