"""NeMo-RL's processors that make a prompt to sample from, with what the environment grades the
sample against (GRPO and distillation datasets): ``math_hf_data_processor`` (also NeMo-RL's
``default``), ``math_data_processor``, ``multichoice_qa_processor``,
``helpsteer3_data_processor`` and the NeMo-Gym placeholder ``nemo_gym_data_processor``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from nemo_rl_offload.config.processor_flags import ProcessorFlags
from nemo_rl_offload.data.processors.chat_turns import (
    Turn,
    cut_turns,
    format_prompt,
    messages_of,
    render,
    total_length,
)
from nemo_rl_offload.data.processors.layout import prompt_example
from nemo_rl_offload.data.rows import DataRow, EncodedExample
from nemo_rl_offload.data.tokenizer import ChatTokenizer
from nemo_rl_offload.errors import UserInputError

__all__ = [
    "helpsteer3_data_processor",
    "math_data_processor",
    "math_hf_data_processor",
    "multichoice_qa_processor",
    "nemo_gym_data_processor",
]


def _field(row: DataRow, key: str, processor: str) -> Any:
    if key not in row.datum:
        raise UserInputError(
            f"{row.where}: {processor} needs '{key}' in the row; fix the row (or the dataset's "
            "column mapping)"
        )
    return row.datum[key]


def _task_name(row: DataRow) -> str:
    return str(row.datum.get("task_name") or row.task.task_name)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _cut_if_long(turns: list[Turn], max_seq_length: int) -> tuple[list[Turn], float]:
    """NeMo-RL's rule for a prompt at or over the limit: each turn cut to
    ``min(4, max_seq_length // turns)`` ids and a zero loss multiplier."""
    if total_length(turns) >= max_seq_length:
        return cut_turns(turns, min(4, max_seq_length // len(turns))), 0.0
    return turns, 1.0


def _rendered_turn(
    tokenizer: ChatTokenizer, row: DataRow, message: dict[str, Any], generation_prompt: bool
) -> Turn:
    text = render(tokenizer, row, [message], add_generation_prompt=generation_prompt)
    return message["role"], tokenizer.encode(text)


def math_hf_data_processor(
    row: DataRow, tokenizer: ChatTokenizer, max_seq_length: int, flags: ProcessorFlags
) -> EncodedExample:
    """``messages``: the problem (first message) and its answer (second); the system prompt and
    the prompt-formatted problem rendered together with the generation prompt, as one turn."""
    name = "math_hf_data_processor"
    messages = messages_of(row, "messages", name, at_least=2)
    problem = messages[0].get("content")
    chat: list[dict[str, Any]] = []
    if row.task.system_prompt:
        chat.append({"role": "system", "content": row.task.system_prompt})
    content = format_prompt(row.task.prompt, problem, row) if row.task.prompt else problem
    chat.append({"role": "user", "content": content})
    text = render(tokenizer, row, chat, add_generation_prompt=True)
    turns, multiplier = _cut_if_long([("user", tokenizer.encode(text))], max_seq_length)
    return prompt_example(
        turns,
        row,
        loss_multiplier=multiplier,
        ground_truth=_text(messages[1].get("content")),
        task_name=_task_name(row),
    )


def math_data_processor(
    row: DataRow, tokenizer: ChatTokenizer, max_seq_length: int, flags: ProcessorFlags
) -> EncodedExample:
    """``problem`` and ``expected_answer``: the system prompt and the prompt-formatted problem
    each rendered on its own (two turns), the problem's with the generation prompt."""
    name = "math_data_processor"
    problem = _field(row, "problem", name)
    answer = str(_field(row, "expected_answer", name))
    turns: list[Turn] = []
    if row.task.system_prompt:
        system = {"role": "system", "content": row.task.system_prompt}
        turns.append(_rendered_turn(tokenizer, row, system, False))
    if row.task.prompt:
        problem = format_prompt(row.task.prompt, problem, row)
    turns.append(_rendered_turn(tokenizer, row, {"role": "user", "content": problem}, True))
    turns, multiplier = _cut_if_long(turns, max_seq_length)
    return prompt_example(
        turns, row, loss_multiplier=multiplier, ground_truth=answer, task_name=_task_name(row)
    )


def _multichoice_prompt(prompt: str, question: Any, options: Mapping[str, Any]) -> str:
    lines = "\n".join(f"{key}) {value}" for key, value in options.items() if value is not None)
    return f"{prompt}\n\nQuestion: {question}\nOptions:\n{lines}"


def multichoice_qa_processor(
    row: DataRow, tokenizer: ChatTokenizer, max_seq_length: int, flags: ProcessorFlags
) -> EncodedExample:
    """``question``, ``answer`` and ``options`` (letter to text): with a prompt file, the prompt
    then the question and its lettered options; without one, the question alone. NeMo-RL
    applies no length rule here."""
    name = "multichoice_qa_processor"
    question = _field(row, "question", name)
    answer = str(_field(row, "answer", name))
    options = _field(row, "options", name)
    if not isinstance(options, Mapping):
        raise UserInputError(
            f"{row.where}: {name} needs 'options' as a mapping of letters to option texts"
        )
    turns: list[Turn] = []
    if row.task.system_prompt:
        system = {"role": "system", "content": row.task.system_prompt}
        turns.append(_rendered_turn(tokenizer, row, system, False))
    if row.task.prompt:
        question = _multichoice_prompt(row.task.prompt, question, options)
    turns.append(_rendered_turn(tokenizer, row, {"role": "user", "content": question}, True))
    return prompt_example(
        turns, row, loss_multiplier=1.0, ground_truth=answer, task_name=_task_name(row)
    )


def helpsteer3_data_processor(
    row: DataRow, tokenizer: ChatTokenizer, max_seq_length: int, flags: ProcessorFlags
) -> EncodedExample:
    """``context`` (messages, or a user's text) and ``response`` (the preferred messages): the
    whole conversation rendered as one prompt; the ground truth is the response's texts joined
    by spaces. As in NeMo-RL, each message after the first adds what the tokenizer itself puts
    around an empty text (a Llama tokenizer's bos token), and an example at or over the limit
    keeps ``max_seq_length // messages`` ids of each message."""
    name = "helpsteer3_data_processor"
    context = _field(row, "context", name)
    response = messages_of(row, "response", name)
    if isinstance(context, str):
        chat = [{"role": "user", "content": context}]
    else:
        chat = [
            {"role": m["role"], "content": m.get("content")}
            for m in messages_of(row, "context", name)
        ]
    chat += [{"role": m["role"], "content": m.get("content")} for m in response]
    text = render(tokenizer, row, chat, add_generation_prompt=False, add_special_tokens=True)
    empty = tokenizer.encode("", add_special_tokens=True)
    turns: list[Turn] = [(chat[0]["role"], tokenizer.encode(text))]
    turns += [(m["role"], list(empty)) for m in chat[1:]]
    multiplier = 1.0
    if total_length(turns) >= max_seq_length:
        turns, multiplier = cut_turns(turns, max_seq_length // len(turns)), 0.0
    truth = " ".join(str(m.get("content")) for m in response)
    task_name = _text(row.datum.get("task_name")) or row.task.task_name
    return prompt_example(
        turns, row, loss_multiplier=multiplier, ground_truth=truth, task_name=task_name
    )


def nemo_gym_data_processor(
    row: DataRow, tokenizer: ChatTokenizer, max_seq_length: int, flags: ProcessorFlags
) -> EncodedExample:
    """A NeMo-Gym row: no tokens here (NeMo-Gym's agents build the prompt when they run the
    row); ``extra_env_info`` must be a JSON object, as NeMo-RL parses it."""
    name = "nemo_gym_data_processor"
    info = _field(row, "extra_env_info", name)
    try:
        parsed = json.loads(info) if isinstance(info, str) else info
    except json.JSONDecodeError as exc:
        parsed = exc
    if not isinstance(parsed, Mapping):
        raise UserInputError(
            f"{row.where}: {name} needs 'extra_env_info' as a JSON object (the row as NeMo-Gym "
            "gives it)"
        )
    return EncodedExample(
        input_ids=[], prompt_len=0, task_name=_task_name(row), env_name=row.env_name
    )
