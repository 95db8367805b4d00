"""The switches NeMo-RL passes its SFT processor (``data.add_bos``, ``data.add_eos``,
``data.add_generation_prompt``) and SFT's loss mask (``sft.only_unmask_final``), with NeMo-RL's
defaults. Other processors take none of them and ignore them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProcessorFlags"]


@dataclass(frozen=True)
class ProcessorFlags:
    add_bos: bool = True
    add_eos: bool = True
    add_generation_prompt: bool = False
    only_unmask_final: bool = False
