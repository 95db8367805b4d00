"""The one piece of Transformer Engine that fine-grained activation offloading reads without TE.

Megatron-core's offload manager flips ``CPUOffloadEnabled`` on the module it imports as
``megatron.core.extensions.transformer_engine.cpu_offload`` each time it enters or leaves an
offload region, so that TE layers know their saved tensors are being offloaded. Without
Transformer Engine that name is ``None`` and the manager raises "TE CPU offload is not
available", although the local layer spec has no TE layer that would read the flag. Supplying a
namespace that holds the flag is all FGO needs to run on the local spec (SFT and GRPO ran
with FGO on an H100; see docs/offloading.md).
"""

from __future__ import annotations

import types

FLAG_MODULE_NAME = "nemo_rl_offload.models.te_compat.cpu_offload_flag"


def ensure_offload_flag_module() -> bool:
    """Supply the ``cpu_offload`` flag namespace when Transformer Engine does not; idempotent.

    Returns True when this call had to supply it, False when it was already there (TE is
    installed, or an earlier call supplied it).
    """
    import megatron.core.extensions.transformer_engine as te_extension

    if getattr(te_extension, "cpu_offload", None) is not None:
        return False
    flag = types.ModuleType(FLAG_MODULE_NAME, "Stands in for transformer_engine's cpu_offload.")
    flag.CPUOffloadEnabled = False  # type: ignore[attr-defined]
    te_extension.cpu_offload = flag
    return True
