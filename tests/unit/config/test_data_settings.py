"""The recipe's data section resolved once (config/data_settings.py): NeMo-RL's entries with
data.default merged in as NeMo-RL merges it, lists of datasets, prompt files, the legacy
arithmetic/jsonl sources, and one line per unusable setting, each rule both ways."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.nemo_rl_data import recipe_with

from nemo_rl_offload.config.data_settings import (
    DataSettings,
    check_data_section,
    data_settings,
    dataset_entries,
    is_hub_id,
    resolve_data_path,
)
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.config.nemo_rl_datasets import MULTIMODAL, PREFERENCE, RESPONSE
from nemo_rl_offload.errors import UserInputError

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data" / "nemo_rl"
EXEMPLARS = REPO / "tests" / "unit" / "reference_configs" / "nemo_rl"


def settings(data: dict[str, Any], algorithm: str = "sft", **kw: Any) -> DataSettings:
    return data_settings(recipe_with(data, algorithm), base_dir=DATA, **kw)


def problems(data: dict[str, Any], algorithm: str = "sft", **kw: Any) -> list[str]:
    with pytest.raises(UserInputError) as error:
        settings(data, algorithm, **kw)
    return error.value.problems


def check(data: dict[str, Any], algorithm: str = "sft", **kw: Any) -> list[str]:
    return check_data_section(recipe_with(data, algorithm), base_dir=DATA, **kw)


# ------------------------------------------------------------------ legacy sources


def test_legacy_defaults_are_the_loaders_own():
    from nemo_rl_offload.config import data_settings as module
    from nemo_rl_offload.data import arithmetic

    resolved = settings({"dataset_name": "arithmetic"})
    assert resolved.source == "arithmetic" and resolved.train == ()
    assert resolved.num_train_samples == module.DEFAULT_NUM_TRAIN == 2000
    assert resolved.num_val_samples == module.DEFAULT_NUM_VAL == 200
    assert resolved.seed == module.DEFAULT_SEED == 42
    spec = arithmetic.DEFAULT_SPEC
    assert (resolved.arithmetic_ops, resolved.max_operand, resolved.max_factor) == (
        spec.ops,
        spec.max_operand,
        spec.max_factor,
    )
    assert (resolved.input_key, resolved.output_key, resolved.answer_key) == (
        "input",
        "output",
        "answer",
    )


def test_legacy_values_are_read():
    resolved = settings(
        {
            "dataset_name": "jsonl",
            "train_data_path": "t.jsonl",
            "val_data_path": "v.jsonl",
            "input_key": "q",
            "seed": 3,
            "shuffle": False,
            "max_operand": 9,
        }  # fmt: skip
    )
    assert resolved.source == "jsonl"
    assert (resolved.train_data_path, resolved.val_data_path) == ("t.jsonl", "v.jsonl")
    assert (resolved.input_key, resolved.seed, resolved.shuffle, resolved.max_operand) == (
        "q",
        3,
        False,
        9,
    )


def test_a_bad_arithmetic_bound_is_refused():
    (line,) = problems({"dataset_name": "arithmetic", "max_operand": 0})
    assert line == "data.max_operand: must be an integer >= 1 (got: 0)"


def test_jsonl_without_its_train_file_is_refused_and_left_to_the_file_check():
    (line,) = problems({"dataset_name": "jsonl"})
    assert line.startswith("data.train_data_path: required when data.dataset_name is 'jsonl'")
    assert check({"dataset_name": "jsonl"}) == []  # data/file_checks.py reports it


def test_an_unknown_legacy_name_is_refused():
    (line,) = problems({"dataset_name": "csv"})
    assert line.startswith("data.dataset_name: unknown dataset 'csv'; use arithmetic or jsonl")


def test_a_nemo_rl_name_as_data_dataset_name_says_where_it_goes():
    (line,) = problems({"dataset_name": "OpenMathInstruct-2"})
    assert "name it under data.train (data.train.dataset_name: OpenMathInstruct-2)" in line


def test_both_a_legacy_name_and_data_train_are_refused():
    (line,) = problems({"dataset_name": "arithmetic", "train": {"dataset_name": "squad"}})
    assert line.startswith("data.dataset_name: 'arithmetic' and data.train both name")
    assert settings({"dataset_name": "arithmetic", "train": None}).source == "arithmetic"


def test_no_data_at_all_is_refused():
    (line,) = problems({})
    assert line.startswith("data.train: required; name the training datasets here")
    assert settings({"train": {"dataset_name": "squad"}}).source == "nemo_rl"


# ------------------------------------------------------------------ NeMo-RL's entries


def test_default_fills_what_an_entry_does_not_set():
    resolved = settings(
        {
            "train": {"dataset_name": "squad", "split": "train", "prompt_file": None},
            "validation": {"dataset_name": "squad", "split": "validation"},
            "default": {
                "prompt_file": "examples/prompts/math.txt",
                "processor": "sft_processor",
                "split": "test",
            },  # fmt: skip
        }
    )
    (train,), (validation,) = resolved.train, resolved.validation
    assert (train.split, validation.split) == ("train", "validation")
    assert train.prompt_file is None  # set to null in the entry: the default does not fill it
    assert validation.prompt_file == str(DATA / "examples" / "prompts" / "math.txt")
    assert train.processor == validation.processor == "sft_processor"
    assert train.defaulted == ("processor",)
    assert train.key("processor") == "data.default.processor"
    assert train.key("split") == "data.train.split"
    assert validation.key("prompt_file") == "data.default.prompt_file"


def test_nemo_rl_defaults_of_a_dataset_and_of_the_loader():
    resolved = settings(
        {"train": {"dataset_name": "OpenMathInstruct-2", "env_name": "math"}}, "grpo"
    )
    (entry,) = resolved.train
    assert (entry.split, entry.output_key, entry.split_validation_size, entry.seed) == (
        "train_1M",
        "expected_answer",
        0.05,
        42,
    )
    assert entry.input_key is None  # OpenMathInstruct-2 reads its problem column only
    assert (entry.task_name, entry.processor, entry.env_name) == (
        "OpenMathInstruct-2",
        "default",  # NeMo-RL's default processor: math_hf_data_processor
        "math",
    )
    assert (resolved.add_bos, resolved.add_eos, resolved.add_generation_prompt) == (
        True,
        True,
        False,
    )
    assert (resolved.add_system_prompt, resolved.use_multiple_dataloader) == (True, False)
    assert resolved.num_prompts_per_dataloader is None and resolved.shuffle is True


def test_a_list_of_datasets_keeps_its_order_and_indexes_its_keys():
    resolved = settings(
        {
            "train": [{"dataset_name": "DeepScaler"}, {"dataset_name": "AIME2024", "repeat": 4}],
            "default": {"env_name": "math"},
        },  # fmt: skip
        "grpo",
    )
    first, second = resolved.train
    assert (first.where, second.where) == ("data.train[0]", "data.train[1]")
    assert second.option("repeat") == 4 and first.option("repeat") is None
    assert second.extra == (("repeat", 4),)
    (line,) = problems({"train": [{"dataset_name": "DeepScaler"}, {"dataset_name": "nope"}]})
    assert line.startswith("data.train[1].dataset_name: unknown dataset 'nope'")


def test_dpo_takes_one_dataset_mapping():
    (line,) = problems({"train": [{"dataset_name": "HelpSteer3"}]}, "dpo")
    assert line.startswith("data.train: DPO reads one dataset here")
    assert settings({"train": {"dataset_name": "HelpSteer3"}}, "dpo").family == "preference"


def test_an_unknown_name_lists_the_accepted_ones():
    (line,) = problems({"train": {"dataset_name": "OpenMathInstruct2"}})
    assert line.startswith(
        "data.train.dataset_name: unknown dataset 'OpenMathInstruct2'; use one of"
    )
    assert all(name in line for name in RESPONSE)
    (line,) = problems({"train": {"dataset_name": "Tulu3Pref"}}, "dpo")
    assert all(name in line for name in PREFERENCE)


@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_image_and_audio_datasets_are_one_line_each(name):
    (line,) = problems({"train": {"dataset_name": name}})
    assert line == (
        f"data.train.dataset_name: {name} is one of NeMo-RL's image, video or audio datasets; "
        "this backend trains language models on text and does not load it"
    )


def test_a_dataset_class_path_is_refused():
    (line,) = problems({"train": {"dataset_name": "my_pkg.data.MyDataset"}})
    assert "names a dataset class to import" in line and "ResponseDataset" in line


def test_a_dataset_of_the_other_family_is_refused():
    (line,) = problems({"train": {"dataset_name": "PreferenceDataset", "data_path": "p.jsonl"}})
    assert line.startswith(
        "data.train.dataset_name: PreferenceDataset holds preference pairs (DPO)"
    )
    (line,) = problems({"train": {"dataset_name": "squad"}}, "dpo")
    assert line.startswith("data.train.dataset_name: squad holds responses")
    assert settings({"train": {"dataset_name": "HelpSteer3"}}).train[0].family == "response"


def test_a_dataset_read_from_a_path_needs_one():
    (line,) = problems({"train": {"dataset_name": "ResponseDataset"}})
    assert line.startswith("data.train.data_path: required by ResponseDataset; give a local file")
    (line,) = problems({"train": {}, "default": {"dataset_name": "openai_format"}})
    assert line.startswith("data.train.data_path: required by openai_format")
    entry = settings({"train": {"dataset_name": "ResponseDataset", "data_path": "x.jsonl"}}).train[
        0
    ]
    assert entry.data_path == str(DATA / "x.jsonl") and entry.task_name == "x"


def test_a_missing_name_is_refused():
    (line,) = problems({"train": {"data_path": "x.jsonl"}})
    assert line.startswith("data.train.dataset_name: required; name the dataset")


def test_a_split_the_dataset_lacks_is_refused():
    (line,) = problems({"train": {"dataset_name": "OpenMathInstruct-2", "split": "test"}})
    assert line == (
        "data.train.split: 'test' is not a split of OpenMathInstruct-2; use train, train_1M, "
        "train_2M, train_5M"
    )
    assert settings({"train": {"dataset_name": "OpenMathInstruct-2", "split": "train_2M"}})


@pytest.mark.parametrize("size", [-0.1, True, "5%"])
def test_a_bad_validation_size_is_refused(size):
    (line,) = problems(
        {"train": {"dataset_name": "tulu3_sft_mixture", "split_validation_size": size}}
    )
    assert line.startswith("data.train.split_validation_size: set a fraction below 1, or a number")


def test_a_validation_size_may_be_a_fraction_or_rows():
    for size in (0, 0.2, 16):
        entry = settings(
            {"train": {"dataset_name": "tulu3_sft_mixture", "split_validation_size": size}}
        ).train[0]
        assert entry.split_validation_size == size


def test_rewarded_algorithms_need_an_environment():
    (line,) = problems({"train": {"dataset_name": "DeepScaler"}}, "grpo")
    assert line.startswith("data.train.env_name: required for grpo")
    assert settings(
        {"train": {"dataset_name": "DeepScaler"}, "default": {"env_name": "math"}}, "grpo"
    )
    assert settings({"train": {"dataset_name": "DeepScaler"}}, "sft").train[0].env_name is None


def test_a_prompt_file_is_read_from_the_working_directory():
    entry = settings(
        {"train": {"dataset_name": "squad", "prompt_file": "examples/prompts/cot.txt"}}
    ).train[0]
    assert entry.prompt_file == str(DATA / "examples" / "prompts" / "cot.txt")


def test_a_prompt_file_is_found_above_the_recipe(tmp_path):
    recipe = DATA / "recipes" / "sft.yaml"  # tests/data/nemo_rl holds examples/prompts/
    data = {"train": {"dataset_name": "squad", "system_prompt_file": "examples/prompts/gsm8k.txt"}}
    found = data_settings(recipe_with(data, "sft"), base_dir=tmp_path, recipe_path=recipe)
    assert found.train[0].system_prompt_file == str(DATA / "examples" / "prompts" / "gsm8k.txt")


def test_a_missing_prompt_file_is_one_line_naming_it_and_its_key(tmp_path):
    default = {"prompt_file": "prompts/none.txt", "processor": "sft_processor"}
    data = {"train": {"dataset_name": "squad"}, "validation": {"dataset_name": "squad"},
            "default": default}  # fmt: skip
    with pytest.raises(UserInputError) as error:
        data_settings({"sft": {}, "data": data}, base_dir=tmp_path)
    assert error.value.problems == [
        f"data.default.prompt_file: prompts/none.txt: no such file (a relative path is read "
        f"from {tmp_path}); give the prompt file's path, or null for none"
    ]
    warned = check_data_section({"sft": {}, "data": data}, base_dir=tmp_path)
    assert warned == [
        f"warning: {error.value.problems[0]}; not on this machine: a run checks it at start"
    ]
    assert check_data_section({"sft": {}, "data": data}, base_dir=tmp_path, starting=True) == (
        error.value.problems
    )


def test_nemo_gym_rows_need_nemo_gym():
    data = {"train": {"dataset_name": "NemoGymDataset", "data_path": "nemo_gym_rows.jsonl"}}
    (line,) = problems(data, "grpo")
    assert line.startswith("data.train.dataset_name: NemoGymDataset rows are NeMo-Gym's tasks")
    recipe = {"grpo": {}, "env": {"should_use_nemo_gym": True}, "data": data}
    resolved = data_settings(recipe, base_dir=DATA)
    assert resolved.source == "nemo_gym" and resolved.train[0].task_name == "nemo_gym_rows"


def test_raw_text_on_the_network_is_refused():
    data = {"train": {"dataset_name": "arrow_text", "data_files": "hf://datasets/a/b/*.parquet"}}
    (line,) = problems(data)
    assert line.startswith("data.train.data_files: hf://datasets/a/b/*.parquet is on the network")
    local = settings({"train": {"dataset_name": "arrow_text", "data_files": "raw_text.txt"}})
    assert local.train[0].option("data_files") == str(DATA / "raw_text.txt")


def test_multiple_loaders_need_their_prompt_count():
    data = {"train": {"dataset_name": "squad"}, "use_multiple_dataloader": True}
    (line,) = problems(data)
    assert line.startswith("data.num_prompts_per_dataloader: required with data.use_multiple")
    assert settings({**data, "num_prompts_per_dataloader": 8}).num_prompts_per_dataloader == 8


def test_a_bad_dataset_key_value_is_refused():
    (line,) = problems({"train": {"dataset_name": "AIME2024", "repeat": 0}})
    assert line == "data.train.repeat: set an integer of at least 1 (got: 0)"
    (line,) = problems({"train": {"dataset_name": "squad", "split": 3}})
    assert line == "data.train.split: set text (got: 3)"


def test_keys_a_dataset_does_not_read_are_warned_not_refused():
    data = {"train": {"dataset_name": "DAPOMath17K", "split": "test", "repet": 2},
            "default": {"env_name": "math"}}  # fmt: skip
    lines = check(data, "grpo")
    assert lines == [
        "warning: data.train.split: DAPOMath17K does not read split; it has no effect (remove it)",
        "warning: data.train.repet: DAPOMath17K has no key 'repet'; it has no effect (remove "
        "it; DAPOMath17K reads data_path)",
    ]
    assert settings(data, "grpo").train[0].split is None
    assert (
        check({"train": {"dataset_name": "DAPOMath17K"}, "default": {"env_name": "math"}}, "grpo")
        == []
    )


def test_settings_are_frozen_and_picklable():
    resolved = settings({"train": [{"dataset_name": "AIME2024", "repeat": 2}]})
    assert pickle.loads(pickle.dumps(resolved)) == resolved
    with pytest.raises(FrozenInstanceError):
        resolved.train[0].split = "x"  # type: ignore[misc]


def test_entries_for_file_checks_skip_the_ones_that_do_not_resolve():
    recipe = recipe_with({"train": [{"dataset_name": "nope"},
              {"dataset_name": "ResponseDataset", "data_path": "a.jsonl"}]}, "sft")  # fmt: skip
    (entry,) = dataset_entries(recipe, base_dir=DATA)
    assert entry.where == "data.train[1]"


def test_data_paths_are_local_paths_or_dataset_ids(tmp_path):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "local").mkdir()
    assert resolve_data_path("openai/gsm8k", tmp_path) == "openai/gsm8k"
    assert resolve_data_path("org/local", tmp_path) == str(tmp_path / "org" / "local")
    assert resolve_data_path("d/train.jsonl", tmp_path) == str(tmp_path / "d" / "train.jsonl")
    assert resolve_data_path("/abs/x.parquet", tmp_path) == "/abs/x.parquet"
    assert is_hub_id("openai/gsm8k") and not is_hub_id(str(tmp_path / "x.jsonl"))


@pytest.mark.parametrize(
    "path,task",
    [("train.jsonl", "train"), ("data/train.jsonl", "data-train"), ("/a/b/c.v1.jsonl", "b-c"),
     ("openai/gsm8k", "openai-gsm8k")],
)  # fmt: skip
def test_task_names_of_path_datasets_are_nemo_rls(path, task):
    entry = settings({"train": {"dataset_name": "ResponseDataset", "data_path": path}}).train[0]
    assert entry.task_name == task


# ------------------------------------------------------------------ NeMo-RL's recipes

RECIPES = sorted((DATA / "recipes").glob("*.yaml"))
# Keys NeMo-RL's own recipes set that their dataset does not read (NeMo-RL warns too).
_NO_HOLDOUT = ["data.train.split_validation_size: {} does not read", "data.train.seed: {} does not"]
EXPECTED_WARNINGS = {
    # grpo_math_1B's OpenMathInstruct-2 entry holds out 5%; these recipes name another dataset
    # there, which holds out nothing.
    "dapo-qwen2.5-7b.v2": [line.format("DAPOMath17K") for line in _NO_HOLDOUT],
    "grpo-deepscaler-1.5b-8K": [line.format("DeepScaler") for line in _NO_HOLDOUT],
    "grpo_smoke": [line.format("gsm8k") for line in _NO_HOLDOUT],
    # sft.yaml's and dpo.yaml's split, under a dataset that has one split.
    "sft-llama3.1-8b-1n8g-megatron-lora": ["data.train.split: tulu3_sft_mixture does not read"],
    "dpo-llama3.1-8b-tulu3-1n8g-fsdp2tp1": ["data.train.split: Tulu3Preference does not read"],
}


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_nemo_rls_recipes_data_sections_resolve(path):
    loaded = yaml.safe_load(path.read_text())
    recipe = {loaded["algorithm"]: {}, "data": loaded["data"]}
    if path.stem == "xtoken_off_policy_distillation":
        # Its cross-tokenizer processor is refused at validate (it distils across tokenizers).
        (line,) = [p for p in check_data_section(recipe, base_dir=DATA) if "processor" in p]
        assert line.startswith("data.train.processor: 'kd_data_processor' is NeMo-RL's ")
        return
    resolved = data_settings(recipe, base_dir=DATA)
    assert resolved.source == "nemo_rl" and resolved.train
    warnings = check_data_section(recipe, base_dir=DATA)
    expected = EXPECTED_WARNINGS.get(path.stem, [])
    assert len(warnings) == len(expected)
    for line, start in zip(warnings, expected, strict=True):
        assert line.startswith(f"warning: {start}")


def test_a_recipe_of_several_datasets_resolves_as_nemo_rl_merges_it():
    loaded = yaml.safe_load((DATA / "recipes" / "grpo_multiple_datasets.yaml").read_text())
    resolved = data_settings({"grpo": {}, "data": loaded["data"]}, base_dir=DATA)
    assert [e.dataset_name for e in resolved.train] == ["OpenMathInstruct-2", "DeepScaler"]
    assert [e.dataset_name for e in resolved.validation] == ["AIME2024", "DAPOMathAIME2024"]
    assert all(e.env_name == "math" and e.processor == "math_hf_data_processor"
               for e in resolved.train + resolved.validation)  # fmt: skip
    assert resolved.validation[0].option("repeat") == 16
    assert resolved.num_prompts_per_dataloader == 16


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo_math_1B", "distillation_math"])
def test_nemo_rls_exemplars_resolve(name):
    recipe = load_recipe(EXEMPLARS / f"{name}.yaml")
    resolved = data_settings(recipe, base_dir=DATA)
    assert resolved.source == "nemo_rl"
    assert check_data_section(recipe, base_dir=DATA) == []


# ------------------------------------------------------------------ processors at validate


def test_a_processor_must_make_what_the_algorithm_trains_on():
    """An SFT conversation given to GRPO has no answer to grade (every reward would be 0), a
    GRPO prompt given to SFT has nothing to train: both are refused before any data is read,
    as are names that are not processors; a fitting name passes."""
    sft_data = {"train": {"dataset_name": "squad", "processor": "sft_processor"}}
    assert check(sft_data) == []
    (line,) = check({"train": {"dataset_name": "squad", "processor": "default"}})
    assert line.startswith("data.train.processor: default makes prompts with an answer")
    assert line.endswith("use sft_processor")
    math = {"dataset_name": "OpenMathInstruct-2", "env_name": "math"}
    assert check({"train": {**math, "processor": "math_hf_data_processor"}}, "grpo") == []
    (line,) = check({"train": {**math, "processor": "sft_processor"}}, "grpo")
    assert line.startswith("data.train.processor: sft_processor makes conversations")
    assert "math_hf_data_processor" in line
    (line,) = check({"train": {**math, "processor": "math_processor"}}, "grpo")
    assert line.startswith("data.train.processor: unknown processor 'math_processor'; ")
    (line,) = check({"train": {**math, "processor": "vlm_hf_data_processor"}}, "grpo")
    assert "not supported" in line


def test_a_preference_entrys_processor_is_nemo_rls_own():
    """NeMo-RL binds preference_preprocessor to every preference row, whatever the entry says."""
    data = {"train": {"dataset_name": "HelpSteer3", "data_path": "helpsteer3.jsonl"}}
    assert check(data, "dpo") == []
