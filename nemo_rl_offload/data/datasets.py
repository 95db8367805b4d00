"""Pick the data for a run from the recipe's ``data`` section, and tokenize it with checks.

:func:`load_split` is the single place that knows which dataset names exist; the trainers ask it
for "sft", "preference" or "prompts" examples of the train or val split and get canonical dicts.
:func:`encode_and_check_lengths` tokenizes them and rejects, before training starts, every
example that cannot fit the model's sequence length (silently truncating would train on a cut
answer, or drop the answer a reward needs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nemo_rl_offload.data import arithmetic, jsonl
from nemo_rl_offload.data.tokenizer import Tokenizer
from nemo_rl_offload.environments.math import extract_final_number
from nemo_rl_offload.errors import UserInputError

__all__ = ["EncodedExample", "encode_and_check_lengths", "load_split"]

Kind = Literal["sft", "preference", "prompts"]
Split = Literal["train", "val"]

DEFAULT_NUM_TRAIN = 2000
DEFAULT_NUM_VAL = 200
DEFAULT_SEED = 42
_MAX_REPORTED = 20


def arithmetic_spec(data_cfg: Mapping[str, Any]) -> arithmetic.ArithmeticSpec:
    """The arithmetic task's problem spec from ``data`` (defaults: +, -, * up to 99 / 12)."""
    default = arithmetic.DEFAULT_SPEC
    for key in ("max_operand", "max_factor"):
        value = data_cfg.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserInputError(f"data.{key}: must be an integer >= 1 (got: {value!r})")
    return arithmetic.ArithmeticSpec(
        ops=tuple(data_cfg.get("arithmetic_ops") or default.ops),
        max_operand=int(data_cfg.get("max_operand") or default.max_operand),
        max_factor=int(data_cfg.get("max_factor") or default.max_factor),
    )


def load_split(data_cfg: Mapping[str, Any], kind: Kind, split: Split) -> list[dict[str, Any]]:
    """The ``split`` examples of ``kind`` for the recipe's ``data`` section.

    Examples have canonical keys: prompt/response (sft), prompt/chosen/rejected (preference),
    prompt/answer (prompts); examples read from a file also carry ``line``. A jsonl run without
    ``val_data_path`` has an empty val split.
    """
    if kind not in ("sft", "preference", "prompts"):
        raise ValueError(f"unknown kind {kind!r}; use sft, preference or prompts")
    if split not in ("train", "val"):
        raise ValueError(f"unknown split {split!r}; use train or val")
    name = data_cfg.get("dataset_name")
    if name == "arithmetic":
        train, val = arithmetic.split(
            kind,
            int(data_cfg.get("num_train_samples", DEFAULT_NUM_TRAIN)),
            int(data_cfg.get("num_val_samples", DEFAULT_NUM_VAL)),
            int(data_cfg.get("seed", DEFAULT_SEED)),
            spec=arithmetic_spec(data_cfg),
        )
        return train if split == "train" else val
    if name == "jsonl":
        return _load_jsonl(data_cfg, kind, split)
    raise UserInputError(f"data.dataset_name: unknown dataset '{name}'; use arithmetic or jsonl")


def _load_jsonl(data_cfg: Mapping[str, Any], kind: Kind, split: Split) -> list[dict[str, Any]]:
    key = "train_data_path" if split == "train" else "val_data_path"
    where = f"data.{key}"
    path = data_cfg.get(key)
    if path is None:
        if split == "val":
            return []
        raise UserInputError(
            f"{where}: required when data.dataset_name is 'jsonl'; set it to a JSON-lines file"
        )
    if kind == "sft":
        return jsonl.load_sft(
            path,
            where=where,
            input_key=data_cfg.get("input_key", "input"),
            output_key=data_cfg.get("output_key", "output"),
        )
    if kind == "preference":
        return jsonl.load_preference(
            path,
            where=where,
            prompt_key=data_cfg.get("prompt_key", "prompt"),
            chosen_key=data_cfg.get("chosen_key", "chosen"),
            rejected_key=data_cfg.get("rejected_key", "rejected"),
        )
    examples = jsonl.load_prompts(
        path,
        where=where,
        prompt_key=data_cfg.get("prompt_key", "prompt"),
        answer_key=data_cfg.get("answer_key", "answer"),
    )
    _check_numeric_answers(examples, path)
    return examples


def _check_numeric_answers(examples: Sequence[Mapping[str, Any]], path: str) -> None:
    """The math environment rewards numbers only; an answer without one would make every reward
    zero and the run would silently learn nothing."""
    bad = [ex for ex in examples if extract_final_number(ex["answer"]) is None]
    if not bad:
        return
    problems = [
        f"{path}:{ex['line']}: answer {ex['answer']!r} has no number; the math environment "
        "can only reward numeric answers"
        for ex in bad[:_MAX_REPORTED]
    ]
    if len(bad) > _MAX_REPORTED:
        problems.append(f"{path}: {len(bad) - _MAX_REPORTED} more answers without a number")
    raise UserInputError(problems)


@dataclass(frozen=True)
class EncodedExample:
    """Token ids of one example and where its prompt ends (the loss masks the prompt).

    ``input_ids`` is bos + prompt + response + eos for sft, bos + prompt + chosen + eos for
    preference pairs (with ``rejected_ids`` the same for the rejected response), and bos + prompt
    for prompt-only examples. Prompt and response are tokenized separately and concatenated so
    that ``prompt_len`` is exact even for tokenizers that would merge across the boundary.
    """

    input_ids: list[int]
    prompt_len: int
    rejected_ids: list[int] | None = None
    # 0 for an example cut by data.max_input_seq_length: kept, but none of its tokens train.
    loss_multiplier: float = 1.0


# data.max_input_seq_length cuts each part (prompt, response) of an over-long example to this
# many tokens, as NeMo-RL's data processors do: the example keeps its place in the data order
# (and a GRPO prompt its samples) while its loss multiplier of 0 keeps it from training.
CUT_PART_TOKENS = 4


def _limit_input_length(
    prompt: list[int], responses: dict[str, list[int]], max_input: int
) -> tuple[list[int], dict[str, list[int]], bool]:
    """NeMo-RL's rule for ``data.max_input_seq_length``: a prompt-only example (GRPO,
    distillation) or an SFT example at least that long, or a preference pair of which one side
    is longer, is cut (each part to ``min(4, max_input // parts)`` tokens) and masked."""
    parts = 1 if not responses else 2
    lengths = [len(prompt) + len(r) for r in responses.values()] or [len(prompt)]
    over = max(lengths) > max_input if "chosen" in responses else max(lengths) >= max_input
    if not over:
        return prompt, responses, False
    keep = min(CUT_PART_TOKENS, max_input // parts)
    return prompt[:keep], {k: r[:keep] for k, r in responses.items()}, True


def encode_and_check_lengths(
    examples: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    max_len: int,
    where: str,
    *,
    limit_name: str = "policy.max_total_sequence_length",
    add_bos: bool = True,
    add_eos: bool = True,
    max_input_len: int | None = None,
) -> list[EncodedExample]:
    """Tokenize ``examples``; raise one UserInputError naming every one longer than ``max_len``.

    With ``max_input_len`` (``data.max_input_seq_length``) an example over it is first cut and
    given loss multiplier 0 (:func:`_limit_input_length`), as in NeMo-RL.

    Each offender is reported as ``<where>:<line>`` (its file line when the example has one,
    else its 0-based index) with its length and the limit ``limit_name``, for instance
    ``data.train_data_path:7: prompt+response is 700 tokens, longer than
    policy.max_total_sequence_length 512; shorten it or raise the limit``.
    """
    encoded: list[EncodedExample] = []
    too_long: list[str] = []
    for index, example in enumerate(examples):
        prompt = tokenizer.encode(example["prompt"], add_bos=add_bos)
        responses = {
            key: tokenizer.encode(example[key], add_eos=add_eos)
            for key in ("response", "chosen", "rejected")
            if key in example
        }
        cut = False
        if max_input_len is not None:
            prompt, responses, cut = _limit_input_length(prompt, responses, max_input_len)
        sequences = {key: prompt + response for key, response in responses.items()}
        if not sequences:
            sequences["prompt"] = prompt
        label, longest = max(sequences.items(), key=lambda item: len(item[1]))
        if len(longest) > max_len:
            what = "prompt" if label == "prompt" else f"prompt+{label}"
            too_long.append(
                f"{where}:{example.get('line', index)}: {what} is {len(longest)} tokens, longer "
                f"than {limit_name} {max_len}; shorten it or raise the limit"
            )
        main = next((sequences[k] for k in ("response", "chosen") if k in sequences), prompt)
        encoded.append(
            EncodedExample(main, len(prompt), sequences.get("rejected"), 0.0 if cut else 1.0)
        )
    if too_long:
        shown = too_long[:_MAX_REPORTED]
        if len(too_long) > _MAX_REPORTED:
            shown.append(f"{where}: {len(too_long) - _MAX_REPORTED} more examples too long")
        raise UserInputError(shown)
    return encoded
