"""Turns become an :class:`EncodedExample`: which tokens are the prompt and which never train.

NeMo-RL keeps a list of turns and masks them when it batches: GRPO's prompt is every turn; SFT
trains the assistant turns (``sft.only_unmask_final``: the last turn only); DPO trains the
last turn of each sequence. Here the same masks are ``prompt_len`` (everything before the first
trained turn) and ``masked_spans`` (untrained turns after it).
"""

from __future__ import annotations

from nemo_rl_offload.data.processors.chat_turns import Turn
from nemo_rl_offload.data.rows import DataRow, EncodedExample
from nemo_rl_offload.errors import UserInputError

__all__ = ["conversation_example", "preference_example", "prompt_example"]


def _flat(turns: list[Turn]) -> list[int]:
    return [token for _, ids in turns for token in ids]


def prompt_example(
    turns: list[Turn],
    row: DataRow,
    *,
    loss_multiplier: float,
    ground_truth: str | None,
    task_name: str | None,
) -> EncodedExample:
    """A prompt to sample from (GRPO, distillation): every token is prompt."""
    ids = _flat(turns)
    return EncodedExample(
        input_ids=ids,
        prompt_len=len(ids),
        loss_multiplier=loss_multiplier,
        ground_truth=ground_truth,
        task_name=task_name,
        env_name=row.env_name,
    )


def _trained(turns: list[Turn], only_final: bool) -> list[bool]:
    if only_final:
        return [index == len(turns) - 1 for index in range(len(turns))]
    return [role == "assistant" for role, _ in turns]


def _mask_layout(turns: list[Turn], only_final: bool) -> tuple[int, tuple[tuple[int, int], ...]]:
    """``prompt_len`` and the merged ``[start, end)`` spans of untrained turns after it."""
    trained = _trained(turns, only_final)
    offsets = [0]
    for _, ids in turns:
        offsets.append(offsets[-1] + len(ids))
    first = next((i for i, t in enumerate(trained) if t and offsets[i + 1] > offsets[i]), None)
    if first is None:
        return offsets[-1], ()
    spans: list[tuple[int, int]] = []
    for index in range(first + 1, len(turns)):
        start, end = offsets[index], offsets[index + 1]
        if trained[index] or start == end:
            continue
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return offsets[first], tuple(spans)


def conversation_example(
    turns: list[Turn],
    row: DataRow,
    *,
    loss_multiplier: float,
    only_unmask_final: bool,
    task_name: str | None,
) -> EncodedExample:
    """A conversation to train on (SFT): assistant turns train (or only the last turn)."""
    prompt_len, spans = _mask_layout(turns, only_unmask_final)
    return EncodedExample(
        input_ids=_flat(turns),
        prompt_len=prompt_len,
        masked_spans=spans,
        loss_multiplier=loss_multiplier,
        task_name=task_name,
        env_name=row.env_name,
    )


def preference_example(
    chosen: list[Turn],
    rejected: list[Turn],
    row: DataRow,
    *,
    loss_multiplier: float,
    task_name: str | None,
) -> EncodedExample:
    """A preference pair (DPO, reward models): each sequence trains on its last turn only, and
    both share everything before it (the context)."""
    chosen_ids, rejected_ids = _flat(chosen), _flat(rejected)
    prompt_len = len(chosen_ids) - len(chosen[-1][1])
    rejected_prompt_len = len(rejected_ids) - len(rejected[-1][1])
    if prompt_len != rejected_prompt_len or chosen_ids[:prompt_len] != rejected_ids[:prompt_len]:
        raise UserInputError(
            f"{row.where}: the chosen and rejected completions differ before their last "
            "message; only a completion's last message trains and both must share everything "
            "before it, so put the shared turns in 'context' and one message in each completion"
        )
    return EncodedExample(
        input_ids=chosen_ids,
        rejected_ids=rejected_ids,
        prompt_len=prompt_len,
        loss_multiplier=loss_multiplier,
        task_name=task_name,
        env_name=row.env_name,
    )
