"""The warnings megatron-core prints that are known to be harmless here, kept off stderr.

Every worker imports megatron-core without Transformer Engine or Apex (this backend runs on the
local layer spec by design), and megatron-core says so in a screen of warnings per process that
bury the lines about the job. Each one is listed below by its exact text (or the exact start of
it), with why it is harmless; :func:`install` hides those and nothing else, in the driver
(``cli.main``) and in every Ray worker process (``distributed.cluster`` runs it as Ray's worker
setup hook, ``PolicyWorker`` again when it is built), before megatron-core is imported. Python
warnings go through :mod:`warnings` filters, megatron-core's log records through a
:class:`logging.Filter` on the logger that writes each. To hide another, add a
:class:`KnownWarning` to ``KNOWN`` (docs/telemetry.md says how to find its text and source).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

# What distributed.cluster hands Ray as the job's worker_process_setup_hook.
SETUP_HOOK = f"{__name__}.install"


@dataclass(frozen=True)
class KnownWarning:
    """One known-harmless message: its exact ``text`` (its start, with ``prefix``), and where
    it comes from: a Python warning of ``category`` (from the source file ``source``, a path
    ending, when the text alone could match others' warnings), or a record of the logger
    ``logger``. ``why`` is for the reader: why nobody needs to see it."""

    text: str
    why: str
    category: type[Warning] | None = None
    logger: str | None = None
    prefix: bool = False
    source: str | None = None

    def matches(self, message: str) -> bool:
        return message.startswith(self.text) if self.prefix else message == self.text


_NO_TE = "this backend runs without Transformer Engine or Apex by design (torch's kernels)"

KNOWN: tuple[KnownWarning, ...] = (
    KnownWarning(
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        _NO_TE,
        category=UserWarning,
    ),
    KnownWarning(
        "Transformer Engine and Apex are not installed. Falling back to local implementations "
        "of multi_tensor_applier",
        _NO_TE + " (optimizer, clip_grads and Megatron-FSDP say it three ways)",
        category=UserWarning,
        prefix=True,
    ),
    KnownWarning("Apex is not installed. Falling back to Torch Norm", _NO_TE, category=UserWarning),
    KnownWarning(
        "absl.logging is not installed. Using logging.getLogger(__name__) instead.",
        "megatron-core's HyperCommGrid logs through logging instead; nothing is lost",
        category=UserWarning,
        prefix=True,
    ),
    KnownWarning(
        "MimoModelConfig is experimental and still under active development.",
        "said on import of a multimodal model class this backend never uses",
        category=UserWarning,
        prefix=True,
    ),
    KnownWarning(
        "invalid escape sequence '\\-'",
        "a docstring of megatron-core's inference KV-block allocator, said when Python "
        "first compiles it",
        category=SyntaxWarning,
        source="megatron/core/inference/contexts/kv_block_allocator.py",
    ),
    KnownWarning(
        "GPTModel IS DEPRECATED.",
        "GPTModel is the model this backend builds on megatron-core 0.19; the migration is "
        "the project's to plan, not the job's to act on",
        logger="megatron.core.models.gpt.gpt_model",
        prefix=True,
    ),
    KnownWarning(
        "MCore's async save is deprecated",
        "said once per process on the first checkpoint save; the save itself is unchanged",
        logger="megatron.core.dist_checkpointing.strategies.torch",
        prefix=True,
    ),
    KnownWarning(
        "Using Megatron-FSDP without Transformer Engine.",
        _NO_TE + "; Megatron-FSDP is not used",
        logger="megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
    ),
    KnownWarning(
        "Detected Megatron Core, using Megatron-FSDP with Megatron.",
        "an import notice of Megatron-FSDP, which this backend does not use",
        logger="megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
    ),
    KnownWarning(
        "Detected Megatron Core, using Megatron-FSDP with Megatron.",
        "an import notice of Megatron-FSDP, which this backend does not use",
        logger="megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
    ),
    KnownWarning(
        "DistributedDataParallel: full_param_layout not provided with "
        "use_distributed_optimizer=True.",
        "megatron-core computes the layout itself, as it did before the argument existed; "
        "said once per GPU worker",
        logger="megatron.core.distributed.distributed_data_parallel",
        prefix=True,
    ),
    KnownWarning(
        "barrier(): using the device under current context.",
        "torch's first barrier of a GPU worker: each worker's current device is its own GPU",
        category=UserWarning,
        prefix=True,
    ),
)


class KnownRecords(logging.Filter):
    """Drops a logger's records whose message is one of ``KNOWN``'s for that logger."""

    def __init__(self, known: tuple[KnownWarning, ...]) -> None:
        super().__init__()
        self.known = known

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge: let logging report it
            return True
        return not any(k.logger == record.name and k.matches(message) for k in self.known)


_RECORDS = KnownRecords(tuple(k for k in KNOWN if k.logger is not None))


def _module_pattern(source: str) -> str:
    """The ``module`` regex of a compile-time warning from ``source``: Python names such a
    warning's module by the file's path without ``.py``."""
    return r".*" + re.escape(source.removesuffix(".py")) + r"\Z"


def install() -> None:
    """Hide ``KNOWN`` in this process (safe to call again: nothing is added twice). The
    filters go first, so they hold under ``-W always`` and ``PYTHONWARNINGS`` too."""
    for known in KNOWN:
        if known.category is not None:
            warnings.filterwarnings(
                "ignore",
                message=re.escape(known.text) + ("" if known.prefix else r"\Z"),
                category=known.category,
                module=_module_pattern(known.source) if known.source else "",
            )
    for name in sorted({k.logger for k in KNOWN if k.logger is not None}):
        logging.getLogger(name).addFilter(_RECORDS)
