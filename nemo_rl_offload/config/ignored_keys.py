"""The one list of recipe keys the schema accepts but this backend does not act on, and why.

A key that is accepted and silently ignored misleads: the user believes it acts. Every such key
is listed here with its reason, and :func:`check` turns the list into ``validate``'s lines.
Which lines, and how the list is kept complete: docs/recipes.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from nemo_rl_offload.config import grpo_options, multi_token_prediction
from nemo_rl_offload.config.on_policy_distillation import OPD_ESTIMATOR
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


def _model_has_experts(recipe: Mapping[str, Any], where: str) -> bool | None:
    """Whether the model of section ``where`` has experts (``model_presets.has_experts`` on
    the model's or ``model_overrides``' ``num_moe_experts``); None when the model cannot be
    read here (its own check reports that)."""
    from nemo_rl_offload.config.model_presets import architecture_for, has_experts
    from nemo_rl_offload.errors import UserInputError

    section = recipe.get(where) or {}
    overrides = (section.get("megatron_cfg") or {}).get("model_overrides") or {}
    experts = overrides.get("num_moe_experts")
    if experts is None:
        try:
            experts = architecture_for(str(section.get("model_name")), where="").num_moe_experts
        except (UserInputError, OSError, ValueError):
            return None
    return has_experts(experts)


def _dense_model(where: str) -> Callable[[Any, Mapping[str, Any]], bool]:
    """freeze_moe_router is inert when false, or for a model without experts (no router)."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        if value is None or value is False:
            return True
        return not _model_has_experts(recipe, where)

    return inert


def _dense_expert_decode(recipe: Mapping[str, Any], where: str) -> bool:
    """Whether an MoE policy's decode steps take the dense expert path that CUDA graphs can
    capture (models/moe_decode.py ``dense_usable``): every expert on each rank (no tensor,
    expert or expert-tensor parallelism), no token dropping, no probabilities on the experts'
    input, no latent projections, no FP8 arithmetic, no
    shared-expert overlap, and no recorded routes (a replayed graph would not record them)."""
    section = recipe.get(where) or {}
    megatron = section.get("megatron_cfg") or {}
    overrides = megatron.get("model_overrides") or {}

    def setting(key: str) -> Any:
        return overrides.get(key, megatron.get(key))

    sizes = ("tensor_model_parallel_size", "expert_model_parallel_size")
    return (
        all((megatron.get(key) or 1) == 1 for key in sizes)
        and (megatron.get("expert_tensor_parallel_size") or 1) == 1
        and not setting("moe_shared_expert_overlap")
        and not setting("moe_apply_probs_on_input")
        and setting("moe_expert_capacity_factor") is None
        and not setting("moe_latent_size")
        and (section.get("fp8_cfg") or {}).get("enabled") is not True
        and (section.get("router_replay") or {}).get("enabled") is not True
    )


def _decode_graphs_apply(generation: str) -> Callable[[Any, Mapping[str, Any]], bool]:
    """mcore_generation_config.cuda_graph_impl is acted on (decode-step CUDA graphs,
    policy/generation.py) when it is off or when the policy's decode steps can be captured:
    one pipeline stage, no sequence parallelism, and for a model with experts the dense
    expert path (policy/decode_graphs.py, models/moe_decode.py)."""
    where = generation.split(".")[0]

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        if value is None or value == "none":
            return True
        if _at(recipe, f"{generation}.mcore_generation_config.num_cuda_graphs") == 0:
            return True
        megatron = _at(recipe, f"{where}.megatron_cfg") or {}
        tp = megatron.get("tensor_model_parallel_size") or 1
        return not (
            (_model_has_experts(recipe, where) and not _dense_expert_decode(recipe, where))
            or (megatron.get("pipeline_model_parallel_size") or 1) > 1
            or (megatron.get("sequence_parallel") is True and tp > 1)
        )

    return inert


def _covers_validation(algorithm: str) -> Callable[[Any, Mapping[str, Any]], bool]:
    """val_batch_size at least max_val_samples: one batch, which is what this backend does."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        section = recipe.get(algorithm) or {}
        samples = section.get("max_val_samples", 256)
        if not isinstance(samples, int):
            return value is None  # null: NeMo-Gym's "all of them", no batch covers it surely
        return value is None or (isinstance(value, int) and value >= samples)

    return inert


def _equals(*values: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    """Inert for null and these values, numbers compared as numbers (``1 == 1.0``, but
    ``true`` is not ``1``): NeMo-RL's defaults, which a recipe may write either way."""

    def same(value: Any, wanted: Any) -> bool:
        if isinstance(value, bool) or isinstance(wanted, bool):
            return type(value) is type(wanted) and value == wanted
        if isinstance(value, int | float) and isinstance(wanted, int | float):
            return float(value) == float(wanted)
        return type(value) is type(wanted) and value == wanted

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        return value is None or any(same(value, v) for v in values)

    return inert


def _whole_step_or_refused(value: Any, recipe: Mapping[str, Any]) -> bool:
    """async_rl.min_groups_for_streaming_train: a step takes all of its prompt groups at once
    from that many on; below one it is grpo_options.async_problems' error, not a warning too."""
    return value < 1 or value >= int(_at(recipe, "grpo.num_prompts_per_step") or 0)


def _switched_off(value: Any, recipe: Mapping[str, Any]) -> bool:
    """A NeMo-RL feature section: inert when null, empty or ``enabled: false``."""
    return value is None or value == {} or (isinstance(value, Mapping) and not value.get("enabled"))


def _at(recipe: Mapping[str, Any], dotted: str) -> Any:
    node: Any = recipe
    for part in dotted.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _unless(dotted: str, *active: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    """Inert unless the recipe's ``dotted`` key holds one of ``active``: a setting of a
    NeMo-RL feature that only acts when that feature is selected."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        here = _at(recipe, dotted)
        return value is None or not any(type(here) is type(a) and here == a for a in active)

    return inert


def _unless_not(dotted: str, active: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    """Inert when the recipe's ``dotted`` key holds ``active`` (the key acts then)."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        here = _at(recipe, dotted)
        return type(here) is type(active) and here == active

    return inert


def _any_inert(
    *checks: Callable[[Any, Mapping[str, Any]], bool],
) -> Callable[[Any, Mapping[str, Any]], bool]:
    """Inert when any of ``checks`` finds the value inert (e.g. empty, or its feature off)."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        return any(check(value, recipe) for check in checks)

    return inert


def _same_as(dotted: str, default: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    """Inert at null or at the value of ``dotted`` (NeMo-RL's default for the key)."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        here = _at(recipe, dotted)
        return _equals(default if here is None else here)(value, recipe)

    return inert


def _grpo_estimator(value: Any, recipe: Mapping[str, Any]) -> bool:
    """grpo.adv_estimator is read (algorithms/advantages.py) when it names GRPO's own
    estimator, with any normalize_rewards and use_leave_one_out_baseline, or on-policy
    distillation's (whose rules are config/on_policy_distillation.py's); the other
    estimators are not implemented."""
    if value is None or value == {}:
        return True
    return isinstance(value, Mapping) and value.get("name", "grpo") in ("grpo", OPD_ESTIMATOR)


def _estimator_normalises_alike(value: Any, recipe: Mapping[str, Any]) -> bool:
    """grpo.normalize_rewards changes nothing where it equals what the advantages use:
    grpo.adv_estimator.normalize_rewards, true when absent (NeMo-RL's estimator default;
    NeMo-RL's recipes interpolate grpo's key into the section)."""
    estimator = (recipe.get("grpo") or {}).get("adv_estimator")
    section = estimator if isinstance(estimator, Mapping) else {}
    return value is None or value == section.get("normalize_rewards", True)


def _no_penalties(value: Any, recipe: Mapping[str, Any]) -> bool:
    return value is None or not any(
        value.get(flag) for flag in value if isinstance(flag, str) and flag.startswith("penalize_")
    )


_VISION_PARTS = ("freeze_vision_model", "freeze_vision_projection")


def _freezes_no_language_part(value: Any, recipe: Mapping[str, Any]) -> bool:
    """NeMo-RL's freeze_config names parts of a vision-language model; the vision parts do
    not exist in the language models built here, so only a true for another part acts."""
    return value is None or not any(
        v is True for key, v in value.items() if key not in _VISION_PARTS
    )


def _empty(value: Any, recipe: Mapping[str, Any]) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _full_vocabulary(value: Any, recipe: Mapping[str, Any]) -> bool:
    """distillation.topk_logits_k null (or absent) takes the KL over the whole vocabulary:
    nothing lies outside the top-k, so NeMo-RL's zero_outside_topk changes nothing."""
    return _at(recipe, "distillation.topk_logits_k") is None


@dataclass(frozen=True)
class Unused:
    """A key this backend does not act on: why, when that changes nothing, and, where
    ignoring another value would change training, what to set instead (then it is refused)."""

    reason: str
    inert: Callable[[Any, Mapping[str, Any]], bool] = _is_none
    refuse: str | None = None
    # Refused only when a run starts: the value names something not on this machine or not
    # loaded yet (NeMo-RL's datasets), which ``validate`` reports as a warning so that the
    # rest of the recipe is still checked.
    at_start: bool = False

    @property
    def treatment(self) -> str:
        """``refused`` or ``warned``: what a value that is not inert gets."""
        return "refused" if self.refuse is not None else "warned"


_OWN_ROLLOUTS_SINGLE_TURN = (
    "this backend's own rollouts are single-turn (multi-turn rollouts come from NeMo-Gym's "
    "agents: env.should_use_nemo_gym)"
)
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
    "teacher.tokenizer.chat_template_kwargs": Unused(
        "no chat template is applied: the teacher scores the student's tokens"
    ),
    "policy.megatron_cfg.empty_unused_memory_level": Unused(
        "the CUDA caching allocator is not emptied between phases", _one_of(0)
    ),
    "teacher.megatron_cfg.empty_unused_memory_level": Unused(
        "the CUDA caching allocator is not emptied between phases", _one_of(0)
    ),
    # policy.megatron_cfg.freeze_moe_router is implemented (offload/apply.freezes_moe_router).
    "teacher.megatron_cfg.freeze_moe_router": Unused(_TEACHER_TRAINS_NOT, _always),
    "policy.generation.backend": Unused(
        "generation runs with megatron-core on the policy workers, not in NeMo-RL's "
        "vLLM/SGLang/TensorRT-LLM/Dynamo engines; the sampling settings apply as written",
        _one_of("megatron"),
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
        _OWN_ROLLOUTS_SINGLE_TURN, _one_of(1), refuse="set it to 1 (or remove it)"
    ),
    "distillation.max_rollout_turns": Unused(
        _OWN_ROLLOUTS_SINGLE_TURN, _one_of(1), refuse="set it to 1 (or remove it)"
    ),
    "grpo.val_batch_size": Unused(
        "validation generates all of a data-parallel rank's held-out prompts as one batch",
        _covers_validation("grpo"),
    ),
    "distillation.val_batch_size": Unused(
        "validation generates all of a data-parallel rank's held-out prompts as one batch",
        _covers_validation("distillation"),
    ),
    "loss_fn.zero_outside_topk": Unused(
        "the KL is taken over the teacher's top-k renormalised",
        _any_inert(_one_of(False), _full_vocabulary),
        refuse="set it to false (or remove it)",
    ),
}

_NOT_YET = "not implemented yet by this backend"


def _not_yet(key: str, default: Any, what: str = "") -> Unused:
    """A NeMo-RL option this backend does not implement yet: silent at NeMo-RL's default
    (null counts as the default where NeMo-RL's type allows it), refused otherwise."""
    shown = show_value(default)
    return Unused(
        _NOT_YET + (f" ({what})" if what else ""),
        _equals(default),
        refuse=f"set {key} to its default {shown} (or remove it)",
    )


def _gym_penalty(key: str) -> Unused:
    """A message-level penalty: it acts on NeMo-Gym rollouts' turns
    (algorithms/gym_rollouts.py); without NeMo-Gym it is refused, as NeMo-RL refuses it."""
    return Unused(
        _GYM_PENALTY,
        _any_inert(_is_none, _unless_not("env.should_use_nemo_gym", True)),
        refuse=f"set env.should_use_nemo_gym: true (its rollouts flag the turns) or remove {key}",
    )


def _not_yet_section(key: str, what: str) -> Unused:
    return Unused(
        f"{_NOT_YET} ({what})",
        _switched_off,
        refuse=f"set {key}.enabled to false (or remove the section)",
    )


_SPEED_ONLY = "a speed or memory setting of NeMo-RL's; it does not change what is trained"
_GYM_PENALTY = "it penalizes flagged turns of NeMo-Gym rollouts (NeMo-RL refuses it without them)"
_NOT_READ_BY_NEMO_RL = (
    "NeMo-RL's GRPO accepts this key and does not read it (the penalties are "
    "grpo.invalid_tool_call_advantage and grpo.malformed_thinking_advantage)"
)
_ROLLOUT_PUMP = (
    "the single controller's rollout pump capacity; rollouts are sampled between steps here, "
    "each step's as one batch"
)
_GENERATION_FLEET = (
    "the single controller's separate generation fleet (its failures, stalls, health and "
    "router); generation runs in the training workers here"
)
_NO_REFIT = "generation uses the training weights in place; nothing is refit"
_NO_KV_TO_RECOMPUTE = (
    "the sampler's KV cache lives for one generation call, so none outlives a weight update"
)
_FILES_ONLY = "it shapes NeMo-RL's checkpoint files; this backend writes its own format"
_KERNEL = "a kernel or communication choice of NeMo-RL's; results are the same up to rounding"
_GLOBAL_LOSS = (
    "this backend's loss is normalized over the tokens of the global batch by itself; "
    "Megatron's loss-scaling switches do not apply"
)


def _policy_section_entries(where: str) -> dict[str, Unused]:
    """The NeMo-RL keys of a policy section (``policy`` or ``teacher``) this backend does
    not act on. The teacher never trains or generates, so its training-only keys are inert."""
    teacher = where == "teacher"
    m = f"{where}.megatron_cfg"

    def train_only(entry: Unused) -> Unused:
        return Unused(_TEACHER_TRAINS_NOT, _always) if teacher else entry

    entries: dict[str, Unused] = {
        f"{m}.optimizer.overlap_cpu_optimizer_d2h_h2d": train_only(
            Unused(_SPEED_ONLY, _one_of(False))
        ),
        f"{m}.scheduler.override_opt_param_scheduler": train_only(
            Unused(
                "the learning-rate schedule always follows the recipe, also on resume",
                _one_of(False, True),
            )
        ),
        f"{m}.attention_backend": Unused(_KERNEL),
        f"{m}.checkpoint": train_only(Unused(_FILES_ONLY, _empty)),
        f"{m}.clear_memory_caches_before_refit": Unused(_NO_REFIT, _always),
        f"{m}.converter_type": Unused(
            "the Hugging Face conversion follows config.json's model_type"
        ),
        f"{m}.cp_normalize": Unused(
            "the step's loss and gradients are the same at every context_parallel_size (each "
            "token counts once over the context-parallel ranks), so there is nothing to "
            "normalize",
            _always,
        ),
        f"{m}.defer_fp32_logits": Unused(_KERNEL, _one_of(False)),
        f"{m}.do_not_average_loss": train_only(Unused(_GLOBAL_LOSS, _one_of(False))),
        f"{m}.scale_loss_by_dp_cp_size": train_only(Unused(_GLOBAL_LOSS, _one_of(True))),
        f"{m}.calculate_per_token_loss": train_only(Unused(_GLOBAL_LOSS, _one_of(True))),
        f"{m}.force_reconvert_from_hf": Unused(
            "the Hugging Face weights are converted at every start (no conversion cache)",
            _always,
        ),
        f"{m}.freeze_config": train_only(
            Unused(
                "freezing the language model is not implemented yet by this backend (the "
                "vision keys change nothing: these language models have no vision parts)",
                _freezes_no_language_part,
                refuse="set its keys other than freeze_vision_* to false (or remove them)",
            )
        ),
        f"{m}.freeze_vision_model": Unused("language models have no vision tower", _always),
        f"{m}.freeze_vision_projection": Unused(
            "language models have no vision projection", _always
        ),
        f"{m}.use_fused_linear_logprobs": Unused(_SPEED_ONLY, _one_of(False)),
        f"{m}.fused_linear_logprobs_chunk_size": Unused(
            _SPEED_ONLY, _unless(f"{m}.use_fused_linear_logprobs", True)
        ),
        f"{m}.hybridep_num_ranks_per_nvlink_domain": Unused(_KERNEL),
        f"{m}.hybridep_use_mnnvl": Unused(_KERNEL, _one_of(False)),
        f"{m}.inference_grouped_gemm_backend": Unused(
            "NeMo-RL's inference engine is not used", _always
        ),
        f"{m}.inference_moe_token_dispatcher_type": Unused(
            "NeMo-RL's inference engine is not used", _always
        ),
        f"{m}.moe_enable_deepep": Unused(_KERNEL, _one_of(False)),
        f"{m}.moe_flex_dispatcher_backend": Unused(_KERNEL),
        f"{m}.moe_hybridep_num_sms": Unused(_KERNEL),
        f"{m}.moe_shared_expert_overlap": Unused(_KERNEL, _one_of(False)),
        f"{m}.moe_grouped_gemm": Unused(
            _KERNEL + "; model_overrides.moe_grouped_gemm selects it here", _one_of(False)
        ),
        f"{m}.moe_token_dispatcher_type": Unused(
            _KERNEL + "; model_overrides.moe_token_dispatcher_type selects it here",
            _one_of("alltoall"),
        ),
        f"{m}.moe_pad_experts_for_cuda_graph_inference": Unused(
            "NeMo-RL's inference engine is not used", _always
        ),
        f"{m}.moe_per_layer_logging": Unused("MoE metrics are not logged", _one_of(False)),
        f"{m}.track_moe_metrics": Unused("MoE metrics are not logged", _one_of(False)),
        f"{m}.use_gloo_process_groups": Unused(_KERNEL, _one_of(False)),
        f"{m}.gradient_accumulation_fusion": train_only(Unused(_KERNEL, _one_of(False))),
        f"{m}.use_fused_weighted_squared_relu": Unused(_KERNEL, _one_of(False)),
        # NeMo-RL's Megatron setup reads neither key (the model's own config decides, there as
        # here): a value given here is ignored with a warning naming the key that sets it.
        f"{m}.moe_aux_loss_coeff": train_only(
            Unused(
                "the auxiliary load-balancing loss weight is the model's, as in NeMo-RL (set "
                f"{m}.model_overrides.moe_aux_loss_coeff to change it)",
                _any_inert(_equals(0.0), _dense_model(where)),
            )
        ),
        f"{m}.moe_router_enable_expert_bias": Unused(
            "the router's expert bias is the model's, as in NeMo-RL (set "
            f"{m}.model_overrides.moe_router_enable_expert_bias to change it)",
            _dense_model(where),
        ),
        f"{m}.moe_router_num_groups": Unused(
            "group-limited routing is the model's (model_overrides)",
            _is_none,
            refuse=f"set {m}.model_overrides.moe_router_num_groups instead",
        ),
        f"{m}.moe_router_group_topk": Unused(
            "group-limited routing is the model's (model_overrides)",
            _is_none,
            refuse=f"set {m}.model_overrides.moe_router_group_topk instead",
        ),
        # Multi-token prediction: the policy's MTP block trains (config.multi_token_prediction).
        **{
            f"{m}.{key}": Unused(_TEACHER_TRAINS_NOT, _always)
            for key in multi_token_prediction.MTP_KEYS
            if not multi_token_prediction.applies_to(where)
        },
        f"{m}.train_iters": train_only(
            Unused(
                "the schedule's length is scheduler.lr_decay_iters and the run's the "
                "algorithm's max_num_steps"
            )
        ),
        f"{where}.sequence_packing.fuse_loss": Unused(
            "the loss always runs once over the whole pack (what fusing buys in NeMo-RL)",
            _always,
        ),
        f"{where}.sequence_packing.sequence_length_round": Unused(
            "packs are padded to make_sequence_length_divisible_by (as NeMo-RL pads packed "
            "sequences); sequences inside a pack need no padding here",
            _always,
        ),
        f"{where}.refit_buffer_size_gb": Unused(_NO_REFIT, _always),
        f"{where}.offload_optimizer_for_logprob": Unused(_SPEED_ONLY, _one_of(False)),
        f"{where}.draft": train_only(
            Unused(
                "the Eagle draft model trains beside the policy only to speed up vLLM's "
                "speculative decoding; its loss reads the policy's hidden states and logits "
                "detached and it has its own parameters, so the policy trains the same "
                "without it. Sampling here runs on megatron-core without a drafter, and no "
                "draft checkpoint is written",
                _switched_off,
            )
        ),
        # The policy's router_replay is implemented (config/router_replay.py).
        **({f"{where}.router_replay": Unused(_TEACHER_TRAINS_NOT, _always)} if teacher else {}),
        f"{where}.reward_model_cfg": _not_yet_section(f"{where}.reward_model_cfg", "reward models"),
        f"{where}.pretrained_checkpoint": Unused(
            "weights come from model_name or init_checkpoint",
            _empty,
            refuse=f"set {where}.init_checkpoint to the checkpoint directory instead",
        ),
        f"{where}.optimizer": Unused(
            "the DTensor backend's PyTorch optimizer: mapped onto megatron_cfg.optimizer when "
            "the section selects DTensor (config/dtensor_recipes.py); with megatron_cfg (as "
            "NeMo-RL does) the optimizer is megatron_cfg.optimizer",
            _always,
        ),
        f"{where}.scheduler": Unused(
            "the DTensor backend's PyTorch schedulers: mapped onto megatron_cfg.scheduler when "
            "the section selects DTensor (config/dtensor_recipes.py); with megatron_cfg (as "
            "NeMo-RL does) the schedule is megatron_cfg.scheduler",
            _always,
        ),
        # The policy's quant_cfg is implemented (config/quantization.py).
        **(
            {f"{where}.quant_cfg": _not_yet(f"{where}.quant_cfg", None, "a quantized teacher")}
            if teacher
            else {}
        ),
        f"{where}.is_vlm": _not_yet(f"{where}.is_vlm", False, "vision-language models"),
        **(
            {
                f"{where}.tokenizer.chat_template": Unused(
                    "no chat template is applied: the teacher scores the student's tokens"
                )
            }
            if teacher
            else {}
        ),
        f"{where}.tokenizer.use_fastokens": Unused(_SPEED_ONLY, _one_of(False)),
        f"{where}.tokenizer.use_processor": _not_yet(
            f"{where}.tokenizer.use_processor", False, "multimodal processors"
        ),
        f"{where}.tokenizer.audio": _not_yet(f"{where}.tokenizer.audio", None, "audio inputs"),
        f"{where}.tokenizer.video": _not_yet(f"{where}.tokenizer.video", None, "video inputs"),
    }
    d = f"{where}.dtensor_cfg"
    entries.update(
        {
            f"{d}._v2": Unused(
                "which of NeMo-RL's two DTensor workers runs; here megatron-core runs either",
                _always,
            ),
            f"{d}.cpu_offload": _dtensor_only(
                where,
                Unused(
                    "FSDP2's parameter CPU offload is not implemented: weights, gradients and "
                    "optimizer state stay on the GPU, which needs that memory (this backend "
                    "offloads activations: megatron_cfg.fine_grained_activation_offloading)",
                    _one_of(False),
                ),
            ),
            f"{d}.custom_parallel_plan": _dtensor_only(
                where,
                Unused(
                    "a DTensor sharding plan has no megatron-core meaning; the layout is "
                    "tensor_parallel_size and sequence_parallel (the trained numbers are the same)"
                ),
            ),
            f"{d}.automodel_kwargs": _dtensor_only(
                where,
                Unused(
                    "NeMo Automodel's model-loading options; megatron-core builds the model "
                    "from model_name",
                    _empty,
                ),
            ),
            f"{d}.dp_replicate_size": _dtensor_only(
                where,
                Unused(
                    "HSDP's replicate groups are a layout; data parallelism here is "
                    "megatron-core's with the distributed optimizer (the trained numbers are "
                    "the same)",
                    _equals(1),
                ),
            ),
            f"{d}.expert_parallel_size": _dtensor_only(
                where,
                Unused(
                    "experts run with expert_model_parallel_size 1 (a layout: the trained "
                    "numbers are the same)",
                    _equals(1),
                ),
            ),
            f"{d}.defer_fsdp_grad_sync": Unused(
                "when FSDP2 reduces gradients; " + _SPEED_ONLY, _always
            ),
            f"{d}.moe_parallelizer": _dtensor_only(
                where,
                Unused("FSDP2's MoE wrapping options; megatron-core lays out experts", _empty),
            ),
            f"{d}.clear_cache_every_n_steps": _dtensor_only(where, Unused(_SPEED_ONLY)),
            f"{d}.lora_cfg": _dtensor_only(
                where, _not_yet_section(f"{d}.lora_cfg", "LoRA adapters")
            ),
        }
    )
    if teacher:
        for key in (
            "quant_calib_data",
            "quant_calib_size",
            "quant_batch_size",
            "quant_sequence_length",
            "disable_modelopt_layer_spec",
        ):
            entries[f"{where}.{key}"] = Unused(_TEACHER_TRAINS_NOT, _always)
    else:
        # quant_calib_size, quant_batch_size and quant_sequence_length are implemented
        # (config/quantization.calibration_batches).
        entries[f"{where}.quant_calib_data"] = Unused(
            "NeMo-RL's calibration datasets are Hugging Face datasets, which this backend does "
            "not load; configs that calibrate activation ranges calibrate on the recipe's own "
            "training data",
            refuse="set it to null to calibrate on the first quant_calib_size training examples",
            at_start=True,
        )
        entries[f"{where}.disable_modelopt_layer_spec"] = Unused(
            "ModelOpt's quantizers attach to megatron-core's local layer spec, which this "
            "backend always builds",
            _always,
        )
    if teacher:
        # The policy's adapters are implemented (config/peft.py); a teacher's would change
        # the targets it gives.
        entries[f"{m}.peft"] = _not_yet_section(f"{m}.peft", "LoRA adapters on a teacher")
        return entries
    g = f"{where}.generation"
    for engine, label in (("vllm", "vLLM"), ("sglang", "SGLang"), ("trtllm", "TensorRT-LLM")):
        # Another engine's settings: ignored unless the recipe asks for that engine.
        reason = f"{label} is not used: generation runs with megatron-core"
        if engine == "vllm":
            reason += (
                " (of this section, expose_http_server and http_server_serving_chat_kwargs are "
                "honored: docs/serving.md)"
            )
        unless_chosen = _unless(f"{g}.backend", engine)
        entries[f"{g}.{engine}_cfg"] = Unused(reason, unless_chosen)
        entries[f"{g}.{engine}_kwargs"] = Unused(reason, _any_inert(_empty, unless_chosen))
    entries.update(
        {
            f"{g}.val_temperature": _same_val(g, "temperature", 1.0),
            f"{g}.val_top_p": _same_val(g, "top_p", 1.0),
            f"{g}.val_top_k": _same_val(g, "top_k", None),
            f"{g}.model_name": Unused("generation always samples from the trained policy", _always),
            f"{g}.bad_words": _not_yet(f"{g}.bad_words", None, "banned words in sampling"),
            f"{g}.colocated": Unused(
                "generation always runs on the training workers (colocated)", _switched_on
            ),
            # port_range_low/high are implemented (config/http_server.py).
            f"{g}.use_async_rollouts": Unused(
                "each step's rollouts are sampled as one batch", _one_of(False)
            ),
            f"{g}.dynamo_cfg": Unused(
                "Dynamo is not used: generation runs with megatron-core",
                _unless(f"{g}.backend", "dynamo"),
            ),
            f"{g}.refit_cfg": Unused(_NO_REFIT, _always),
            f"{g}.refit_transport": Unused(_NO_REFIT, _always),
            # generation.quant_cfg and real_quant are implemented (config/quantization.py).
            f"{g}.real_quant_export_cpu_offload": Unused(
                "vLLM's packed NVFP4 export; rollouts here run the fake-quantized model", _always
            ),
            f"{g}.real_quant_ignore": Unused(
                "vLLM's packed NVFP4 export; rollouts here run the fake-quantized model", _always
            ),
        }
    )
    entries.update(_mcore_generation_entries(g))
    return entries


# policy.generation.mcore_generation_config: the sampler acts on buffer_size_gb (the KV cache's
# limit), cuda_graph_impl and num_cuda_graphs (decode-step CUDA graphs); see docs/generation.md.
# expose_http_server and parsers are implemented (config/http_server.py, docs/serving.md).
_DYNAMIC_ENGINE_KEYS = (
    "block_size_tokens",
    "buffer_guaranteed_fraction",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "inference_cuda_graph_scope",
    "inference_grouped_gemm_backend",
    "kv_cache_management_mode",
    "logging_step_interval",
    "mamba_inference_conv_states_dtype",
    "mamba_inference_ssm_states_dtype",
    "materialize_only_last_token_logits",
    "max_model_len",
    "max_tokens",
    "refit_backend",
    "unified_memory_level",
    "use_cuda_graphs_for_non_decode_steps",
)
_INFERENCE_MODEL_KEYS = (
    "activation_checkpointing",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "moe_router_dtype",
    "moe_router_group_topk",
    "moe_router_num_groups",
    "pipeline_model_parallel_size",
    "sequence_parallel",
    "tensor_model_parallel_size",
    "transformer_impl",
)


def _mcore_generation_entries(g: str) -> dict[str, Unused]:
    section = f"{g}.mcore_generation_config"
    chosen = _unless(f"{g}.backend", "megatron")
    entries = {
        f"{section}.{key}": Unused(
            "the sampler is this backend's KV-cached loop (static batch, prefill once, "
            "decode-step CUDA graphs), not NeMo-RL's dynamic inference engine, whose setting "
            "this is",
            chosen,
        )
        for key in _DYNAMIC_ENGINE_KEYS
    }
    entries.update(
        {
            f"{section}.{key}": Unused(
                "generation runs on the training model itself, with its parallel layout and "
                "settings (policy.megatron_cfg)",
                chosen,
            )
            for key in _INFERENCE_MODEL_KEYS
        }
    )
    entries[f"{section}.cuda_graph_impl"] = Unused(
        "decode-step CUDA graphs capture models on one pipeline stage without sequence "
        "parallelism, and models with experts only on the dense expert path (every expert on "
        "each rank, no token dropping, no recorded routes: "
        "docs/generation.md); this policy's decode steps run eagerly (set it to none to say so)",
        _decode_graphs_apply(g),
    )
    entries[f"{section}.num_speculative_tokens"] = _not_yet(
        f"{section}.num_speculative_tokens", 0, "speculative decoding"
    )
    return entries


def _same_val(generation: str, key: str, default: Any) -> Unused:
    return Unused(
        f"{_NOT_YET} (validation samples with the training {key})",
        _same_as(f"{generation}.{key}", default),
        refuse=f"set it to {generation}.{key}'s value (or remove it)",
    )


def _dtensor_only(where: str, entry: Unused) -> Unused:
    """``entry``, inert too while the section does not select DTensor: NeMo-RL reads
    dtensor_cfg only then (config/dtensor_recipes.py maps the section when it does)."""

    def off(value: Any, recipe: Mapping[str, Any]) -> bool:
        return _at(recipe, f"{where}.dtensor_cfg.enabled") is not True

    return replace(entry, inert=_any_inert(off, entry.inert))


def _switched_on(value: Any, recipe: Mapping[str, Any]) -> bool:
    return value is None or (isinstance(value, Mapping) and value.get("enabled", True) is True)


def _nemo_rl_data_or(
    check: Callable[[Any, Mapping[str, Any]], bool],
) -> Callable[[Any, Mapping[str, Any]], bool]:
    """A key NeMo-RL's processors read is acted on where data.train names NeMo-RL's datasets
    (data/processors), and inert elsewhere at NeMo-RL's default."""

    def inert(value: Any, recipe: Mapping[str, Any]) -> bool:
        return _at(recipe, "data.train") is not None or check(value, recipe)

    return inert


def _other_entries() -> dict[str, Unused]:
    """The NeMo-RL keys outside the policy sections that this backend does not act on."""
    entries: dict[str, Unused] = {
        # data: data.train, data.validation and data.default are NeMo-RL's datasets
        # (config/data_settings.py, data/nemo_rl_datasets.py).
        "data.num_workers": Unused(_SPEED_ONLY),
    }
    for key, default in (("add_bos", True), ("add_eos", True), ("add_generation_prompt", False)):
        entries[f"data.{key}"] = Unused(
            "this backend's own data (arithmetic, jsonl) is tokenized without a chat template; "
            "NeMo-RL's datasets under data.train apply it",
            _nemo_rl_data_or(_equals(default)),
            refuse=f"set data.{key} to {show_value(default)} (or remove it)",
        )
    entries["data.add_system_prompt"] = Unused(
        "not read: a dataset's system_prompt_file is applied as NeMo-RL's processors apply it",
        _equals(True),
        refuse="set data.add_system_prompt to true (or remove it)",
    )
    for key, default in (
        ("use_multiple_dataloader", False),
        ("num_prompts_per_dataloader", None),
        ("custom_dataloader", None),
    ):
        entries[f"data.{key}"] = Unused(
            "not implemented: the datasets' rows are drawn as one data order",
            _equals(default),
            refuse=f"set data.{key} to {show_value(default)} (or remove it)",
        )
    entries.update(
        {
            # logger
            "logger.wandb_enabled": Unused(
                "metrics go to TensorBoard and the log directory only", _one_of(False)
            ),
            "logger.swanlab_enabled": Unused(
                "metrics go to TensorBoard and the log directory only", _one_of(False)
            ),
            "logger.mlflow_enabled": Unused(
                "metrics go to TensorBoard and the log directory only", _one_of(False)
            ),
            "logger.wandb": Unused(
                "Weights & Biases is not a metric sink here",
                _unless("logger.wandb_enabled", True),
            ),
            "logger.swanlab": Unused(
                "SwanLab is not a metric sink here", _unless("logger.swanlab_enabled", True)
            ),
            "logger.mlflow": Unused(
                "MLflow is not a metric sink here", _unless("logger.mlflow_enabled", True)
            ),
            "logger.tensorboard": Unused(
                "TensorBoard writes under logger.log_dir",
                _unless("logger.tensorboard_enabled", True),
            ),
            "logger.gpu_monitoring": Unused(
                "GPU metrics are sampled at this backend's own interval",
                _unless("logger.monitor_gpus", True),
            ),
            # checkpointing
            "checkpointing.save_optimizer": Unused(
                "the optimizer state is always saved (a run resumes exactly)", _one_of(True)
            ),
            "checkpointing.model_save_format": Unused(_FILES_ONLY, _one_of("safetensors")),
            "checkpointing.save_consolidated": Unused(
                _FILES_ONLY + " (nemo-rl-offload export-hf writes a Hugging Face model)",
                _one_of(False),
            ),
            "checkpointing.model_cache_dir": Unused(_FILES_ONLY, _one_of("")),
            "checkpointing.model_repo_id": Unused(_FILES_ONLY, _one_of("")),
            "checkpointing.is_peft": Unused(_FILES_ONLY, _one_of(False)),
            "checkpointing.is_async": Unused(_SPEED_ONLY, _one_of(False)),
            "checkpointing.ft_keep_latest_k": Unused(
                "fault-tolerance checkpoints are not written; checkpointing.save_period and "
                "checkpoint_must_save_by are"
            ),
            "checkpointing.ft_save_period": Unused(
                "fault-tolerance checkpoints are not written; checkpointing.save_period and "
                "checkpoint_must_save_by are"
            ),
            "checkpointing.pretrained_checkpoint": Unused(
                "weights come from policy.model_name or policy.init_checkpoint",
                _empty,
                refuse="set policy.init_checkpoint to the checkpoint directory instead",
            ),
            # cluster
            "cluster.master_port_range_low": Unused(
                "torch.distributed picks a free port itself", _always
            ),
            "cluster.master_port_range_high": Unused(
                "torch.distributed picks a free port itself", _always
            ),
            "cluster.segment_size": Unused(
                "workers are placed by cluster.gpus_per_node and num_nodes"
            ),
            # environments
            "env.dapo": Unused("only env.math is started; its num_workers sets the reward workers"),
            # env.should_use_nemo_gym, env.nemo_gym and env.should_mask_flagged_samples are
            # implemented for GRPO (config/nemo_gym.py, algorithms/gym_rollouts.py).
            "env.should_log_nemo_gym_responses": Unused(
                "NeMo-Gym's responses are not written to the metrics (NeMo-Gym's own log is "
                "logger.log_dir/nemo_gym/nemo_gym.log)",
                _one_of(False),
            ),
            # NeMo-RL features this backend does not have
            "reward_penalties": Unused(
                f"{_NOT_YET} (NeMo-Gym reward penalties)",
                _no_penalties,
                refuse="set its penalize_* keys to false (or remove the section)",
            ),
            "data_plane": Unused(
                "rollouts stay in the driver; NeMo-RL's data plane transports them",
                _switched_off,
            ),
            # async_rl: NeMo-RL's single-controller asynchronous trainer. Its samplers but the
            # custom one run as a lead (config/grpo_options.async_lead); what follows is the rest.
            "async_rl.sampler.name": Unused(
                "a custom sampler is a class over NeMo-RL's replay buffer, which this backend "
                "does not have, and NeMo-RL names no other samplers",
                _one_of(*grpo_options.SAMPLER_WINDOWS),
                refuse="set async_rl.sampler.name to in_order, ready_first, weight_fifo or "
                "windowed",
            ),
            "async_rl.min_groups_for_streaming_train": Unused(
                "every step's prompt groups are ready when it selects (generation never "
                "overlaps training here), so each step trains on all grpo.num_prompts_per_step "
                "of them, as NeMo-RL's does when generation keeps pace",
                _whole_step_or_refused,
            ),
            "async_rl.recompute_kv_cache_after_weight_updates": Unused(
                _NO_KV_TO_RECOMPUTE, _one_of(False)
            ),
            "async_rl.max_inflight_prompts": Unused(_ROLLOUT_PUMP, _always),
            "async_rl.max_buffered_rollouts": Unused(_ROLLOUT_PUMP, _always),
            "async_rl.diagnostics": Unused("NeMo-RL's per-rollout prints", _one_of(False)),
            "async_rl.rollout_failure": Unused(_GENERATION_FLEET, _always),
            "async_rl.stall_watchdog": Unused(_GENERATION_FLEET, _always),
            "async_rl.generation_fleet_health": Unused(_GENERATION_FLEET, _always),
            "async_rl.generation_router": Unused(_GENERATION_FLEET, _always),
            # algorithms
            "sft.only_unmask_final": Unused(
                "every SFT example is one prompt and one response, so the final turn is the "
                "response, which is all that trains either way",
                _always,
            ),
            "grpo.skip_reference_policy_logprobs_calculation": Unused(
                _NOT_YET,
                _any_inert(_one_of(False), _zero_kl_penalty),
                refuse="set it to false (or remove it)",
            ),
            # grpo.async_grpo itself is implemented (config/grpo_options.async_lead); these are
            # its generation engine's switches.
            "grpo.async_grpo.in_flight_weight_updates": Unused(
                "generation never overlaps a weight update here (rollouts are sampled between "
                "steps), so no update is ever in flight",
                _one_of(False),
            ),
            "grpo.async_grpo.recompute_kv_cache_after_weight_updates": Unused(
                _NO_KV_TO_RECOMPUTE, _one_of(False)
            ),
            "grpo.async_grpo.max_generation_failures": Unused(
                "generation runs in the training workers here, and a failed generation ends "
                "the run (as 0 does)",
                _one_of(0),
            ),
            "grpo.calculate_advantages_on_gpu": Unused(_SPEED_ONLY, _one_of(False)),
            # The message-level penalties flag NeMo-Gym rollouts' turns
            # (environments/nemo_gym_results.py); NeMo-RL refuses them without NeMo-Gym too.
            "grpo.invalid_tool_call_advantage": _gym_penalty("grpo.invalid_tool_call_advantage"),
            "grpo.malformed_thinking_advantage": _gym_penalty("grpo.malformed_thinking_advantage"),
            # NeMo-RL's GRPO config accepts these and reads none of them (the penalties are the
            # *_advantage keys): ignoring them here is NeMo-RL's meaning.
            "grpo.penalize_invalid_tool_call": Unused(_NOT_READ_BY_NEMO_RL, _always),
            "grpo.penalize_malformed_thinking": Unused(_NOT_READ_BY_NEMO_RL, _always),
            "grpo.invalid_tool_call_strategy": Unused(_NOT_READ_BY_NEMO_RL, _always),
            "grpo.adv_estimator": Unused(
                f"{_NOT_YET} (its estimators are GRPO's, 'grpo', and on-policy "
                "distillation's, 'opd')",
                _grpo_estimator,
                refuse="set grpo.adv_estimator.name to 'grpo' (or remove the section), or to "
                "'opd' with on_policy_distillation",
            ),
            "grpo.normalize_rewards": Unused(
                "NeMo-RL's GRPO does not read it either: the advantages are normalised by "
                "grpo.adv_estimator.normalize_rewards (true when absent); set that key "
                "(NeMo-RL's recipes set it to ${grpo.normalize_rewards})",
                _estimator_normalises_alike,
            ),
            "grpo.deduplicate_multimodal_data": Unused(
                "language-model data has no multimodal parts", _always
            ),
            "grpo.debug_payload_metrics": Unused(
                "NeMo-RL's payload debug metrics are not logged", _one_of(False)
            ),
        }
    )
    return entries


def _zero_kl_penalty(value: Any, recipe: Mapping[str, Any]) -> bool:
    """Skipping the reference log-probs changes nothing when the KL penalty is 0."""
    penalty = _at(recipe, "loss_fn.reference_policy_kl_penalty")
    return isinstance(penalty, int | float) and not isinstance(penalty, bool) and penalty == 0


for _where in ("policy", "teacher"):
    IGNORED.update(_policy_section_entries(_where))
IGNORED.update(_other_entries())


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


def _inert(unused: Unused, value: Any, recipe: Mapping[str, Any]) -> bool:
    """Whether ``value`` is inert; a value of the wrong type is the schema's to report, so it
    gives no second line here."""
    try:
        return bool(unused.inert(value, recipe))
    except (TypeError, AttributeError, ValueError):
        return True


def check(recipe: Mapping[str, Any], *, starting: bool = False) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the listed keys a recipe sets to a value that is not inert.

    A key refused only when a run starts (``at_start``) is a warning for ``validate`` (it says
    that ``train`` refuses it) and an error when ``starting``."""
    errors: list[str] = []
    warnings: list[str] = []
    for dotted, unused in IGNORED.items():
        present, value = _lookup(recipe, dotted)
        if not present or _inert(unused, value, recipe):
            continue
        if unused.refuse is not None and unused.at_start and not starting:
            warnings.append(
                f"warning: {dotted}: {unused.reason}; training commands refuse to start "
                f"until you {unused.refuse}"
            )
        elif unused.refuse is not None:
            errors.append(
                f"{dotted}: {show_value(value)} is not supported by this backend "
                f"({unused.reason}); {unused.refuse}"
            )
        else:
            warnings.append(f"warning: {dotted}: ignored by this backend: {unused.reason}")
    return errors, warnings


TABLE_START = "<!-- ignored-keys table: generated by ignored_keys.markdown_table() -->"
TABLE_END = "<!-- end of ignored-keys table -->"


def markdown_table() -> str:
    """The registry as the Markdown table of docs/recipes.md (a test keeps the two equal), so
    that the documentation cannot drift from what ``validate`` does."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        TABLE_START,
        "",
        "| key | at a value that is not inert | why | what to set |",
        "|---|---|---|---|",
    ]
    for key in sorted(IGNORED):
        entry = IGNORED[key]
        if entry.inert is _always:
            action = "none: every value is inert"
        elif entry.refuse is None:
            action = "warning"
        elif entry.at_start:
            action = "warning; training refuses to start"
        else:
            action = "refused"
        lines.append(f"| `{key}` | {action} | {cell(entry.reason)} | {cell(entry.refuse or '-')} |")
    lines += ["", TABLE_END]
    return "\n".join(lines)
