"""Small but real policy checkpoint directories, written in milliseconds without a model:
PyTorch's distributed checkpoint of a few tensors and objects (what megatron's
dist_checkpointing writes underneath) and the ``layout.json`` beside it, so that the checks of
a checkpoint's files (policy.checkpoint.problem) see a complete one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LAYOUT = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1}


def write_policy(directory: str | Path, **entries: Any) -> Path:
    """A checkpoint of ``entries`` (tensors; any other object torch.save'd as bytes into the
    data file, as megatron stores its step, schedule and generator states; by default one
    weight) in ``directory``, with its layout.json."""
    import torch
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    dcp.save(entries or {"weight": torch.arange(8.0)}, checkpoint_id=str(directory), no_dist=True)
    meta = {"version": 1, "layout": LAYOUT, "has_optimizer": True, "step": 0}
    (directory / "layout.json").write_text(json.dumps(meta))
    return directory
