"""validate opens the data files a recipe names (data/file_checks.py, issue 45): a missing,
unreadable or empty file, or a first row that does not parse, is one line naming the recipe
key, the path and the row; a good file, or a bad row past the first rows, passes; a run
refuses the same before any worker starts."""

from __future__ import annotations

import os
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_offload.data import file_checks
from nemo_rl_offload.errors import UserInputError

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny"
KEY = "data.train_data_path"

ROWS = {
    "sft": '{"input": "1+1=", "output": "2"}\n',
    "dpo": '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n',
    "grpo": '{"prompt": "1+1=", "answer": "2"}\n',
    "distillation": '{"prompt": "1+1=", "answer": "2"}\n',
}
GYM_ROW = '{"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "agent"}}\n'


def write(tmp_path: Path, text: str | bytes, name: str = "train.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def jsonl_recipe(train: Any, val: Any = None, **data: Any) -> dict[str, Any]:
    return {
        "data": {"dataset_name": "jsonl", "train_data_path": train, "val_data_path": val, **data}
    }


def errors_of(recipe: Any, algorithm: str) -> list[str]:
    """What a run refuses (the check before it starts)."""
    errors, warnings = file_checks.problems(recipe, algorithm, starting=True)
    assert warnings == []
    return errors


@pytest.mark.parametrize("algorithm", sorted(ROWS))
def test_a_good_file_passes(tmp_path, algorithm):
    path = write(tmp_path, ROWS[algorithm] * 3)
    assert errors_of(jsonl_recipe(path, path), algorithm) == []


def test_a_missing_file_is_one_line_naming_the_key_and_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    (line,) = errors_of(jsonl_recipe(missing), "sft")
    assert line.startswith(f"{KEY}: {missing}: no such file; give the path of a JSON-lines file")


def test_the_validation_file_is_checked_too(tmp_path):
    good = write(tmp_path, ROWS["grpo"])
    missing = str(tmp_path / "val.jsonl")
    (line,) = errors_of(jsonl_recipe(good, missing), "grpo")
    assert line.startswith(f"data.val_data_path: {missing}: no such file")


def test_a_relative_path_is_read_from_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path, ROWS["sft"])
    monkeypatch.chdir(tmp_path)
    assert errors_of(jsonl_recipe("train.jsonl"), "sft") == []
    (line,) = errors_of(jsonl_recipe("other.jsonl"), "sft")
    assert f"a relative path is read from {tmp_path}" in line


def test_a_directory_and_an_empty_file(tmp_path):
    (line,) = errors_of(jsonl_recipe(str(tmp_path)), "sft")
    assert line == f"{KEY}: {tmp_path}: is a directory; give the path of a JSON-lines file"
    empty = write(tmp_path, "\n  \n")
    (line,) = errors_of(jsonl_recipe(empty), "sft")
    assert line == f"{KEY}: {empty}: holds no rows; give a JSON-lines file with at least one row"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file(tmp_path):
    path = write(tmp_path, ROWS["sft"])
    os.chmod(path, 0)
    try:
        (line,) = errors_of(jsonl_recipe(path), "sft")
    finally:
        os.chmod(path, 0o644)
    assert line == f"{KEY}: {path}: cannot be read (Permission denied); make it readable"


@pytest.mark.parametrize(
    "row,problem",
    [
        ("{not json}\n", "not valid JSON (Expecting property name enclosed in double quotes"),
        ('["a list"]\n', "expected a JSON object, got an array"),
        (
            '{"input": "q"}\n',
            "missing key 'output' (set data.output_key to the key your file uses)",
        ),
        ('{"input": "q", "output": 2}\n', "'output' is a number, expected a string"),
        (b'{"input": "\xff", "output": "a"}\n', "not valid UTF-8 (byte 12)"),
    ],
    ids=["json", "array", "missing_key", "number", "utf8"],
)
def test_a_bad_first_row_names_the_key_path_and_row(tmp_path, row, problem):
    good = ROWS["sft"].encode()
    bad = row if isinstance(row, bytes) else row.encode()
    path = write(tmp_path, good + b"\n" + bad + good)  # the bad row is line 3
    (line,) = errors_of(jsonl_recipe(path), "sft")
    assert line.startswith(f"{KEY}: {path}:3: {problem}"), line


def test_the_recipes_key_names_are_the_ones_checked(tmp_path):
    path = write(tmp_path, '{"question": "1+1=", "solution": "2"}\n')
    recipe = jsonl_recipe(path, prompt_key="question", answer_key="solution")
    assert errors_of(recipe, "grpo") == []
    (line,) = errors_of(jsonl_recipe(path), "grpo")
    assert "missing key 'prompt' (set data.prompt_key" in line


def test_only_the_first_rows_are_read(tmp_path):
    """The loader checks every row when the run reads the file; here only the first ones."""
    rows = ROWS["sft"] * file_checks.FIRST_ROWS
    assert errors_of(jsonl_recipe(write(tmp_path, rows + "{bad\n")), "sft") == []
    (line,) = errors_of(jsonl_recipe(write(tmp_path, "{bad\n" + rows)), "sft")
    assert ":1: not valid JSON" in line


def test_a_byte_order_mark_is_read_as_the_loader_reads_it(tmp_path):
    path = write(tmp_path, b"\xef\xbb\xbf" + ROWS["sft"].encode())
    assert errors_of(jsonl_recipe(path), "sft") == []


def test_jsonl_without_a_training_file_is_one_line():
    (line,) = errors_of(jsonl_recipe(None), "sft")
    assert line.startswith("data.train_data_path: required when data.dataset_name is 'jsonl'")


def test_other_datasets_name_no_files(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    recipe = {"data": {"dataset_name": "arithmetic", "train_data_path": missing}}
    assert errors_of(recipe, "sft") == []
    assert errors_of({"data": "not a section"}, "sft") == []


def gym_recipe(train: Any, val: Any = None) -> dict[str, Any]:
    data: dict[str, Any] = {"train": {"dataset_name": "NemoGymDataset", "data_path": train}}
    if val is not None:
        data["validation"] = {"dataset_name": "NemoGymDataset", "data_path": val}
    return {"env": {"should_use_nemo_gym": True}, "data": data}


def test_nemo_gym_rows(tmp_path):
    good = write(tmp_path, GYM_ROW * 2)
    assert errors_of(gym_recipe(good, good), "grpo") == []
    bad = write(tmp_path, GYM_ROW + '{"responses_create_params": {}}\n', "val.jsonl")
    (line,) = errors_of(gym_recipe(good, bad), "grpo")
    assert line.startswith(f"data.validation.data_path: {bad}:2: no agent_ref.name")
    missing = str(tmp_path / "nope.jsonl")
    (line,) = errors_of(gym_recipe(missing), "distillation")
    assert line.startswith(f"data.train.data_path: {missing}: no such file")
    (line,) = errors_of(gym_recipe(None), "grpo")
    assert line.startswith("data.train.data_path: required for NeMo-Gym rows")


# ----------------------------------------------------------------------- end to end


def test_validate_warns_of_a_file_not_on_this_machine_and_a_run_refuses_it(tmp_path):
    """A recipe written for a cluster names its files there: validate warns (one line, the
    rest still checked), the check before a run refuses."""
    from nemo_rl_offload.cli import main
    from nemo_rl_offload.planning import plan_at_start

    missing = str(tmp_path / "train.jsonl")
    overrides = ["data.dataset_name=jsonl", f"++data.train_data_path={missing}"]
    line = (
        f"{KEY}: {missing}: no such file; give the path of a JSON-lines file (a relative path "
        f"is read from {os.getcwd()})"
    )
    out, err = StringIO(), StringIO()
    code = main(
        ["validate", "--no-estimate", "--config", str(TINY / "sft.yaml"), *overrides],
        out=out,
        err=err,
    )
    assert code == 0 and "Traceback" not in err.getvalue()
    assert f"warning: {line}; not on this machine: a run checks it at start" in (
        err.getvalue().splitlines()
    )
    with pytest.raises(UserInputError) as caught:
        plan_at_start.checked(str(TINY / "sft.yaml"), overrides, "sft")
    assert line in caught.value.problems


def test_a_run_refuses_a_bad_row_before_it_starts(tmp_path):
    """The training commands' check (plan_at_start.checked, before any worker) refuses the
    same line."""
    from nemo_rl_offload.planning import plan_at_start

    path = write(tmp_path, '{"input": "q"}\n')
    with pytest.raises(UserInputError) as caught:
        plan_at_start.checked(
            str(TINY / "sft.yaml"),
            ["data.dataset_name=jsonl", f"++data.train_data_path={path}"],
            "sft",
        )
    assert f"{KEY}: {path}:1: missing key 'output'" in "\n".join(caught.value.problems)
