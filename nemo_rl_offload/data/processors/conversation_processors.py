"""NeMo-RL's processors that make conversations to train on: ``sft_processor`` (SFT) and
``preference_preprocessor`` (every preference dataset of DPO and reward models)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nemo_rl_offload.config.processor_flags import ProcessorFlags
from nemo_rl_offload.data.processors.chat_turns import (
    checked_messages,
    cut_turns,
    formatted_turns,
    messages_of,
    total_length,
)
from nemo_rl_offload.data.processors.layout import conversation_example, preference_example
from nemo_rl_offload.data.rows import DataRow, EncodedExample
from nemo_rl_offload.data.tokenizer import ChatTokenizer
from nemo_rl_offload.errors import UserInputError

__all__ = ["preference_preprocessor", "sft_processor"]


def _task_name(row: DataRow) -> str:
    return str(row.datum.get("task_name") or row.task.task_name)


def sft_processor(
    row: DataRow, tokenizer: ChatTokenizer, max_seq_length: int, flags: ProcessorFlags
) -> EncodedExample:
    """``messages`` (and ``tools``, given to the template) turn by turn with ``flags``; the
    assistant turns train. At or over the limit, each turn keeps
    ``min(4, max_seq_length // turns)`` ids and the loss multiplier is 0."""
    if row.datum.get("task_name") == "clevr-cogent":
        raise UserInputError(
            f"{row.where}: clevr-cogent is an image dataset; vision-language data is not supported"
        )
    messages = messages_of(row, "messages", "sft_processor")
    turns = formatted_turns(
        tokenizer,
        row,
        messages,
        add_bos=flags.add_bos,
        add_eos=flags.add_eos,
        add_generation_prompt=flags.add_generation_prompt,
        tools=row.datum.get("tools"),
    )
    multiplier = 1.0
    if total_length(turns) >= max_seq_length:
        turns, multiplier = cut_turns(turns, min(4, max_seq_length // len(turns))), 0.0
    return conversation_example(
        turns,
        row,
        loss_multiplier=multiplier,
        only_unmask_final=flags.only_unmask_final,
        task_name=_task_name(row),
    )


def _ranked(row: DataRow) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chosen and rejected completions' messages (the lower rank is preferred)."""
    completions = row.datum.get("completions")
    if not (
        isinstance(completions, list)
        and len(completions) == 2
        and all(isinstance(c, Mapping) and _is_number(c.get("rank")) for c in completions)
    ):
        raise UserInputError(
            f"{row.where}: preference rows need 'completions', exactly two of "
            "{rank, completion: [messages]} (the lower rank preferred)"
        )
    first, second = completions
    if first["rank"] == second["rank"]:
        raise UserInputError(
            f"{row.where}: both completions have rank {first['rank']}; ties are not supported "
            "(NeMo-RL's filter: jq 'select(.completions[0].rank != .completions[1].rank)')"
        )
    chosen, rejected = (first, second) if first["rank"] < second["rank"] else (second, first)
    return tuple(  # type: ignore[return-value]
        checked_messages(c.get("completion"), row.where, f"the rank-{c['rank']} completion")
        for c in (chosen, rejected)
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def preference_preprocessor(
    row: DataRow, tokenizer: ChatTokenizer, max_seq_length: int, flags: ProcessorFlags
) -> EncodedExample:
    """``context`` then each completion, turn by turn (bos and eos added, no generation
    prompt; NeMo-RL passes no flags here); a context of several turns is tokenized turn by turn
    and never trains, nor does anything before a completion's last message. Over the limit
    (longer than it, not equal), each turn keeps ``min(4, max_seq_length // turns)`` ids and
    the loss multiplier is 0."""
    context = messages_of(row, "context", "preference_preprocessor", at_least=0)
    chosen_messages, rejected_messages = _ranked(row)
    chosen = formatted_turns(tokenizer, row, context + chosen_messages)
    rejected = formatted_turns(tokenizer, row, context + rejected_messages)
    multiplier = 1.0
    if max(total_length(chosen), total_length(rejected)) > max_seq_length:
        chosen = cut_turns(chosen, min(4, max_seq_length // len(chosen)))
        rejected = cut_turns(rejected, min(4, max_seq_length // len(rejected)))
        multiplier = 0.0
    return preference_example(
        chosen, rejected, row, loss_multiplier=multiplier, task_name=_task_name(row)
    )
