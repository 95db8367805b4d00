"""Multi-token prediction's recipe keys and which sections they apply to.

NeMo-RL's ``megatron_cfg`` carries Megatron's MTP settings under their TransformerConfig names.
A trained policy builds the MTP block from them (``config.megatron_settings`` passes them to
TransformerConfig; ``models.builder``, ``policy.train_step`` and ``models.mtp`` run it); a
teacher never trains, so for it they are inert (``config.ignored_keys`` says so) and its model
has no MTP block.
"""

from __future__ import annotations

MTP_KEYS = (
    "mtp_num_layers",
    "mtp_loss_scaling_factor",
    "mtp_use_repeated_layer",
    "mtp_detach_heads",
)


def applies_to(where: str) -> bool:
    """Whether the section ``where`` (``policy`` or ``teacher``) builds an MTP block."""
    return where != "teacher"
