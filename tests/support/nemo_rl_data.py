"""A recipe around a NeMo-RL ``data`` section for the data tests."""

from __future__ import annotations

from typing import Any


def recipe_with(data: dict[str, Any], algorithm: str, **sections: Any) -> dict[str, Any]:
    """An ``algorithm`` recipe around ``data``. An SFT one's NeMo-RL datasets get NeMo-RL's SFT
    processor (as NeMo-RL's SFT recipes name it) unless the data names a processor: validate
    refuses a prompt processor for SFT (config/processor_names.py)."""
    if algorithm == "sft" and "train" in data and "processor" not in repr(data):
        default = data.get("default") or {}
        data = {**data, "default": {**default, "processor": "sft_processor"}}
    return {algorithm: {}, "data": data, **sections}
