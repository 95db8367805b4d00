"""NeMo-RL's data processor names: which ones run here, and what each makes of a row.

The processors themselves are in data/processors (one per name there, tested against this
table); ``validate`` checks a recipe's names here, before any data is read: a name that is not
a processor, one that cannot run here, or one whose examples do not fit the algorithm (an SFT
conversation given to GRPO has no answer to grade; a GRPO prompt given to SFT has nothing to
train) is one line naming the recipe key.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["ALGORITHM_EXAMPLES", "NOT_SUPPORTED", "PROCESSOR_EXAMPLES", "processor_problem"]

Examples = Literal["prompt", "conversation", "pair"]

# What each processor's examples are: a prompt with the answer its responses are graded
# against, a conversation whose assistant turns train, or a preference pair.
PROCESSOR_EXAMPLES: dict[str, Examples] = {
    "default": "prompt",  # NeMo-RL's default processor is math_hf_data_processor
    "helpsteer3_data_processor": "prompt",
    "math_data_processor": "prompt",
    "math_hf_data_processor": "prompt",
    "multichoice_qa_processor": "prompt",
    "nemo_gym_data_processor": "prompt",
    "preference_preprocessor": "pair",
    "sft_processor": "conversation",
}

# What each algorithm trains on.
ALGORITHM_EXAMPLES: dict[str, Examples] = {
    "grpo": "prompt",
    "distillation": "prompt",
    "sft": "conversation",
    "dpo": "pair",
}

_DESCRIBED = {
    "prompt": "prompts with an answer to grade",
    "conversation": "conversations whose assistant turns train",
    "pair": "preference pairs",
}

# NeMo-RL's processors that cannot run here, with why.
NOT_SUPPORTED: dict[str, str] = {
    "vlm_hf_data_processor": (
        "NeMo-RL's vision/audio-language processor; image, audio and video data are not "
        "supported (text-only models)"
    ),
    "kd_data_processor": (
        "NeMo-RL's cross-tokenizer distillation processor (its xtoken recipes); distillation "
        "across two tokenizers is not supported"
    ),
}


def processor_problem(name: str, key: str, algorithm: str | None) -> str | None:
    """The line refusing processor ``name`` given at ``key`` for ``algorithm``, or None."""
    if name in NOT_SUPPORTED:
        return f"{key}: '{name}' is {NOT_SUPPORTED[name]}"
    if name not in PROCESSOR_EXAMPLES:
        known = ", ".join(sorted(PROCESSOR_EXAMPLES))
        return f"{key}: unknown processor {name!r}; the processors are {known}"
    wanted = ALGORITHM_EXAMPLES.get(algorithm or "")
    made = PROCESSOR_EXAMPLES[name]
    if wanted is None or made == wanted:
        return None
    fitting = ", ".join(sorted(n for n, kind in PROCESSOR_EXAMPLES.items() if kind == wanted))
    return (
        f"{key}: {name} makes {_DESCRIBED[made]}, but {algorithm} trains on "
        f"{_DESCRIBED[wanted]}; use {fitting}"
    )
