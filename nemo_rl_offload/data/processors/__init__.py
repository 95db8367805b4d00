"""NeMo-RL's data processors by its names: a :class:`DataRow` becomes an
:class:`EncodedExample` with NeMo-RL's exact token ids and loss mask.

Recipes name a processor in ``data.default.processor`` or a dataset entry's ``processor``
(``default`` is ``math_hf_data_processor``, as in NeMo-RL); preference datasets always use
``preference_preprocessor``. Each processor is ``process(row, tokenizer, max_seq_length, flags)``
with the tokenizer's chat template applied as NeMo-RL applies it.
"""

from __future__ import annotations

from collections.abc import Callable

from nemo_rl_offload.config.processor_flags import ProcessorFlags
from nemo_rl_offload.config.processor_names import NOT_SUPPORTED
from nemo_rl_offload.data.processors.conversation_processors import (
    preference_preprocessor,
    sft_processor,
)
from nemo_rl_offload.data.processors.prompt_processors import (
    helpsteer3_data_processor,
    math_data_processor,
    math_hf_data_processor,
    multichoice_qa_processor,
    nemo_gym_data_processor,
)
from nemo_rl_offload.data.rows import DataRow, EncodedExample
from nemo_rl_offload.data.tokenizer import ChatTokenizer
from nemo_rl_offload.errors import UserInputError

__all__ = [
    "NOT_SUPPORTED",
    "PROCESSORS",
    "Processor",
    "ProcessorFlags",
    "process",
    "processor_named",
]

Processor = Callable[[DataRow, ChatTokenizer, int, ProcessorFlags], EncodedExample]

PROCESSORS: dict[str, Processor] = {
    "default": math_hf_data_processor,
    "helpsteer3_data_processor": helpsteer3_data_processor,
    "math_data_processor": math_data_processor,
    "math_hf_data_processor": math_hf_data_processor,
    "multichoice_qa_processor": multichoice_qa_processor,
    "nemo_gym_data_processor": nemo_gym_data_processor,
    "preference_preprocessor": preference_preprocessor,
    "sft_processor": sft_processor,
}


def processor_named(name: object, key: str) -> Processor:
    """The processor called ``name``; ``key`` says where the name was given, for the message."""
    if isinstance(name, str) and name in PROCESSORS:
        return PROCESSORS[name]
    if isinstance(name, str) and name in NOT_SUPPORTED:
        raise UserInputError(f"{key}: '{name}' is {NOT_SUPPORTED[name]}")
    raise UserInputError(
        f"{key}: unknown processor {name!r}; the processors are {', '.join(sorted(PROCESSORS))}"
    )


def process(
    row: DataRow,
    tokenizer: ChatTokenizer,
    max_seq_length: int,
    flags: ProcessorFlags | None = None,
) -> EncodedExample:
    """``row`` tokenized by its processor (``flags``: NeMo-RL's defaults when None)."""
    processor = processor_named(row.processor, f"{row.where}: processor")
    return processor(row, tokenizer, max_seq_length, flags or ProcessorFlags())
