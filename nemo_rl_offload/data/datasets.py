"""This backend's own data (arithmetic, jsonl), and tokenizing it with checks.

:func:`load_split` gives the trainers "sft", "preference" or "prompts" examples of the train or
val split as canonical dicts (NeMo-RL's datasets load through data/nemo_rl_datasets.py).
:func:`encode_and_check_lengths` tokenizes them and rejects, before training starts, every
example that cannot fit the model's sequence length (silently truncating would train on a cut
answer, or drop the answer a reward needs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from nemo_rl_offload.config.data_settings import DataSettings
from nemo_rl_offload.data import arithmetic, jsonl
from nemo_rl_offload.data.rows import EncodedExample
from nemo_rl_offload.data.tokenizer import Tokenizer
from nemo_rl_offload.environments.math import answer_is_gradable
from nemo_rl_offload.errors import UserInputError

__all__ = ["EncodedExample", "encode_and_check_lengths", "load_split"]

Kind = Literal["sft", "preference", "prompts"]
Split = Literal["train", "val"]

_MAX_REPORTED = 20


def arithmetic_spec(data: DataSettings) -> arithmetic.ArithmeticSpec:
    """The arithmetic task's problem spec from ``data`` (defaults: +, -, * up to 99 / 12)."""
    return arithmetic.ArithmeticSpec(
        ops=tuple(data.arithmetic_ops), max_operand=data.max_operand, max_factor=data.max_factor
    )


def load_split(
    data: DataSettings, kind: Kind, split: Split, *, grader: str = "hf_math_verify"
) -> list[dict[str, Any]]:
    """The ``split`` examples of ``kind`` for this backend's own sources (``arithmetic``,
    ``jsonl``; NeMo-RL's datasets load through data/nemo_rl_datasets.py).

    Examples have canonical keys: prompt/response (sft), prompt/chosen/rejected (preference),
    prompt/answer (prompts); examples read from a file also carry ``line``. A jsonl run without
    ``val_data_path`` has an empty val split. ``grader``: the math environment's
    (``env.math.math_verify_impl``), which every prompt's answer must be gradable by.
    """
    if kind not in ("sft", "preference", "prompts"):
        raise ValueError(f"unknown kind {kind!r}; use sft, preference or prompts")
    if split not in ("train", "val"):
        raise ValueError(f"unknown split {split!r}; use train or val")
    if data.source == "arithmetic":
        train, val = arithmetic.split(
            kind,
            data.num_train_samples,
            data.num_val_samples,
            data.seed,
            spec=arithmetic_spec(data),
        )
        return train if split == "train" else val
    if data.source == "jsonl":
        return _load_jsonl(data, kind, split, grader)
    raise ValueError(f"data source {data.source!r} is not loaded by load_split")


def _load_jsonl(data: DataSettings, kind: Kind, split: Split, grader: str) -> list[dict[str, Any]]:
    key = "train_data_path" if split == "train" else "val_data_path"
    where = f"data.{key}"
    path = data.train_data_path if split == "train" else data.val_data_path
    if path is None:
        if split == "val":
            return []
        raise UserInputError(
            f"{where}: required when data.dataset_name is 'jsonl'; set it to a JSON-lines file"
        )
    if kind == "sft":
        return jsonl.load_sft(
            path, where=where, input_key=data.input_key, output_key=data.output_key
        )
    if kind == "preference":
        return jsonl.load_preference(
            path,
            where=where,
            prompt_key=data.prompt_key,
            chosen_key=data.chosen_key,
            rejected_key=data.rejected_key,
        )
    examples = jsonl.load_prompts(
        path, where=where, prompt_key=data.prompt_key, answer_key=data.answer_key
    )
    _check_answers(examples, path, grader)
    return examples


def _check_answers(examples: Sequence[Mapping[str, Any]], path: str, grader: str) -> None:
    """An answer the math environment can never match would make every reward of its prompt
    zero, and the run would silently learn nothing from it."""
    bad = [ex for ex in examples if not answer_is_gradable(ex["answer"], grader)]
    if not bad:
        return
    problems = [
        f"{path}:{ex['line']}: answer {ex['answer']!r} cannot be graded by the math "
        f"environment's {grader} (env.math.math_verify_impl); write the answer as it would "
        "appear in a right response (a number, a fraction, a LaTeX expression)"
        for ex in bad[:_MAX_REPORTED]
    ]
    if len(bad) > _MAX_REPORTED:
        problems.append(f"{path}: {len(bad) - _MAX_REPORTED} more answers that cannot be graded")
    raise UserInputError(problems)


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
        answer = example.get("answer")
        encoded.append(
            EncodedExample(
                main,
                len(prompt),
                sequences.get("rejected"),
                0.0 if cut else 1.0,
                ground_truth=None if answer is None else str(answer),
            )
        )
    if too_long:
        shown = too_long[:_MAX_REPORTED]
        if len(too_long) > _MAX_REPORTED:
            shown.append(f"{where}: {len(too_long) - _MAX_REPORTED} more examples too long")
        raise UserInputError(shown)
    return encoded
