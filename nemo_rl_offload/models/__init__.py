"""The policy model: Megatron-core GPTModel building, parallel state, the training step, and the
compatibility pieces that let the local layer spec run without Transformer Engine or a GPU.

Modules are imported directly (``from nemo_rl_offload.models.builder import build_gpt_model``);
this package imports nothing on its own, so config validation never pays for torch/megatron.
"""
