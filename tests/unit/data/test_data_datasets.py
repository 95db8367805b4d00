"""Choosing a dataset from the recipe, and the sequence-length check after tokenizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl_offload.config.data_settings import DataSettings, data_settings
from nemo_rl_offload.data import arithmetic
from nemo_rl_offload.data.datasets import EncodedExample, encode_and_check_lengths
from nemo_rl_offload.data.datasets import load_split as load_settings_split
from nemo_rl_offload.data.tokenizer import ByteTokenizer
from nemo_rl_offload.errors import UserInputError


def load_split(cfg: dict, kind: str, split: str) -> list[dict]:
    """The split of the ``data`` section ``cfg`` (this backend's own keys)."""
    fields = {key: value for key, value in cfg.items() if key != "dataset_name"}
    settings = DataSettings(source=cfg["dataset_name"], **fields)
    return load_settings_split(settings, kind, split)  # type: ignore[arg-type]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("kind", ["sft", "preference", "prompts"])
def test_arithmetic_uses_sizes_and_seed(kind: str) -> None:
    cfg = {"dataset_name": "arithmetic", "num_train_samples": 40, "num_val_samples": 8, "seed": 5}
    train, val = load_split(cfg, kind, "train"), load_split(cfg, kind, "val")
    assert (train, val) == arithmetic.split(kind, 40, 8, 5)
    assert len(train) == 40 and len(val) == 8
    assert load_split({**cfg, "seed": 6}, kind, "train") != train


def test_arithmetic_defaults() -> None:
    cfg = {"dataset_name": "arithmetic"}
    assert len(load_split(cfg, "sft", "train")) == 2000
    val = load_split(cfg, "sft", "val")
    assert val == arithmetic.split("sft", 2000, 200, 42)[1]


def test_jsonl_sft_with_recipe_keys(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", [{"q": "1+1", "a": " 2"}])
    val = _jsonl(tmp_path / "val.jsonl", [{"q": "2+2", "a": " 4"}, {"q": "3+3", "a": " 6"}])
    cfg = {
        "dataset_name": "jsonl",
        "train_data_path": train,
        "val_data_path": val,
        "input_key": "q",
        "output_key": "a",
    }
    assert load_split(cfg, "sft", "train") == [{"prompt": "1+1", "response": " 2", "line": 1}]
    assert [ex["prompt"] for ex in load_split(cfg, "sft", "val")] == ["2+2", "3+3"]


def test_jsonl_preference_and_prompts(tmp_path: Path) -> None:
    prefs = _jsonl(tmp_path / "p.jsonl", [{"x": "Q", "y": " 1", "z": " 2"}])
    cfg = {
        "dataset_name": "jsonl",
        "train_data_path": prefs,
        "prompt_key": "x",
        "chosen_key": "y",
        "rejected_key": "z",
    }
    assert load_split(cfg, "preference", "train") == [
        {"prompt": "Q", "chosen": " 1", "rejected": " 2", "line": 1}
    ]
    prompts = _jsonl(tmp_path / "q.jsonl", [{"prompt": "Q", "sol": "1,234"}])
    cfg = {"dataset_name": "jsonl", "train_data_path": prompts, "answer_key": "sol"}
    assert load_split(cfg, "prompts", "train") == [{"prompt": "Q", "answer": "1,234", "line": 1}]


def test_jsonl_val_may_be_null(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "t.jsonl", [{"input": "a", "output": "b"}])
    cfg = {"dataset_name": "jsonl", "train_data_path": train, "val_data_path": None}
    assert load_split(cfg, "sft", "val") == []
    assert load_split({"dataset_name": "jsonl", "train_data_path": train}, "sft", "val") == []


def test_jsonl_errors_name_the_recipe_key(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as info:
        load_split({"dataset_name": "jsonl"}, "sft", "train")
    assert info.value.problems[0].startswith("data.train_data_path: required when")
    missing = str(tmp_path / "val.jsonl")
    cfg = {"dataset_name": "jsonl", "val_data_path": missing}
    with pytest.raises(UserInputError) as info:
        load_split(cfg, "sft", "val")
    assert info.value.problems == [f"{missing}: no such file (data.val_data_path)"]


def test_jsonl_prompt_answers_must_be_gradable(tmp_path: Path) -> None:
    rows = [
        {"prompt": "a", "answer": "42"},
        {"prompt": "b", "answer": "\\frac{1}{2}"},
        {"prompt": "c", "answer": "\\boxed{}"},
    ]
    path = _jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(UserInputError) as info:
        load_split({"dataset_name": "jsonl", "train_data_path": path}, "prompts", "train")
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(f"{path}:3: answer '\\\\boxed{{}}' cannot be graded")
    assert "env.math.math_verify_impl" in info.value.problems[0]


def test_unknown_dataset_name(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as info:
        data_settings({"data": {"dataset_name": "no-such-set"}}, base_dir=tmp_path)
    assert any("no-such-set" in line for line in info.value.problems)


def test_encode_sft_marks_the_prompt() -> None:
    tok = ByteTokenizer()
    (enc,) = encode_and_check_lengths([{"prompt": "ab", "response": "c"}], tok, 10, "x")
    assert enc == EncodedExample(input_ids=[257, 97, 98, 99, 258], prompt_len=3)


def test_encode_preference_and_prompts() -> None:
    tok = ByteTokenizer()
    pair, prompt = encode_and_check_lengths(
        [{"prompt": "a", "chosen": "b", "rejected": "cd"}, {"prompt": "xy", "answer": "1"}],
        tok,
        10,
        "x",
    )
    assert pair == EncodedExample([257, 97, 98, 258], 2, rejected_ids=[257, 97, 99, 100, 258])
    assert prompt == EncodedExample([257, 120, 121], 3, ground_truth="1")


def test_encode_without_specials() -> None:
    (enc,) = encode_and_check_lengths(
        [{"prompt": "a", "response": "b"}], ByteTokenizer(), 2, "x", add_bos=False, add_eos=False
    )
    assert enc == EncodedExample([97, 98], 1)


def test_length_limit_is_inclusive() -> None:
    tok = ByteTokenizer()
    ok = {"prompt": "a" * 6, "response": "b" * 2}  # bos + 6 + 2 + eos = 10
    assert len(encode_and_check_lengths([ok], tok, 10, "x")[0].input_ids) == 10
    with pytest.raises(UserInputError):
        encode_and_check_lengths([ok], tok, 9, "x")


def test_length_errors_list_every_offender(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    examples = [
        {"prompt": "a" * 600, "response": "b" * 98, "line": 3},  # 700 tokens with bos and eos
        {"prompt": "short", "response": "ok", "line": 4},
        {"prompt": "p", "chosen": "c", "rejected": "r" * 600, "line": 9},
        {"prompt": "q" * 513},
    ]
    with pytest.raises(UserInputError) as info:
        encode_and_check_lengths(examples, tok, 512, "data.train_data_path")
    assert info.value.problems == [
        "data.train_data_path:3: prompt+response is 700 tokens, longer than "
        "policy.max_total_sequence_length 512; shorten it or raise the limit",
        "data.train_data_path:9: prompt+rejected is 603 tokens, longer than "
        "policy.max_total_sequence_length 512; shorten it or raise the limit",
        "data.train_data_path:3: prompt is 514 tokens, longer than "
        "policy.max_total_sequence_length 512; shorten it or raise the limit",
    ]


def test_length_error_custom_limit_name_and_cap() -> None:
    examples = [{"prompt": "long prompt"}] * 25
    with pytest.raises(UserInputError) as info:
        encode_and_check_lengths(
            examples,
            ByteTokenizer(),
            4,
            "data.val_data_path",
            limit_name="data.max_input_seq_length",
        )
    problems = info.value.problems
    assert len(problems) == 21
    assert problems[0] == (
        "data.val_data_path:0: prompt is 12 tokens, longer than data.max_input_seq_length 4; "
        "shorten it or raise the limit"
    )
    assert problems[-1] == "data.val_data_path: 5 more examples too long"


# ------------------------------------------------------------- data.max_input_seq_length


def test_max_input_seq_length_cuts_and_masks_prompts_at_or_over_it() -> None:
    tok = ByteTokenizer()
    examples = [{"prompt": "abcdefgh"}, {"prompt": "abcdefghi"}, {"prompt": "abc"}]
    # bos + 8 bytes = 9 tokens: reaching the limit cuts it (NeMo-RL's >=), to 4 tokens.
    cut, over, kept = encode_and_check_lengths(examples, tok, 64, "data", max_input_len=9)
    assert (cut.loss_multiplier, len(cut.input_ids), cut.prompt_len) == (0.0, 4, 4)
    assert (over.loss_multiplier, len(over.input_ids)) == (0.0, 4)
    assert (kept.loss_multiplier, kept.input_ids) == (1.0, tok.encode("abc", add_bos=True))


def test_max_input_seq_length_cuts_each_part_of_an_sft_example() -> None:
    tok = ByteTokenizer()
    (cut,) = encode_and_check_lengths(
        [{"prompt": "abcdefgh", "response": "ijklmnop"}], tok, 64, "data", max_input_len=10
    )
    assert cut.loss_multiplier == 0.0 and cut.prompt_len == 4 and len(cut.input_ids) == 8
    (short,) = encode_and_check_lengths(
        [{"prompt": "ab", "response": "c"}], tok, 64, "data", max_input_len=6
    )
    assert short.loss_multiplier == 1.0  # bos + 2 + 1 + eos = 5 < 6


def test_max_input_seq_length_cuts_a_pair_only_over_it() -> None:
    tok = ByteTokenizer()
    pair = {"prompt": "ab", "chosen": "cd", "rejected": "e"}  # chosen: 1 + 2 + 2 + 1 = 6
    (at,) = encode_and_check_lengths([pair], tok, 64, "data", max_input_len=6)
    assert at.loss_multiplier == 1.0  # NeMo-RL's preference rule is strictly longer
    (over,) = encode_and_check_lengths([pair], tok, 64, "data", max_input_len=5)
    assert over.loss_multiplier == 0.0 and over.rejected_ids is not None


def test_a_cut_example_no_longer_trips_the_total_length_check() -> None:
    tok = ByteTokenizer()
    long = [{"prompt": "x" * 100}]
    with pytest.raises(UserInputError, match="longer than policy.max_total_sequence_length"):
        encode_and_check_lengths(long, tok, 64, "data")
    (cut,) = encode_and_check_lengths(long, tok, 64, "data", max_input_len=64)
    assert cut.loss_multiplier == 0.0
    # Over max_total_sequence_length but under max_input_seq_length: refused, not cut.
    with pytest.raises(UserInputError, match="longer than policy.max_total_sequence_length"):
        encode_and_check_lengths(long, tok, 64, "data", max_input_len=200)
