"""JSON-lines loaders: canonical keys, and one exact line per problem with its line number."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl_offload.data import jsonl
from nemo_rl_offload.errors import UserInputError

WHERE = "data.train_data_path"


def _write(tmp_path: Path, text: str | bytes, name: str = "data.jsonl") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def _problems(fn, path: str, **keys) -> list[str]:
    with pytest.raises(UserInputError) as info:
        fn(path, where=WHERE, **keys)
    return info.value.problems


def test_sft_default_keys_and_blank_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '{"input": "Q", "output": "A", "extra": 1}\n\n   \n{"input": "q2", "output": ""}\n',
    )
    assert jsonl.load_sft(path, where=WHERE) == [
        {"prompt": "Q", "response": "A", "line": 1},
        {"prompt": "q2", "response": "", "line": 4},
    ]


def test_sft_custom_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"question": "Q", "solution": "A"}\n')
    got = jsonl.load_sft(path, where=WHERE, input_key="question", output_key="solution")
    assert got == [{"prompt": "Q", "response": "A", "line": 1}]


def test_preference_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"p": "Q", "good": " 1", "bad": " 2"}\n')
    got = jsonl.load_preference(
        path, where=WHERE, prompt_key="p", chosen_key="good", rejected_key="bad"
    )
    assert got == [{"prompt": "Q", "chosen": " 1", "rejected": " 2", "line": 1}]
    assert jsonl.load_preference(
        _write(tmp_path, '{"prompt": "x", "chosen": "y", "rejected": "z"}', "d.jsonl"), where=WHERE
    ) == [{"prompt": "x", "chosen": "y", "rejected": "z", "line": 1}]


def test_prompts_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"prompt": "Q: 1+1=? A:", "answer": "2"}\r\n')
    assert jsonl.load_prompts(path, where=WHERE) == [
        {"prompt": "Q: 1+1=? A:", "answer": "2", "line": 1}
    ]
    bad = _write(tmp_path, '{"prompt": "x", "answer": "1"}\r\n{"q": "x", "a": "3"}\r\n', "b.jsonl")
    assert _problems(jsonl.load_prompts, bad) == [
        f"{bad}:2: missing key 'prompt' (set data.prompt_key to the key your file uses)",
        f"{bad}:2: missing key 'answer' (set data.answer_key to the key your file uses)",
    ]


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path, b'\xef\xbb\xbf{"input": "\xc3\xa9", "output": "b"}\n')
    assert jsonl.load_sft(path, where=WHERE) == [{"prompt": "é", "response": "b", "line": 1}]


def test_missing_file_names_the_recipe_key(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.jsonl")
    assert _problems(jsonl.load_sft, path) == [f"{path}: no such file (data.train_data_path)"]
    with pytest.raises(UserInputError) as info:
        jsonl.load_sft(path, where="data.val_data_path")
    assert info.value.problems == [f"{path}: no such file (data.val_data_path)"]


def test_directory_instead_of_file(tmp_path: Path) -> None:
    (line,) = _problems(jsonl.load_sft, str(tmp_path))
    assert line.startswith(f"{tmp_path}: is a directory")


def test_malformed_json(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"input": "a", "output": "b"}\n{"input": "a", "output": }\n')
    assert _problems(jsonl.load_sft, path) == [
        f"{path}:2: not valid JSON (Expecting value at column 26)"
    ]


def test_not_an_object(tmp_path: Path) -> None:
    path = _write(tmp_path, '["a", "b"]\n"text"\n3\nnull\n')
    assert _problems(jsonl.load_sft, path) == [
        f"{path}:1: expected a JSON object, got an array",
        f"{path}:2: expected a JSON object, got str",
        f"{path}:3: expected a JSON object, got a number",
        f"{path}:4: expected a JSON object, got null",
    ]


def test_missing_key_names_the_recipe_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"input": "a", "output": "b"}\n{"input": "a", "response": "b"}\n')
    assert _problems(jsonl.load_sft, path) == [
        f"{path}:2: missing key 'output' (set data.output_key to the key your file uses)"
    ]


def test_missing_custom_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    assert _problems(jsonl.load_preference, path, chosen_key="better") == [
        f"{path}:1: missing key 'better' (set data.chosen_key to the key your file uses)"
    ]


def test_non_string_values(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"prompt": "a", "answer": 85}\n{"prompt": ["x"], "answer": null}\n')
    assert _problems(jsonl.load_prompts, path) == [
        f"{path}:1: 'answer' is a number, expected a string; quote the value",
        f"{path}:2: 'prompt' is an array, expected a string; quote the value",
        f"{path}:2: 'answer' is null, expected a string; quote the value",
    ]


def test_invalid_utf8(tmp_path: Path) -> None:
    path = _write(tmp_path, b'{"input": "a", "output": "b"}\n{"input": "\xff", "output": "b"}\n')
    assert _problems(jsonl.load_sft, path) == [
        f"{path}:2: not valid UTF-8 (byte 12); save the file as UTF-8"
    ]


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    (line,) = _problems(jsonl.load_sft, path)
    assert line.startswith(f"{path}: no examples")


def test_several_bad_lines_reported_together(tmp_path: Path) -> None:
    lines = [
        '{"input": "ok", "output": "ok"}',
        "not json",
        "",
        '{"input": "a"}',
        '{"input": "ok", "output": "ok"}',
        "[1]",
        '{"input": 1, "output": "b"}',
    ]
    path = _write(tmp_path, "\n".join(lines) + "\n")
    assert _problems(jsonl.load_sft, path) == [
        f"{path}:2: not valid JSON (Expecting value at column 1)",
        f"{path}:4: missing key 'output' (set data.output_key to the key your file uses)",
        f"{path}:6: expected a JSON object, got an array",
        f"{path}:7: 'input' is a number, expected a string; quote the value",
    ]


def test_report_is_capped_at_twenty_bad_lines(tmp_path: Path) -> None:
    lines = ['{"input": "a", "output": "b"}'] + ["{bad"] * 25
    path = _write(tmp_path, "\n".join(lines))
    problems = _problems(jsonl.load_sft, path)
    assert len(problems) == jsonl.MAX_REPORTED_LINES + 1
    assert problems[0].startswith(f"{path}:2: not valid JSON")
    assert problems[19].startswith(f"{path}:21: not valid JSON")
    assert problems[-1] == f"{path}: 5 more bad lines not shown"


def test_one_more_bad_line_is_singular(tmp_path: Path) -> None:
    path = _write(tmp_path, "\n".join(["{bad"] * 21))
    assert _problems(jsonl.load_sft, path)[-1] == f"{path}: 1 more bad line not shown"
