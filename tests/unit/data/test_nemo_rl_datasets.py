"""NeMo-RL's named datasets loaded into its datum dicts (data/nemo_rl_datasets.py), from local
copies in the hub's columns (tests/data/nemo_rl/), compared with what NeMo-RL's own classes make
of the same files (expected/*.json, its README says how they were produced); the hub read from
the local cache only; every problem of a file with its file:line; file checks before a run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.nemo_rl_data import recipe_with

from nemo_rl_offload.config.data_settings import DataSettings, data_settings
from nemo_rl_offload.data import file_checks
from nemo_rl_offload.data.nemo_rl.split import holdout
from nemo_rl_offload.data.nemo_rl_datasets import PREFERENCE_PROCESSOR, load_rows
from nemo_rl_offload.errors import UserInputError

datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data" / "nemo_rl"
EXPECTED = sorted((DATA / "expected").glob("*.json"))
# The local copy of each named dataset (its hub columns, a few rows).
COPIES = {
    "OpenMathInstruct-2": "openmathinstruct2.jsonl",
    "DAPOMath17K": "dapo_math_17k.jsonl",
    "DAPOMathAIME2024": "dapo_aime_2024.jsonl",
    "DeepScaler": "deepscaler.jsonl",
    "AIME2024": "aime_2024.jsonl",
    "AIME2025": "aime_2025.jsonl",
    "AIME2026": "aime_2026.jsonl",
    "gsm8k": "gsm8k.jsonl",
    "squad": "squad.jsonl",
    "HelpSteer3": "helpsteer3.jsonl",
    "tulu3_sft_mixture": "tulu3_sft_mixture.jsonl",
    "Nemotron-Cascade-2-SFT-Math": "nemotron_cascade2_math.jsonl",
    "NuminaMath-1.5": "numinamath.jsonl",
    "OpenR1-Math-220k": "openr1_math.jsonl",
    "open_assistant": "oasst_trees.jsonl.gz",
    "Tulu3Preference": "tulu3_preference.jsonl",
}


@pytest.fixture(autouse=True)
def own_caches(tmp_path_factory, monkeypatch):
    """``datasets``' and the hub's caches in a fresh directory: nothing from this machine's."""
    import huggingface_hub.constants as hub_constants

    root = tmp_path_factory.mktemp("hf")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "datasets"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(root / "hub"))
    return root


def load(data: dict[str, Any], algorithm: str = "sft", base_dir: Path = DATA, **recipe: Any):
    resolved = data_settings(recipe_with(data, algorithm, **recipe), base_dir=base_dir)
    return load_rows(resolved)


def problems_of(data: dict[str, Any], algorithm: str = "sft", **kw: Any) -> list[str]:
    with pytest.raises(UserInputError) as error:
        load(data, algorithm, **kw)
    return error.value.problems


def jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ------------------------------------------------------------------ NeMo-RL's rows, by name


@pytest.mark.parametrize("case", EXPECTED, ids=[p.stem for p in EXPECTED])
def test_each_dataset_gives_nemo_rls_rows_in_nemo_rls_order(case):
    """One case per named dataset (and per variant): the same datum dicts, the same training
    rows and held-out validation rows in the same order, the same task name."""
    expected = json.loads(case.read_text())
    entry = dict(expected["entry"])
    if "data_path" not in entry and "data_files" not in entry:
        entry["data_path"] = COPIES[entry["dataset_name"]]
    algorithm = "dpo" if expected["family"] == "preference" else "sft"
    train, validation = load({"train": entry}, algorithm)
    assert [dict(row.datum) for row in train] == expected["train"]
    assert [dict(row.datum) for row in validation] == (expected["validation"] or [])
    assert {row.task.task_name for row in train + validation} == {expected["task_name"]}


def test_split_validation_size_is_datasets_train_test_split():
    """The hold-out is NeMo-RL's: ``datasets``' train_test_split of the rows with the seed."""
    rows = [{"input": f"q{i}", "output": f"a{i}"} for i in range(30)]
    table = datasets.Dataset.from_list(rows)
    for size, seed in ((0.2, 42), (0.05, 7), (4, 3), (4.7, 3)):
        parts = table.train_test_split(test_size=int(size) if size >= 1 else size, seed=seed)
        kept, held = holdout(len(rows), size, seed, where="k")
        assert [rows[i] for i in kept] == parts["train"].to_list()
        assert [rows[i] for i in held] == parts["test"].to_list()
    assert holdout(5, 0, 1, where="k") == ([0, 1, 2, 3, 4], [])


def test_a_hold_out_larger_than_the_data_is_one_line(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [{"input": "a", "output": "b"}] * 3)
    data = {"train": {"dataset_name": "ResponseDataset", "data_path": path,
                      "split_validation_size": 5}}  # fmt: skip
    (line,) = problems_of(data)
    assert line.startswith("data.train.split_validation_size: 5 cannot be held out of 3 rows")


@pytest.mark.parametrize("kind", ["parquet", "csv", "save_to_disk", "json_array"])
def test_a_response_file_in_any_format_gives_the_same_rows(tmp_path, kind):
    rows = [{"input": "Hello", "output": "Hi there!"}, {"input": "How are you?", "output": "Good"}]
    table = datasets.Dataset.from_list(rows)
    path = tmp_path / {"parquet": "d.parquet", "csv": "d.csv", "save_to_disk": "saved",
                       "json_array": "d.json"}[kind]  # fmt: skip
    if kind == "parquet":
        table.to_parquet(str(path))
    elif kind == "csv":
        table.to_csv(str(path), index=False)
    elif kind == "save_to_disk":
        table.save_to_disk(str(path))
    else:
        path.write_text(json.dumps(rows))
    train, _ = load({"train": {"dataset_name": "ResponseDataset", "data_path": str(path)}})
    assert [row.datum["messages"][1]["content"] for row in train] == ["Hi there!", "Good"]
    assert train[1].where == (f"{path}: row 2" if kind != "save_to_disk" else f"{path}: row 2")


# ------------------------------------------------------------------ what each row carries


def test_rows_carry_their_processor_task_environment_and_line():
    data = {
        "train": {"dataset_name": "DeepScaler", "data_path": "deepscaler.jsonl"},
        "default": {"prompt_file": "examples/prompts/cot.txt", "env_name": "math",
                    "processor": "math_hf_data_processor",
                    "system_prompt_file": "examples/prompts/gsm8k.txt"},
    }  # fmt: skip
    train, validation = load(data, "grpo")
    first = train[0]
    assert validation == []
    assert first.processor == "math_hf_data_processor" and first.env_name == "math"
    assert first.task.task_name == "DeepScaler"
    assert first.task.prompt == (DATA / "examples" / "prompts" / "cot.txt").read_text()
    assert first.task.system_prompt.startswith("You are a helpful AI assistant.")
    assert first.where == f"{DATA / 'deepscaler.jsonl'}:1"


def test_preference_rows_take_nemo_rls_preference_processor():
    train, _ = load({"train": {"dataset_name": "BinaryPreferenceDataset",
                               "data_path": "binary_preference.jsonl"}}, "dpo")  # fmt: skip
    assert {row.processor for row in train} == {PREFERENCE_PROCESSOR}
    assert train[0].datum["completions"][0]["rank"] == 0


def test_several_datasets_in_nemo_rls_order():
    """Training entries one after the other; validation: rows held out of training entries
    first, then the validation entries."""
    data = {
        "train": [{"dataset_name": "OpenMathInstruct-2", "data_path": "openmathinstruct2.jsonl"},
                  {"dataset_name": "DeepScaler", "data_path": "deepscaler.jsonl"}],
        "validation": [{"dataset_name": "AIME2024", "data_path": "aime_2024.jsonl", "repeat": 2}],
        "default": {"env_name": "math"},
    }  # fmt: skip
    train, validation = load(data, "grpo")
    assert [row.task.task_name for row in train] == ["OpenMathInstruct-2"] * 38 + ["DeepScaler"] * 5
    assert [row.task.task_name for row in validation] == ["OpenMathInstruct-2"] * 2 + [
        "AIME2024"
    ] * 6


def test_nemo_gym_rows():
    recipe = {"env": {"should_use_nemo_gym": True}}
    data = {"train": {"dataset_name": "NemoGymDataset", "data_path": "nemo_gym_rows.jsonl",
                      "repeat": 2, "processor": "nemo_gym_data_processor"}}  # fmt: skip
    train, _ = load(data, "grpo", **recipe)
    assert len(train) == 4 and train[0].processor == "nemo_gym_data_processor"
    assert train[0].datum["extra_env_info"]["agent_ref"] == {"name": "math_agent"}
    assert train[0].datum["task_name"] == "nemo_gym_rows"


def test_the_legacy_sources_are_not_loaded_here():
    with pytest.raises(ValueError, match="load_split"):
        load_rows(DataSettings(source="arithmetic"))


# ------------------------------------------------------------------ the hub, offline


def test_a_named_dataset_loads_its_hub_id_from_the_cache_with_the_hub_offline(monkeypatch):
    import huggingface_hub.constants as hub_constants

    calls = []

    def cached(path, name=None, **kw):
        flags = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
        variables = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("HF_DATASETS_OFFLINE"))
        calls.append((path, name, *flags, *variables))
        table = datasets.Dataset.from_list([{"question": "2+2?", "answer": "2+2=4\n#### 4"}])
        return datasets.DatasetDict({"train": table, "test": table})

    monkeypatch.setattr(datasets, "load_dataset", cached)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    train, _ = load({"train": {"dataset_name": "gsm8k", "subset": "socratic", "split": "test"}})
    assert calls == [("openai/gsm8k", "socratic", True, True, "1", "1")]
    assert train[0].datum["messages"][1]["content"] == "4"
    assert train[0].where == "openai/gsm8k: row 1"
    assert "HF_HUB_OFFLINE" not in os.environ  # put back after the call


def test_a_dataset_not_in_the_cache_is_one_line_and_no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the loader reached for the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    (line,) = problems_of({"train": {"dataset_name": "OpenMathInstruct-2"}})
    assert line == (
        "data.train.dataset_name: OpenMathInstruct-2 (nvidia/OpenMathInstruct-2) is not on this "
        "machine and this backend does not download; put it in the Hugging Face cache (run "
        "datasets.load_dataset('nvidia/OpenMathInstruct-2') once where there is network, with "
        "the same HF_HOME), or give a local copy as data.train.data_path"
    )
    (line,) = problems_of({"train": {"dataset_name": "open_assistant"}})
    assert "hf download OpenAssistant/oasst1 2023-04-12_oasst_all.trees.jsonl.gz" in line


def test_a_dataset_downloaded_to_the_hub_cache_loads(own_caches):
    """A repository snapshot (``hf download``) in the hub cache, read as a local directory."""
    repo = own_caches / "hub" / "datasets--openai--gsm8k"
    snapshot = repo / "snapshots" / "abc123"
    (snapshot / "main").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snapshot / "main" / "train-00000-of-00001.jsonl").write_text(
        (DATA / "gsm8k.jsonl").read_text()
    )
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n"
        "  - split: train\n    path: main/train-*\n---\n"
    )
    train, _ = load({"train": {"dataset_name": "gsm8k"}})
    assert len(train) == 5 and train[0].datum["messages"][1]["content"] == "3"


def test_importing_the_loader_does_not_import_datasets():
    code = (
        "import sys, nemo_rl_offload.data.nemo_rl_datasets, nemo_rl_offload.data.file_checks; "
        "print('datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ problems in a file


def test_a_missing_column_names_the_recipe_key(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [{"q": "1", "a": "2"}])
    (line,) = problems_of({"train": {"dataset_name": "ResponseDataset", "data_path": path,
                                     "output_key": "a"}})  # fmt: skip
    assert line == (
        f"{path}: no column 'input' (set data.train.input_key to the column your file uses); "
        "its columns: q, a"
    )
    train, _ = load({"train": {"dataset_name": "ResponseDataset", "data_path": path,
                               "input_key": "q", "output_key": "a"}})  # fmt: skip
    assert train[0].datum["messages"][0]["content"] == "1"


def test_a_copy_of_a_named_dataset_needs_its_hub_columns(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [{"question": "1", "answer": "2"}])
    (line,) = problems_of({"train": {"dataset_name": "DeepScaler", "data_path": path}})
    assert line.startswith(
        f"{path}: no column 'problem' (a copy of DeepScaler given as data.train.data_path has "
        "the hub's columns: problem, answer)"
    )


def test_every_bad_line_of_a_file_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"input": "a", "output": "b"}\nnot json\n\n[1]\n{"input": "c", "output": "d"}\n'
    )
    assert problems_of({"train": {"dataset_name": "ResponseDataset", "data_path": str(path)}}) == [
        f"{path}:2: not valid JSON (Expecting value at column 1)",
        f"{path}:4: expected a JSON object",
    ]


def test_a_row_without_a_value_is_named_by_its_line(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [{"input": "a", "output": "b"}, {"input": "c"},
                                        {"input": 3, "output": "d"}])  # fmt: skip
    assert problems_of({"train": {"dataset_name": "ResponseDataset", "data_path": path}}) == [
        f"{path}:2: 'output' is null, expected text",
        f"{path}:3: 'input' is a number, expected text",
    ]


def test_a_gsm8k_answer_without_its_final_answer_is_refused(tmp_path):
    path = jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "no marker"}])
    (line,) = problems_of({"train": {"dataset_name": "gsm8k", "data_path": path}})
    assert line.startswith(f"{path}:1: 'answer' has no '####' before the final answer")
    train, _ = load(
        {"train": {"dataset_name": "gsm8k", "data_path": path, "extract_answer": False}}
    )
    assert train[0].datum["messages"][1]["content"] == "no marker"


def test_a_conversation_must_end_with_the_assistant(tmp_path):
    path = jsonl(tmp_path / "o.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    (line,) = problems_of({"train": {"dataset_name": "openai_format", "data_path": path}})
    assert line == (
        f"{path}:1: 'messages' ends with a 'user' message; a training conversation ends with "
        "the assistant's"
    )


def test_a_local_file_is_one_split_for_path_datasets_as_in_nemo_rl(tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [{"input": "a", "output": "b"}])
    (line,) = problems_of({"train": {"dataset_name": "ResponseDataset", "data_path": path,
                                     "split": "validation"}})  # fmt: skip
    assert line == f"data.train.split: 'validation' is not a split of {path}; its splits are train"
    (line,) = problems_of({"train": {"dataset_name": "ResponseDataset", "data_path": path,
                                     "subset": "main"}})  # fmt: skip
    assert line.startswith("data.train.subset: only a Hugging Face dataset has subsets")
    # A named dataset's local copy with one split is the split asked for.
    train, _ = load({"train": {"dataset_name": "squad", "data_path": "squad.jsonl",
                               "split": "validation"}})  # fmt: skip
    assert len(train) == 4


def test_a_missing_local_copy_is_one_line(tmp_path):
    (line,) = problems_of({"train": {"dataset_name": "squad", "data_path": "nope.jsonl"}})
    assert line.startswith(f"data.train.data_path: {DATA / 'nope.jsonl'}: no such file")


def test_problems_of_several_entries_come_together(tmp_path):
    data = {"train": [{"dataset_name": "squad", "data_path": "nope.jsonl"},
                      {"dataset_name": "squad", "data_path": "nope2.jsonl"}]}  # fmt: skip
    assert len(problems_of(data)) == 2


# ------------------------------------------------------------------ checked before a run


def entry_checks(tmp_path: Path, data: dict[str, Any], starting: bool, algorithm: str = "sft"):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        return file_checks.problems(recipe_with(data, algorithm), algorithm, starting=starting)
    finally:
        os.chdir(cwd)


def test_a_missing_dataset_file_warns_at_validate_and_stops_a_run(tmp_path):
    data = {"train": {"dataset_name": "ResponseDataset", "data_path": "gone.jsonl"}}
    errors, warnings = entry_checks(tmp_path, data, starting=False)
    assert errors == [] and len(warnings) == 1
    assert warnings[0].startswith(
        f"warning: data.train.data_path: {tmp_path / 'gone.jsonl'}: no such file"
    )
    errors, warnings = entry_checks(tmp_path, data, starting=True)
    assert warnings == [] and errors[0].startswith("data.train.data_path:")


def test_a_bad_first_row_of_a_dataset_file_is_found_before_a_run(tmp_path):
    jsonl(tmp_path / "t.jsonl", [{"q": "a", "output": "b"}])
    data = {"train": {"dataset_name": "ResponseDataset", "data_path": "t.jsonl"}}
    errors, _ = entry_checks(tmp_path, data, starting=True)
    assert errors == [
        f"data.train.data_path: {tmp_path / 't.jsonl'}:1: missing key 'input' (set "
        "data.train.input_key to the column your file uses)"
    ]
    data["train"]["input_key"] = "q"
    assert entry_checks(tmp_path, data, starting=True) == ([], [])


def test_dataset_ids_directories_and_json_arrays_pass_the_file_check(tmp_path):
    (tmp_path / "saved").mkdir()
    (tmp_path / "rows.json").write_text('[{"input": "a", "output": "b"}]')
    data = {"train": [{"dataset_name": "ResponseDataset", "data_path": "openai/gsm8k"},
                      {"dataset_name": "ResponseDataset", "data_path": "saved"},
                      {"dataset_name": "ResponseDataset", "data_path": "rows.json"},
                      {"dataset_name": "OpenMathInstruct-2"}]}  # fmt: skip
    assert entry_checks(tmp_path, data, starting=True) == ([], [])
