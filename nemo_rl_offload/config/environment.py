"""What this Python environment offers the rules: megatron-core's and Transformer Engine's
versions, the offload module names the installed TransformerConfig accepts, and the lines that
refuse offload code whose Megatron counterpart drifted (detected by
:func:`nemo_rl_offload.offload.capabilities.detect`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Transformer Engine from this version on changed its offload API; Megatron's FGO needs the old
# one, selected by NVTE_CPU_OFFLOAD_V1=1 in every worker.
TE_OFFLOAD_V1_ENV_FROM = (2, 10)


def version_tuple(version: str | None) -> tuple[int, ...]:
    if not version:
        return ()
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


@dataclass(frozen=True)
class Capabilities:
    megatron_version: str | None
    te_version: str | None
    offload_module_names: frozenset[str]
    offload_module_names_source: str  # "megatron-core" (asked it) or "version table"
    # The line refusing offloading when the installed megatron-core's offload code is not the
    # code the runtime's subclasses were checked against (owned.megatron_drift); None: it is.
    offload_code_drift: str | None = None
    # The same for the MLP offload modules' reliance on Megatron's MLP (owned.mlp_drift).
    mlp_code_drift: str | None = None
    # The same for the layer_input offload's reliance on Megatron's checkpoint code
    # (layer_input.drift).
    layer_input_code_drift: str | None = None
    # (recompute module, the line refusing it) for each of LOCAL_RECOMPUTE_MODULES whose
    # Megatron code differs from the checked one (owned.recompute_drift).
    recompute_code_drift: tuple[tuple[str, str], ...] = ()

    @property
    def has_transformer_engine(self) -> bool:
        return self.te_version is not None

    @property
    def te_needs_offload_v1_env(self) -> bool:
        # An installed TE of unknown version gets the variable too: older TE ignores it.
        version = version_tuple(self.te_version)
        return self.has_transformer_engine and (not version or version >= TE_OFFLOAD_V1_ENV_FROM)
