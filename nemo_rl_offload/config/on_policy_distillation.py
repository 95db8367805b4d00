"""NeMo-RL's on-policy distillation inside GRPO: ``on_policy_distillation`` with
``grpo.adv_estimator.name: opd``. The rules, the teachers' routing and their sections (one
owner: ``validate`` and a starting run report the rules through :func:`problems`; GRPO routes
samples with :class:`TeacherRouting` and starts the groups :func:`teacher_sections` gives).
The meaning, the routing and the teachers: docs/training.md.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_type_hints

from nemo_rl_offload.errors import UserInputError

__all__ = [
    "OPD_ESTIMATOR",
    "SECTION",
    "TeacherRouting",
    "enabled",
    "problems",
    "routing",
    "teacher_sections",
]

SECTION = "on_policy_distillation"
OPD_ESTIMATOR = "opd"
_TEACHERS = f"{SECTION}.teacher_model_by_agent_name"
_RESOURCES = f"{SECTION}.non_colocated_teachers"
# NeMo-RL's teacher precisions (its TeacherResourceConfig) and the policy's own spellings.
PRECISIONS = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
# A teacher's settings that are not megatron_cfg keys: where they go instead (None: placement).
_PARALLEL = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)
_PLACEMENT = ("num_nodes", "gpus_per_node")
_RESOURCE_KEYS = (
    *_PARALLEL,
    *_PLACEMENT,
    "precision",
    "micro_batch_size",
    "megatron_cfg_overrides",
)


def _section(recipe: Mapping[str, Any]) -> Mapping[str, Any]:
    value = recipe.get(SECTION)
    return value if isinstance(value, Mapping) else {}


def enabled(recipe: Mapping[str, Any]) -> bool:
    """Whether the recipe distills: the section on and GRPO's estimator ``opd``."""
    return bool(_section(recipe).get("enabled")) and _estimator(recipe) == OPD_ESTIMATOR


def _estimator(recipe: Mapping[str, Any]) -> Any:
    grpo = recipe.get("grpo")
    estimator = grpo.get("adv_estimator") if isinstance(grpo, Mapping) else None
    return estimator.get("name", "grpo") if isinstance(estimator, Mapping) else "grpo"


@dataclass(frozen=True)
class TeacherRouting:
    """Samples to teacher groups: ``models`` (alias -> model), ``group_of`` (alias -> the alias
    whose group of workers scores it: the first alias of its model)."""

    models: Mapping[str, str]
    group_of: Mapping[str, str]
    default_alias: str | None
    strict: bool

    def aliases(self, agents: Sequence[str | None]) -> list[str]:
        """Each sample's teacher alias from its agent's name (None: a sample of this
        backend's own rollouts, which has no agent), as NeMo-RL resolves it."""
        out = []
        for agent in agents:
            if agent is not None and agent in self.models:
                out.append(agent)
            elif self.strict:
                raise UserInputError(
                    f"{SECTION}.strict_agent_name_match: no teacher for agent {agent!r} "
                    f"(aliases: {sorted(self.models)}); add it to {_TEACHERS} or set "
                    "strict_agent_name_match: false"
                )
            elif self.default_alias is not None:
                out.append(self.default_alias)
            else:
                raise UserInputError(
                    f"{SECTION}.default_teacher_alias: agent {agent!r} has no teacher in "
                    f"{_TEACHERS} and no default is set; add it, or set default_teacher_alias"
                )
        return out

    def groups(self, agents: Sequence[str | None]) -> list[str]:
        """Each sample's teacher group (the key of :func:`teacher_sections`)."""
        return [self.group_of[alias] for alias in self.aliases(agents)]

    def metrics(self, aliases: Sequence[str]) -> dict[str, float]:
        """NeMo-RL's routing metrics of a step's samples."""
        unique = set(aliases)
        models = {self.models[alias] for alias in unique}
        return {
            f"{SECTION}/teacher_alias_unique": float(len(unique)),
            f"{SECTION}/teacher_model_unique": float(len(models)),
            f"{SECTION}/teacher_alias_to_model_compression": len(models) / max(len(unique), 1),
        }


def routing(recipe: Mapping[str, Any]) -> TeacherRouting:
    """The routing of a recipe :func:`problems` found no error in."""
    section = _section(recipe)
    models = {str(k): str(v) for k, v in (section.get("teacher_model_by_agent_name") or {}).items()}
    first_of_model: dict[str, str] = {}
    group_of = {alias: first_of_model.setdefault(model, alias) for alias, model in models.items()}
    return TeacherRouting(
        models,
        group_of,
        section.get("default_teacher_alias"),
        bool(section.get("strict_agent_name_match", False)),
    )


def _resources(section: Mapping[str, Any], alias: str) -> dict[str, Any]:
    """A teacher's settings: the defaults, then its alias's overrides (NeMo-RL's order)."""
    placed = section.get("non_colocated_teachers")
    if not isinstance(placed, Mapping):
        return {}
    default = placed.get("default_teacher_cfg")
    overrides = (placed.get("teacher_overrides") or {}).get(alias)
    return {
        **(default if isinstance(default, Mapping) else {}),
        **(overrides if isinstance(overrides, Mapping) else {}),
    }


def teacher_sections(recipe: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each teacher group's policy section, by the alias that names its group (the first of
    its model's aliases), built from the policy section as NeMo-RL builds a teacher's."""
    section, policy = _section(recipe), recipe["policy"]
    routes = routing(recipe)
    sections: dict[str, dict[str, Any]] = {}
    for alias, model in routes.models.items():
        if routes.group_of[alias] != alias:
            continue
        teacher = copy.deepcopy(dict(policy))
        teacher["model_name"] = model
        for key in ("init_checkpoint", "draft", "quant_cfg"):
            teacher.pop(key, None)  # the policy's trained weights, draft model, quantizers
        megatron = teacher.setdefault("megatron_cfg", {})
        megatron.pop("peft", None)
        if model != policy.get("model_name"):
            # The policy model's own shape: another model is built as its name says.
            teacher.pop("hf_config_overrides", None)
            megatron.pop("model_overrides", None)
        settings = _resources(section, alias)
        for key in _PARALLEL:
            if key in settings:
                megatron[key] = settings[key]
        if "precision" in settings:
            teacher["precision"] = PRECISIONS[str(settings["precision"])]
        if "micro_batch_size" in settings:
            teacher["logprob_batch_size"] = settings["micro_batch_size"]
        extra = {k: v for k, v in settings.items() if k not in _RESOURCE_KEYS}
        megatron.update({**extra, **(settings.get("megatron_cfg_overrides") or {})})
        sections[alias] = teacher
    return sections


def _megatron_keys() -> dict[str, Any]:
    """megatron_cfg's keys and their types (the schema's)."""
    from nemo_rl_offload.config.schema import MegatronConfig

    return get_type_hints(MegatronConfig)


def _type_problem(where: str, key: str, hint: Any, value: Any) -> str | None:
    """The schema's check of one megatron_cfg value (strict, as a recipe's own are)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(hint).validate_python(value, strict=True)
    except ValidationError as bad:
        reason = bad.errors()[0]["msg"].lower() if bad.errors() else "not valid"
        return f"{where}.{key}: {reason} (got: {value!r})"
    return None


def _resource_problems(
    where: str, settings: Mapping[str, Any], known: Mapping[str, Any]
) -> list[str]:
    errors = []
    for key in (*_PARALLEL, *_PLACEMENT, "micro_batch_size"):
        value = settings.get(key)  # other types are the schema's to report
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            errors.append(f"{where}.{key}: {value!r} is not a whole number >= 1; give one")
    precision = settings.get("precision")
    if isinstance(precision, str) and precision not in PRECISIONS:
        errors.append(
            f"{where}.precision: {precision!r} is not a precision; give one of "
            f"{', '.join(PRECISIONS)}"
        )
    overrides = settings.get("megatron_cfg_overrides")
    extra = {k: v for k, v in settings.items() if k not in _RESOURCE_KEYS}
    extra.update(overrides if isinstance(overrides, Mapping) else {})
    for key, value in extra.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            errors.append(
                f"{where}.{key}: not a megatron_cfg setting{hint}; a teacher's other keys are "
                "its megatron_cfg overrides"
            )
        elif (problem := _type_problem(where, key, known[key], value)) is not None:
            errors.append(problem)
    return errors


def problems(recipe: Mapping[str, Any], *, has_agents: bool) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the recipe's on-policy distillation; ``has_agents``: samples come
    from NeMo-Gym's agents (each with its name), not from this backend's own rollouts."""
    section = _section(recipe)
    estimator = _estimator(recipe)
    if not section.get("enabled"):
        if estimator == OPD_ESTIMATOR:
            return [
                "grpo.adv_estimator.name: 'opd' takes each token's advantage from an on-policy "
                f"distillation teacher, and {SECTION} is not enabled; set {SECTION}.enabled: "
                "true with its teacher_model_by_agent_name, or the estimator's name to 'grpo'"
            ], []
        return [], []
    errors: list[str] = []
    warnings: list[str] = []
    if estimator != OPD_ESTIMATOR:
        warnings.append(
            f"warning: {SECTION}.enabled: its teachers' log-probabilities are used only by "
            f"grpo.adv_estimator.name 'opd' (this recipe's is {estimator!r}), so no teacher "
            "is started and GRPO's advantages train; set the estimator's name to 'opd' to distill"
        )
        return errors, warnings
    models = section.get("teacher_model_by_agent_name") or {}
    if not models:
        errors.append(
            f"{_TEACHERS}: empty; give each teacher as alias: model (a NeMo-Gym agent's name, "
            "or the default_teacher_alias, mapped to a model name or directory)"
        )
        return errors, warnings
    default = section.get("default_teacher_alias")
    strict = bool(section.get("strict_agent_name_match", False))
    if default is not None and not strict and default not in models:
        errors.append(
            f"{SECTION}.default_teacher_alias: {default!r} is not an alias of {_TEACHERS} "
            f"({', '.join(sorted(models))}); name one of them"
        )
    if not has_agents and (strict or default is None):
        errors.append(
            f"{SECTION}.default_teacher_alias: this backend's own rollouts carry no NeMo-Gym "
            "agent name, so every sample goes to the default teacher; set default_teacher_alias "
            "to one of the aliases"
            + (" and strict_agent_name_match: false" if strict else "")
            + " (or take rollouts from NeMo-Gym: env.should_use_nemo_gym)"
        )
    for penalty in ("invalid_tool_call_advantage", "malformed_thinking_advantage"):
        if (recipe.get("grpo") or {}).get(penalty) is not None:
            errors.append(
                f"grpo.{penalty}: not implemented yet beside 'opd' advantages by this backend "
                f"(NeMo-RL sets the flagged turns' tokens over the teachers' advantages); "
                "set it to null (or remove it)"
            )
    loss = recipe.get("loss_fn") if isinstance(recipe.get("loss_fn"), Mapping) else {}
    grpo = recipe.get("grpo") if isinstance(recipe.get("grpo"), Mapping) else {}
    if loss.get("force_on_policy_ratio") and grpo.get("seq_logprob_error_threshold") is None:
        errors.append(
            "loss_fn.force_on_policy_ratio: with it and no grpo.seq_logprob_error_threshold the "
            "student's log-probabilities before the step are not computed, and 'opd' "
            "advantages are the teacher's minus those (NeMo-RL refuses this too); set "
            "grpo.seq_logprob_error_threshold, or force_on_policy_ratio: false"
        )
    placed = section.get("non_colocated_teachers")
    known = _megatron_keys()
    if isinstance(placed, Mapping):
        default_cfg = placed.get("default_teacher_cfg")
        if isinstance(default_cfg, Mapping):
            errors += _resource_problems(f"{_RESOURCES}.default_teacher_cfg", default_cfg, known)
        for alias, settings in (placed.get("teacher_overrides") or {}).items():
            where = f"{_RESOURCES}.teacher_overrides.{alias}"
            if alias not in models:
                errors.append(
                    f"{where}: {alias!r} is not an alias of {_TEACHERS} "
                    f"({', '.join(sorted(models))}); name one of them"
                )
            elif isinstance(settings, Mapping):
                errors += _resource_problems(where, settings, known)
        if placed.get("enabled"):
            warnings.append(
                f"warning: {_RESOURCES}: teachers run on the policy's workers here, sharing "
                "their GPUs, not on nodes of their own: num_nodes and gpus_per_node are not "
                "used (where a teacher runs does not change its log-probabilities)"
            )
    policy = recipe.get("policy") if isinstance(recipe.get("policy"), Mapping) else {}
    if policy.get("quant_cfg") is not None:
        warnings.append(
            "warning: policy.quant_cfg: the teachers run unquantized (NeMo-RL's teachers do "
            "not take the policy's quantization either)"
        )
    shared = [a for a, m in models.items() if list(models.values()).count(m) > 1]
    if shared and section.get("deduplicate_shared_teacher_checkpoints") is False:
        warnings.append(
            f"warning: {SECTION}.deduplicate_shared_teacher_checkpoints: aliases "
            f"{', '.join(shared)} name the same model, and they share one group of workers "
            "here (their log-probabilities are the same)"
        )
    return errors, warnings
