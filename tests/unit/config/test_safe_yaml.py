"""YAML a user hands in is read bounded (config.safe_yaml): an alias bomb, deep nesting, an
alias to its own container and a repeated key are each one line naming the file, the line and
the limit, in well under a second; good recipes (every one under examples/configs, anchors and
merge keys) still load."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml

from nemo_rl_offload.config import safe_yaml
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.quantization import read_recipe_file
from nemo_rl_offload.errors import UserInputError

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "examples" / "configs").glob("**/*.yaml"))


def one_line(path: Path) -> str:
    """The one problem line load_recipe reports for ``path`` (never another exception)."""
    with pytest.raises(UserInputError) as caught:
        load_recipe(path)
    (line,) = caught.value.problems
    assert "\n" not in line
    return line


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def billion_laughs(levels: int) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [{','.join([f'*a{level - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [7, 9])
def test_an_alias_bomb_is_one_line_in_well_under_a_second(tmp_path, levels):
    path = write(tmp_path, billion_laughs(levels))
    assert path.stat().st_size < 700
    start = time.monotonic()
    line = one_line(path)
    assert time.monotonic() - start < 2
    assert line.startswith(f"{path}:6:")  # the alias that crossed the limit
    assert f"more than {safe_yaml.MAX_VALUES} values" in line


def test_aliases_within_the_limit_still_expand(tmp_path):
    path = write(tmp_path, billion_laughs(4) + "policy: {lr: 1}\n")
    data = safe_yaml.load_yaml(path.read_text())
    assert len(data["a3"]) == 9 and data["a3"][0][0][0][0] == "lol"


@pytest.mark.parametrize("flow", [True, False], ids=["flow", "block"])
def test_deep_nesting_is_one_line(tmp_path, flow):
    depth = max(sys.getrecursionlimit(), 5000) if flow else 200
    if flow:
        text = "x: " + "[" * depth + "]" * depth + "\n"
    else:
        text = (
            "".join("  " * level + f"k{level}:\n" for level in range(depth)) + "  " * depth + "v\n"
        )
    line = one_line(write(tmp_path, text))
    assert f"nested deeper than {safe_yaml.MAX_DEPTH} levels" in line
    assert line.startswith(f"{tmp_path / 'recipe.yaml'}:")


def test_nesting_at_the_limit_loads(tmp_path):
    depth = safe_yaml.MAX_DEPTH - 1  # the top-level mapping is one level
    data = safe_yaml.load_yaml("x: " + "[" * depth + "]" * depth)
    data = data["x"]
    for _ in range(depth - 1):
        data = data[0]
    assert data == []
    with pytest.raises(safe_yaml.YamlLimitError):
        safe_yaml.load_yaml("x: " + "[" * (depth + 1) + "]" * (depth + 1))


@pytest.mark.parametrize(
    ("text", "where"),
    [("a: &x [1, *x]\n", ":1:11:"), ("a: &x\n  b: *x\n", ":2:6:"), ("a: &x {b: [*x]}\n", ":1:12:")],
)
def test_an_alias_to_its_own_container_is_one_line(tmp_path, text, where):
    line = one_line(write(tmp_path, text))
    assert where in line and "alias *x refers to the list or mapping that contains it" in line


def test_a_repeated_key_names_both_lines(tmp_path):
    path = write(tmp_path, "policy:\n  lr: 1\ngrpo:\n  x: 1\npolicy:\n  model_name: m\n")
    line = one_line(path)
    assert line.startswith(f"{path}:5:1: key 'policy' appears twice")
    assert "at lines 1 and 5" in line


def test_a_repeated_nested_key_names_both_lines(tmp_path):
    line = one_line(write(tmp_path, "policy:\n  lr: 1\n  max: 2\n  lr: 3\n"))
    assert ":4:3: key 'lr' appears twice" in line and "at lines 2 and 4" in line


def test_merge_keys_may_still_be_overridden(tmp_path):
    text = "base: &b\n  x: 1\n  y: 2\nmid: &m\n  <<: *b\n  x: 3\nother:\n  <<: *m\n  y: 4\n"
    data = safe_yaml.load_yaml(text)
    assert data["mid"] == {"x": 3, "y": 2}
    assert data == yaml.safe_load(text)  # merges read as PyYAML reads them


def test_exponent_only_numbers_are_floats():
    assert safe_yaml.load_yaml("a: 1e-8\nb: 5E+3\nc: '1e-8'") == {"a": 1e-8, "b": 5e3, "c": "1e-8"}


def test_a_modelopt_recipe_file_is_read_the_same_way(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text("quant_cfg: {a: 1}\nquant_cfg: {b: 2}\n")
    with pytest.raises(ValueError, match=r"q.yaml:2:1: key 'quant_cfg' appears twice"):
        read_recipe_file(path)
    path.write_text(billion_laughs(9))
    with pytest.raises(ValueError, match="values once its aliases"):
        read_recipe_file(path)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_recipe_still_loads(path):
    assert load_recipe(path)


@pytest.mark.parametrize(
    "text",
    [billion_laughs(9), "a: &x [1, *x]\n", "x: " + "[" * 3000 + "]" * 3000 + "\n", "a: 1\na: 2\n"],
    ids=["alias_bomb", "self_reference", "deep", "repeated_key"],
)
def test_validate_prints_one_line_and_exits_2(tmp_path, text):
    from io import StringIO

    from nemo_rl_offload.cli import main

    path = write(tmp_path, text)
    out, err = StringIO(), StringIO()
    start = time.monotonic()
    assert main(["validate", "--config", str(path)], out=out, err=err) == 2
    assert time.monotonic() - start < 5
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{path}:"), lines
    assert "Traceback" not in err.getvalue() + out.getvalue()


def test_an_override_nested_too_deep_is_one_line():
    recipe = REPO / "examples" / "configs" / "tiny" / "sft.yaml"
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(UserInputError) as caught:
        load_recipe(recipe, [f"sft.max_num_steps={deep}"])
    (line,) = caught.value.problems
    assert f"nested deeper than {safe_yaml.MAX_DEPTH} levels" in line
    assert f"at position {safe_yaml.MAX_DEPTH + 1} of the value" in line
    shallow = "[" * 10 + "]" * 10
    assert load_recipe(recipe, [f"sft.max_num_steps={shallow}"])["sft"]["max_num_steps"]


def test_a_defaults_bomb_is_one_line(tmp_path):
    """Each file naming the next ten times: 10**6 reads unbounded."""
    for level in range(6):
        parent = f"f{level + 1}.yaml" if level < 5 else None
        text = f"defaults: [{', '.join([parent] * 10)}]\n" if parent else "sft: {a: 1}\n"
        (tmp_path / f"f{level}.yaml").write_text(text)
    start = time.monotonic()
    with pytest.raises(UserInputError) as caught:
        load_recipe(tmp_path / "f0.yaml")
    assert time.monotonic() - start < 5
    (line,) = caught.value.problems
    assert line.startswith(f"{tmp_path / 'f0.yaml'}: defaults: more than 1000 files read")
