"""The one list of recipe keys the schema accepts but this backend does not act on, and why.

The schema takes NeMo-RL's recipes as they are, so it accepts keys that mean nothing here (a
generation batch size when generation runs as one batch, a switch whose only supported value
is the default). A key that is accepted and silently ignored misleads: the user believes it
acts. Every such key is listed here with the reason, and :func:`check` turns the list into
``validate``'s lines:

- a value for which ignoring the key changes nothing (``inert``: by default null, or the
  value this backend always behaves as) gives no line at all;
- another value gives ``warning: <key>: ignored by this backend: <reason>``, or, where
  ignoring it would change what is trained (``refuse``), an error naming the key and what to
  set instead.

``tests/unit/config/test_schema_walk.py`` walks every key of every schema section and fails
for a key that no code of the package reads and that is not listed here, so a new key cannot
be accepted and ignored unnoticed. Keys of a section that is handed whole to a megatron-core
dataclass (:data:`PASSED_THROUGH`) are read by that dataclass's field names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_rl_offload.config.validate import show_value


def _is_none(value: Any, recipe: Mapping[str, Any]) -> bool:
    return value is None


def _one_of(*values: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    """Inert for null and exactly these values (``True == 1`` is not taken for a match)."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        return value is None or any(type(value) is type(v) and value == v for v in values)

    return inert


def _always(value: Any, recipe: Mapping[str, Any]) -> bool:
    return True


def _clip_grad_matches(value: Any, recipe: Mapping[str, Any]) -> bool:
    optimizer = ((recipe.get("policy") or {}).get("megatron_cfg") or {}).get("optimizer") or {}
    return value is None or value == optimizer.get("clip_grad")


def _dense_model(where: str) -> Callable[[Any, Mapping[str, Any]], bool]:
    """freeze_moe_router is inert when false, or for a model without experts (no router)."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        if value is None or value is False:
            return True
        from nemo_rl_offload.config.model_presets import architecture_for
        from nemo_rl_offload.errors import UserInputError

        section = recipe.get(where) or {}
        overrides = (section.get("megatron_cfg") or {}).get("model_overrides") or {}
        experts = overrides.get("num_moe_experts")
        if experts is None:
            try:
                experts = architecture_for(str(section.get("model_name")), where="").num_moe_experts
            except (UserInputError, OSError, ValueError):
                return True  # the model's own check reports it
        return not (isinstance(experts, int) and experts > 1)

    return inert


def _covers_validation(algorithm: str) -> Callable[[Any, Mapping[str, Any]], bool]:
    """val_batch_size at least max_val_samples: one batch, which is what this backend does."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        section = recipe.get(algorithm) or {}
        samples = section.get("max_val_samples", 256)
        return value is None or (isinstance(value, int) and value >= samples)

    return inert


@dataclass(frozen=True)
class Unused:
    """A key this backend does not act on: why, when that changes nothing, and, where
    ignoring another value would change training, what to set instead (then it is refused)."""

    reason: str
    inert: Callable[[Any, Mapping[str, Any]], bool] = _is_none
    refuse: str | None = None


_TEACHER_TRAINS_NOT = "the teacher never trains"
_TEACHER_GENERATES_NOT = "the teacher never generates"

IGNORED: dict[str, Unused] = {
    "policy.generation_batch_size": Unused(
        "generation samples each data-parallel rank's prompts as one batch"
    ),
    "teacher.generation_batch_size": Unused(_TEACHER_GENERATES_NOT, _always),
    "policy.max_grad_norm": Unused(
        "the Megatron optimizer clips at policy.megatron_cfg.optimizer.clip_grad (NeMo-RL's "
        "Megatron backend does too; its recipes set clip_grad: ${policy.max_grad_norm}); set "
        "clip_grad",
        _clip_grad_matches,
    ),
    "teacher.max_grad_norm": Unused(_TEACHER_TRAINS_NOT, _always),
    "policy.tokenizer.chat_template_kwargs": Unused(
        "no chat template is applied: prompts are tokenized as the data writes them"
    ),
    "teacher.tokenizer.chat_template_kwargs": Unused(
        "no chat template is applied: the teacher scores the student's tokens"
    ),
    "policy.megatron_cfg.empty_unused_memory_level": Unused(
        "the CUDA caching allocator is not emptied between phases", _one_of(0)
    ),
    "teacher.megatron_cfg.empty_unused_memory_level": Unused(
        "the CUDA caching allocator is not emptied between phases", _one_of(0)
    ),
    "policy.megatron_cfg.freeze_moe_router": Unused(
        "the MoE router always trains",
        _dense_model("policy"),
        refuse="set it to false to train with the router learning (or remove it)",
    ),
    "teacher.megatron_cfg.freeze_moe_router": Unused(_TEACHER_TRAINS_NOT, _always),
    "policy.generation.backend": Unused(
        "generation always runs on the policy workers (the schema accepts only megatron)",
        _always,
    ),
    "policy.generation.stop_strings": Unused(
        "sampling stops only at generation.stop_token_ids and the end-of-sequence token",
        _one_of([]),
        refuse="give the stop tokens' ids in generation.stop_token_ids instead",
    ),
    "teacher.generation": Unused(_TEACHER_GENERATES_NOT, _always),
    "data.prompt_file": Unused(
        "prompts are used as the data writes them (no prompt template)",
        refuse="write the template into the data (or remove the key)",
    ),
    "data.system_prompt_file": Unused(
        "prompts are used as the data writes them (no system prompt)",
        refuse="write the system prompt into the data (or remove the key)",
    ),
    "grpo.max_rollout_turns": Unused(
        "rollouts are single-turn", _one_of(1), refuse="set it to 1 (or remove it)"
    ),
    "distillation.max_rollout_turns": Unused(
        "rollouts are single-turn", _one_of(1), refuse="set it to 1 (or remove it)"
    ),
    "grpo.val_batch_size": Unused(
        "validation generates all of a data-parallel rank's held-out prompts as one batch",
        _covers_validation("grpo"),
    ),
    "distillation.val_batch_size": Unused(
        "validation generates all of a data-parallel rank's held-out prompts as one batch",
        _covers_validation("distillation"),
    ),
    "loss_fn.token_level_loss": Unused(
        "the loss is always averaged over the tokens of the global batch",
        _one_of(True),
        refuse="set it to true (or remove it); per-sequence averaging is not implemented",
    ),
    "loss_fn.use_on_policy_kl_approximation": Unused(
        "the KL penalty is the plain k3 estimate",
        _one_of(False),
        refuse="set it to false (or remove it)",
    ),
    "loss_fn.use_importance_sampling_correction": Unused(
        "generation and training use the same model, so there is nothing to correct",
        _one_of(False),
        refuse="set it to false (or remove it)",
    ),
    "loss_fn.zero_outside_topk": Unused(
        "the KL is taken over the teacher's top-k renormalised",
        _one_of(False),
        refuse="set it to false (or remove it)",
    ),
}

# Sections handed whole to a megatron-core dataclass, whose fields read them.
PASSED_THROUGH: dict[str, str] = {
    "policy.megatron_cfg.distributed_data_parallel_config": (
        "megatron.core.distributed.DistributedDataParallelConfig"
    ),
    "teacher.megatron_cfg.distributed_data_parallel_config": (
        "megatron.core.distributed.DistributedDataParallelConfig"
    ),
}


def _lookup(recipe: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = recipe
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def check(recipe: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the listed keys a recipe sets to a value that is not inert."""
    errors: list[str] = []
    warnings: list[str] = []
    for dotted, unused in IGNORED.items():
        present, value = _lookup(recipe, dotted)
        if not present or unused.inert(value, recipe):
            continue
        if unused.refuse is not None:
            errors.append(
                f"{dotted}: {show_value(value)} is not supported by this backend "
                f"({unused.reason}); {unused.refuse}"
            )
        else:
            warnings.append(f"warning: {dotted}: ignored by this backend: {unused.reason}")
    return errors, warnings
