"""NeMo-RL's processors: the exact ids, loss masks, length rule and ground truths of NeMo-RL's
own code (tests/data/processors/expected.json, its note says how they were produced) on
Llama-like, Qwen-like and byte tokenizers; and every refusal, both ways."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.chat_tokenizers import save

from nemo_rl_offload.config.processor_names import PROCESSOR_EXAMPLES
from nemo_rl_offload.config.tokenizer_settings import tokenizer_settings
from nemo_rl_offload.data.processors import (
    NOT_SUPPORTED,
    PROCESSORS,
    ProcessorFlags,
    process,
    processor_named,
)
from nemo_rl_offload.data.processors.chat_turns import formatted_turns
from nemo_rl_offload.data.rows import DataRow, EncodedExample, TaskSpec
from nemo_rl_offload.data.tokenizer import ByteTokenizer, HFTokenizer
from nemo_rl_offload.errors import UserInputError

EXPECTED = Path(__file__).resolve().parents[2] / "data" / "processors" / "expected.json"
CASES: list[dict[str, Any]] = json.loads(EXPECTED.read_text())["cases"]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {kind: save(kind, root / kind) for kind in ("llama", "qwen")}


def _tokenizer(kind: str, config: dict[str, Any], dirs: dict[str, Path]):
    settings = tokenizer_settings({"tokenizer": config})
    template = {
        "chat_template": settings.chat_template,
        "chat_template_kwargs": settings.chat_template_kwargs,
    }
    if kind == "byte":
        return ByteTokenizer(**template)
    return HFTokenizer(str(dirs[kind]), **template)


def _row(datum: dict[str, Any], processor: str, task: TaskSpec | None = None) -> DataRow:
    return DataRow(
        datum=datum,
        processor=processor,
        task=task or TaskSpec(task_name="t"),
        env_name="math",
        where="data.train[0]: row 3",
    )


def _trained(example: EncodedExample, ids: list[int]) -> list[int]:
    spans = example.masked_spans
    return [
        int(i >= example.prompt_len and not any(a <= i < b for a, b in spans))
        for i in range(len(ids))
    ]


def _flat(log: list[dict[str, Any]], key: str) -> list[int]:
    return [t for m in log for t in m.get(key, [0] * len(m["token_ids"]))]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_ids_and_masks_are_nemo_rls(case: dict[str, Any], tokenizer_dirs) -> None:
    tokenizer = _tokenizer(case["tokenizer"], case["tokenizer_config"], tokenizer_dirs)
    row = _row(case["datum"], case["processor"], TaskSpec(**case["task"]))
    example = process(row, tokenizer, case["max_seq_length"], ProcessorFlags(**case["flags"]))
    expected = case["expected"]
    assert example.loss_multiplier == expected["loss_multiplier"]
    assert example.env_name == "math"
    if "message_log_chosen" in expected:
        chosen, rejected = expected["message_log_chosen"], expected["message_log_rejected"]
        assert example.input_ids == _flat(chosen, "token_ids")
        assert example.rejected_ids == _flat(rejected, "token_ids")
        assert _trained(example, example.input_ids) == _flat(chosen, "token_loss_mask")
        assert _trained(example, example.rejected_ids) == _flat(rejected, "token_loss_mask")
        return
    log = expected["message_log"]
    assert example.input_ids == _flat(log, "token_ids")
    assert example.rejected_ids is None
    assert _trained(example, example.input_ids) == _flat(log, "token_loss_mask")
    if case["processor"] != "sft_processor":  # a prompt to sample from
        assert example.prompt_len == len(example.input_ids) and not example.masked_spans
        assert example.ground_truth == expected["extra_env_info"]["ground_truth"]
        assert example.task_name == (expected["task_name"] or case["task"]["task_name"])
    else:
        assert example.ground_truth is None


def test_the_cases_cover_every_processor_and_rule() -> None:
    names = {c["name"].split("/")[0] for c in CASES}
    assert {c["processor"] for c in CASES} == set(PROCESSORS) - {"nemo_gym_data_processor"}
    assert {c["tokenizer"] for c in CASES} == {"llama", "qwen", "byte"}
    assert {"math_hf_over_length", "sft_over_length", "preference_over_length"} <= names
    assert any(e["expected"]["loss_multiplier"] == 0.0 for e in CASES)
    # An SFT example's later user turns are masked spans, not prompt.
    multi = next(c for c in CASES if c["name"] == "sft_multi/llama")
    roles = [m["role"] for m in multi["expected"]["message_log"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]


def test_turns_are_encoded_one_by_one_as_nemo_rl_does(tokenizer_dirs) -> None:
    """The ids differ from encoding the whole text when a merge spans two turns."""
    case = next(c for c in CASES if c["name"] == "sft_abutting_passthrough/llama")
    tokenizer = _tokenizer("llama", case["tokenizer_config"], tokenizer_dirs)
    ids = _flat(case["expected"]["message_log"], "token_ids")
    assert tokenizer.encode(tokenizer.decode(ids, skip_special=False)) != ids
    row = _row(case["datum"], "sft_processor")
    assert process(row, tokenizer, 256, ProcessorFlags()).input_ids == ids


def test_an_sft_conversation_masks_later_user_turns() -> None:
    tokenizer = ByteTokenizer()
    datum = next(c for c in CASES if c["name"] == "sft_multi/byte")["datum"]
    example = process(_row(datum, "sft_processor"), tokenizer, 512)
    text = tokenizer.decode(example.input_ids, skip_special=False)
    assert text.startswith("<bos><|system|>\nBe brief.\n<|user|>\nWhat is 2+2?\n")
    first_answer = "<|assistant|>\nIt is 4.<eos>"
    assert (
        tokenizer.decode(example.input_ids[: example.prompt_len], skip_special=False)
        == (text[: text.index(first_answer)])
    )
    ((start, end),) = example.masked_spans
    assert tokenizer.decode(example.input_ids[start:end]) == "<|user|>\nAnd 2+3?\n"


# ----------------------------------------------------------------------------- the registry


def test_the_registry_runs_every_name_validate_accepts() -> None:
    """config/processor_names.py checks a recipe's names at validate; every name there runs."""
    assert set(PROCESSORS) == set(PROCESSOR_EXAMPLES)
    assert not set(PROCESSORS) & set(NOT_SUPPORTED)


def test_known_processors_resolve_and_unknown_ones_are_one_line() -> None:
    for name in PROCESSORS:
        assert processor_named(name, "data.default.processor") is PROCESSORS[name]
    with pytest.raises(UserInputError) as info:
        processor_named("math_processor", "data.train[1].processor")
    (line,) = info.value.problems
    assert line.startswith("data.train[1].processor: unknown processor 'math_processor'; ")
    assert "math_hf_data_processor" in line and "sft_processor" in line
    with pytest.raises(UserInputError, match="unknown processor None"):
        processor_named(None, "data.default.processor")


@pytest.mark.parametrize("name", sorted(NOT_SUPPORTED))
def test_multimodal_and_cross_tokenizer_processors_are_refused(name: str) -> None:
    with pytest.raises(UserInputError) as info:
        process(_row({"messages": []}, name), ByteTokenizer(), 64)
    (line,) = info.value.problems
    assert line.startswith(f"data.train[0]: row 3: processor: '{name}' is NeMo-RL's ")
    assert "not supported" in line


def test_default_is_math_hf_data_processor() -> None:
    assert PROCESSORS["default"] is PROCESSORS["math_hf_data_processor"]


# --------------------------------------------------------------------------- the prompt file

_MATH = {
    "messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}],
    "task_name": "math",
}


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        ("Solve the problem.", "it has no '{}'"),
        ("Solve {problem}", "'problem'"),
        ("Use \\boxed{} then {}", "Replacement index 1"),
        ("Unclosed {", "Single '{'"),
    ],
)
def test_a_prompt_file_that_cannot_take_the_problem_is_refused(prompt: str, why: str) -> None:
    task = TaskSpec(task_name="math", prompt=prompt)
    with pytest.raises(UserInputError) as info:
        process(_row(_MATH, "math_hf_data_processor", task), ByteTokenizer(), 256)
    (line,) = info.value.problems
    assert line.startswith("data.train[0]: row 3: the task's prompt file cannot take the problem")
    assert why in line


def test_a_prompt_file_with_its_placeholder_and_doubled_braces_is_used() -> None:
    task = TaskSpec(task_name="math", prompt="Put it in \\boxed{{}}: {}")
    example = process(_row(_MATH, "math_hf_data_processor", task), ByteTokenizer(), 256)
    assert ByteTokenizer().decode(example.input_ids) == (
        "<|user|>\nPut it in \\boxed{}: 1+1?\n<|assistant|>\n"
    )


# ------------------------------------------------------------------------------ the rows


@pytest.mark.parametrize(
    ("processor", "datum", "needs"),
    [
        ("math_hf_data_processor", {"messages": [{"role": "user", "content": "x"}]}, "'messages'"),
        ("math_hf_data_processor", {"messages": "x"}, "'messages'"),
        ("sft_processor", {"messages": [{"content": "no role"}]}, "'messages'"),
        ("math_data_processor", {"problem": "x"}, "'expected_answer'"),
        ("multichoice_qa_processor", {"question": "q", "answer": "A", "options": [1]}, "options"),
        ("helpsteer3_data_processor", {"context": "hi"}, "'response'"),
        ("nemo_gym_data_processor", {"extra_env_info": "{not json"}, "'extra_env_info'"),
        ("preference_preprocessor", {"context": [], "completions": []}, "exactly two"),
    ],
)
def test_a_row_missing_what_its_processor_needs_is_one_line(
    processor: str, datum: dict[str, Any], needs: str
) -> None:
    with pytest.raises(UserInputError) as info:
        process(_row(datum, processor), ByteTokenizer(), 256)
    (line,) = info.value.problems
    assert line.startswith("data.train[0]: row 3: ") and needs in line


def test_a_nemo_gym_row_has_no_tokens_here() -> None:
    row = _row(
        {"extra_env_info": json.dumps({"agent_ref": {"name": "a"}}), "task_name": "g"},
        "nemo_gym_data_processor",
    )
    example = process(row, ByteTokenizer(), 256)
    assert (example.input_ids, example.prompt_len, example.task_name) == ([], 0, "g")


def _pref(chosen: list[dict[str, Any]], rejected: list[dict[str, Any]], ranks=(0, 1)):
    return {
        "context": [{"role": "user", "content": "q"}],
        "completions": [
            {"rank": ranks[0], "completion": chosen},
            {"rank": ranks[1], "completion": rejected},
        ],
    }


def test_a_preference_tie_is_refused_with_nemo_rls_filter() -> None:
    one = [{"role": "assistant", "content": "a"}]
    with pytest.raises(UserInputError, match=r"both completions have rank 1; ties .* jq"):
        process(_row(_pref(one, one, (1, 1)), "preference_preprocessor"), ByteTokenizer(), 64)


def test_completions_of_several_messages_must_share_all_but_the_last() -> None:
    call = {"role": "assistant", "content": "let me check"}
    tool = {"role": "tool", "content": "4"}
    same = _pref(
        [call, tool, {"role": "assistant", "content": "4"}],
        [call, tool, {"role": "assistant", "content": "5"}],
    )
    example = process(_row(same, "preference_preprocessor"), ByteTokenizer(), 256)
    tok = ByteTokenizer()
    assert tok.decode(example.input_ids[example.prompt_len :]) == "<|assistant|>\n4"
    assert tok.decode(example.rejected_ids[example.prompt_len :]) == "<|assistant|>\n5"
    differ = _pref(
        [call, {"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
    )
    with pytest.raises(UserInputError, match="differ before their last message"):
        process(_row(differ, "preference_preprocessor"), ByteTokenizer(), 256)


def test_images_are_refused_and_text_parts_take_the_prompt() -> None:
    template = (
        "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
    )
    tok = ByteTokenizer(chat_template=template)
    parts = [{"type": "text", "text": "1+1?"}]
    row = _row(
        {"messages": [{"role": "user", "content": parts}]},
        "sft_processor",
        TaskSpec(task_name="t", prompt="Q: {}"),
    )
    turns = formatted_turns(tok, row, list(row.datum["messages"]), add_bos=False, add_eos=False)
    assert tok.decode(turns[0][1]) == "Q: 1+1?"
    assert parts == [{"type": "text", "text": "1+1?"}]  # the row is not changed
    image = [{"type": "image", "image": "cat.png"}, *parts]
    with pytest.raises(UserInputError, match="message 0 has image content; .* not supported"):
        process(_row({"messages": [{"role": "user", "content": image}]}, "sft_processor"), tok, 64)
    with pytest.raises(UserInputError, match="clevr-cogent is an image dataset"):
        process(_row({**_MATH, "task_name": "clevr-cogent"}, "sft_processor"), tok, 64)


def test_a_template_that_refuses_a_row_names_the_row() -> None:
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    tok = ByteTokenizer(chat_template=strict)
    assert process(_row(_MATH, "sft_processor"), tok, 64).input_ids
    with_system = {"messages": [{"role": "system", "content": "s"}, *_MATH["messages"]]}
    with pytest.raises(UserInputError) as info:
        process(_row(with_system, "sft_processor"), tok, 64)
    (line,) = info.value.problems
    assert line.startswith(
        "data.train[0]: row 3: the chat template cannot render this row (System role not supported)"
    )


def test_a_hugging_face_tokenizer_without_a_template_needs_one(tmp_path: Path) -> None:
    from support.chat_tokenizers import build

    bare = build("qwen")
    bare.chat_template = None
    bare.save_pretrained(tmp_path)
    with pytest.raises(UserInputError, match="policy.tokenizer.chat_template: the tokenizer in"):
        process(_row(_MATH, "math_hf_data_processor"), HFTokenizer(str(tmp_path)), 64)
    given = HFTokenizer(str(tmp_path), chat_template="{{ messages[0]['content'] }}")
    example = process(_row(_MATH, "math_hf_data_processor"), given, 64)
    assert given.decode(example.input_ids) == "1+1?"
