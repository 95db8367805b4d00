"""Run a recipe written for NeMo-RL's DTensor backend on megatron-core, with the same meaning.

This backend has one trainer, so a DTensor policy section is rewritten into the ``megatron_cfg``
that trains the same model the same way (:func:`to_megatron`, once, in
:func:`nemo_rl_offload.preflight.check_recipe`); what cannot have the same meaning is refused
in one line naming the key. How: docs/recipes.md.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_offload.config.validate import show_value

__all__ = ["Schedule", "map_optimizer", "map_scheduler", "selects_dtensor", "to_megatron"]

# torch.optim.AdamW's defaults, which NeMo-RL's kwargs fall back to.
_ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
# Kwargs that only choose an implementation (or are off at their default): no effect on the math.
_SPEED_KWARGS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}
# Kwargs that change the update when not at torch's default; megatron-core's Adam has no such
# switch, so another value is refused.
_FIXED_KWARGS = {"amsgrad": False, "maximize": False}
_ADAM_NAMES = {"torch.optim.AdamW": "AdamW", "torch.optim.Adam": "Adam"}
_SCHEDULER_PREFIX = "torch.optim.lr_scheduler."
# This backend's own speed and memory knobs, which change no number that is trained: they stay
# in force from the section's megatron_cfg (where the planner writes its choice), while NeMo-RL's
# Megatron settings there are dropped.
KEPT_MEGATRON_KEYS = (
    "fine_grained_activation_offloading",
    "offload_modules",
    "min_offloaded_tensor_size",
    "activation_offload_fraction",
    "activation_offload_fraction_placement",
    "delay_offload_until_cuda_graph",
    "delta_offload_bytes_across_pp_ranks",
    "fine_grained_offloading_max_inflight_offloads",
    "offload_host_memory_budget_gib",
    "offload_sequence_length_buckets",
    "offload_plan_budget_gib",
    "cuda_graph_impl",
    "cuda_graph_modules",
    "cuda_graph_warmup_steps",
    "transformer_impl",
)
# Kernel choices among model_overrides that change no trained number (up to rounding): the
# grouped expert GEMM, which the planner turns on for its measurements of MoE models.
KEPT_MODEL_OVERRIDES = ("moe_grouped_gemm",)
_FIX_SCHEDULE = (
    "use a LinearLR warm-up (end_factor 1.0) followed by at most one of ConstantLR "
    "(factor 1.0), LinearLR (start_factor 1.0) or CosineAnnealingLR, with milestones at the "
    "warm-up's total_iters"
)


class _Refused(ValueError):
    """One line naming the key and the fix."""


def selects_dtensor(section: Any) -> bool:
    """NeMo-RL's own test for its DTensor backend: Megatron off, DTensor on."""
    if not isinstance(section, Mapping):
        return False
    megatron = section.get("megatron_cfg")
    dtensor = section.get("dtensor_cfg")
    return (
        isinstance(megatron, Mapping)
        and megatron.get("enabled") is False
        and isinstance(dtensor, Mapping)
        and dtensor.get("enabled") is True
    )


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Refused(f"{key}: {show_value(value)} is not a number; give a number")
    return float(value)


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Refused(f"{key}: {show_value(value)} is not a whole number >= 0; give one")
    return value


def map_optimizer(optimizer: Any, where: str) -> dict[str, Any]:
    """``<where>.optimizer`` (a torch Adam/AdamW and its kwargs) as megatron_cfg.optimizer.

    megatron-core's "adam" decays weights decoupled from the gradient (AdamW: Transformer
    Engine's and Apex's FusedAdam in adam_w_mode, or torch's AdamW), so AdamW maps with its
    weight_decay and Adam only without one (torch's Adam adds it to the gradient instead)."""
    key = f"{where}.optimizer"
    if optimizer is None:
        raise _Refused(
            f"{key}: missing; a DTensor recipe names its optimizer here, e.g. "
            "{name: torch.optim.AdamW, kwargs: {lr: 5.0e-6}}"
        )
    if not isinstance(optimizer, Mapping):
        raise _Refused(f"{key}: must be a section {{name, kwargs}}, not {show_value(optimizer)}")
    name = optimizer.get("name")
    if name not in _ADAM_NAMES:
        raise _Refused(
            f"{key}.name: {show_value(name)} has no megatron-core optimizer with the same "
            "update; use torch.optim.AdamW (or torch.optim.Adam with weight_decay 0)"
        )
    kwargs = optimizer.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise _Refused(f"{key}.kwargs: must be a mapping, not {show_value(kwargs)}")
    known = {*_ADAMW_DEFAULTS, *_SPEED_KWARGS, *_FIXED_KWARGS}
    for arg, value in kwargs.items():
        if arg not in known:
            raise _Refused(
                f"{key}.kwargs.{arg}: not mapped onto megatron-core's Adam; remove it "
                f"(mapped: {', '.join(sorted(known))})"
            )
        if arg in _FIXED_KWARGS and value not in (None, _FIXED_KWARGS[arg]):
            raise _Refused(
                f"{key}.kwargs.{arg}: {show_value(value)} has no megatron-core equivalent; set "
                f"it to {show_value(_FIXED_KWARGS[arg])} (or remove it)"
            )
    defaults = dict(_ADAMW_DEFAULTS)
    if _ADAM_NAMES[name] == "Adam":
        defaults["weight_decay"] = 0.0
    lr = _number(kwargs.get("lr", defaults["lr"]), f"{key}.kwargs.lr")
    weight_decay = _number(
        kwargs.get("weight_decay", defaults["weight_decay"]), f"{key}.kwargs.weight_decay"
    )
    if _ADAM_NAMES[name] == "Adam" and weight_decay != 0.0:
        raise _Refused(
            f"{key}.kwargs.weight_decay: torch.optim.Adam adds weight decay to the gradient, "
            "megatron-core's Adam decays decoupled (AdamW); use torch.optim.AdamW or "
            "weight_decay 0"
        )
    betas = kwargs.get("betas", defaults["betas"])
    if not isinstance(betas, list | tuple) or len(betas) != 2:
        raise _Refused(f"{key}.kwargs.betas: {show_value(betas)} is not two numbers; give two")
    return {
        "optimizer": "adam",
        "lr": lr,
        "min_lr": lr,
        "weight_decay": weight_decay,
        "adam_beta1": _number(betas[0], f"{key}.kwargs.betas"),
        "adam_beta2": _number(betas[1], f"{key}.kwargs.betas"),
        "adam_eps": _number(kwargs.get("eps", defaults["eps"]), f"{key}.kwargs.eps"),
    }


@dataclass(frozen=True)
class Schedule:
    """A schedule megatron-core's OptimizerParamScheduler runs exactly: a linear warm-up from
    ``warmup_factor`` x lr over ``warmup`` steps, then constant, or a linear or cosine decay to
    ``end_lr`` reached at step ``decay_end``."""

    warmup: int = 0
    warmup_factor: float = 1.0
    style: str = "constant"
    decay_end: int | None = None
    end_lr: float | None = None  # absolute; None: the optimizer's lr
    # Steps after which torch's schedule and this one part (CosineAnnealingLR climbs again
    # after T_max, megatron-core holds eta_min); None: never.
    exact_until: int | None = None

    def megatron(self, lr: float, weight_decay: float) -> tuple[dict[str, Any], float]:
        """(megatron_cfg.scheduler, optimizer.min_lr) for an optimizer of this lr."""
        scheduler = {
            "lr_warmup_iters": self.warmup,
            "lr_warmup_init": self.warmup_factor * lr,
            "lr_decay_style": self.style,
            "lr_decay_iters": self.decay_end,
            "start_weight_decay": weight_decay,
            "end_weight_decay": weight_decay,
            "weight_decay_incr_style": "constant",
        }
        return scheduler, lr if self.end_lr is None else self.end_lr


@dataclass
class _Step:
    name: str
    kwargs: dict[str, Any]
    key: str


def _parse_schedulers(value: Any, key: str) -> tuple[list[_Step], list[int]]:
    """NeMo-RL's forms: one ``{name, kwargs}``, or a list of them plus ``{milestones}``."""
    entries = [value] if isinstance(value, Mapping) else value
    if not isinstance(entries, list):
        raise _Refused(f"{key}: must be a scheduler section or a list of them")
    steps: list[_Step] = []
    milestones: list[int] | None = None
    for i, entry in enumerate(entries):
        here = key if isinstance(value, Mapping) else f"{key}.{i}"
        if not isinstance(entry, Mapping):
            raise _Refused(f"{here}: must be {{name, kwargs}} or {{milestones}}")
        if "name" not in entry:
            if "milestones" not in entry or not isinstance(entry["milestones"], list):
                raise _Refused(f"{here}: neither a scheduler (name) nor a milestones list")
            milestones = [_int(m, f"{here}.milestones") for m in entry["milestones"]]
            continue
        name = str(entry["name"])
        short = name.removeprefix(_SCHEDULER_PREFIX)
        if short not in ("LinearLR", "ConstantLR", "CosineAnnealingLR") or name == short:
            raise _Refused(
                f"{here}.name: {show_value(entry['name'])} is not mapped onto megatron-core's "
                f"schedule; {_FIX_SCHEDULE}"
            )
        kwargs = entry.get("kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise _Refused(f"{here}.kwargs: must be a mapping")
        steps.append(_Step(short, dict(kwargs), here))
    if milestones is None:
        milestones = []
    if len(steps) > 1 and len(milestones) != len(steps) - 1:
        raise _Refused(
            f"{key}: {len(steps)} schedulers need {len(steps) - 1} milestones "
            "(torch's SequentialLR); add {milestones: [...]}"
        )
    return steps, milestones


def _kw(step: _Step, name: str, default: Any) -> float:
    return _number(step.kwargs.get(name, default), f"{step.key}.kwargs.{name}")


def _check_kwargs(step: _Step, allowed: tuple[str, ...]) -> None:
    for name in step.kwargs:
        if name not in allowed:
            raise _Refused(
                f"{step.key}.kwargs.{name}: not mapped onto megatron-core's schedule; remove it"
            )


def map_scheduler(value: Any, lr: float, where: str) -> Schedule:
    """``<where>.scheduler`` as a :class:`Schedule`, or a refusal when megatron-core's
    OptimizerParamScheduler cannot follow torch's schedulers step for step.

    torch's closed forms (per step t, base lr 1): LinearLR s + (e - s) min(t, T) / T;
    ConstantLR f before T, 1 after; CosineAnnealingLR eta + (1 - eta)(1 + cos(pi t / T)) / 2;
    SequentialLR runs the next scheduler from its own step 0 at each milestone. megatron-core
    runs init + (lr - init) t / W during warm-up, then constant, linear or cosine to min_lr:
    the same functions when the warm-up ends at 1 and the decay starts where it ends."""
    key = f"{where}.scheduler"
    if value is None or value == []:
        return Schedule()  # NeMo-RL's default: LambdaLR(lambda step: 1)
    steps, milestones = _parse_schedulers(value, key)
    schedule = Schedule()
    start = 0
    if steps and steps[0].name == "LinearLR":
        first = steps[0]
        _check_kwargs(first, ("start_factor", "end_factor", "total_iters"))
        begin = _kw(first, "start_factor", 1.0 / 3)
        end = _kw(first, "end_factor", 1.0)
        total = _int(first.kwargs.get("total_iters", 5), f"{first.key}.kwargs.total_iters")
        if end == 1.0:
            schedule = Schedule(warmup=total, warmup_factor=begin)
            if len(steps) > 1:
                start = milestones[0]
                if start < total:
                    raise _Refused(
                        f"{key}: milestone {start} cuts the warm-up of {total} steps short; "
                        f"set the milestone to {total}"
                    )
            steps = steps[1:]
    if not steps:
        return schedule
    if len(steps) > 1:
        raise _Refused(f"{key}: {len(steps)} schedulers after the warm-up; {_FIX_SCHEDULE}")
    step = steps[0]
    if step.name == "ConstantLR":
        _check_kwargs(step, ("factor", "total_iters"))
        factor = _kw(step, "factor", 1.0 / 3)
        total = _int(step.kwargs.get("total_iters", 5), f"{step.key}.kwargs.total_iters")
        if factor != 1.0 and total > 0:
            raise _Refused(
                f"{step.key}.kwargs.factor: {show_value(step.kwargs.get('factor', 1.0 / 3))} "
                f"holds a reduced lr for {total} steps, which megatron-core's schedule cannot; "
                "set factor to 1.0"
            )
        return schedule
    if start != schedule.warmup:
        raise _Refused(
            f"{key}: the decay starts at milestone {start}, not where the {schedule.warmup}-step "
            f"warm-up ends; set the milestone to {schedule.warmup}"
        )
    if step.name == "LinearLR":
        _check_kwargs(step, ("start_factor", "end_factor", "total_iters"))
        begin = _kw(step, "start_factor", 1.0 / 3)
        end = _kw(step, "end_factor", 1.0)
        total = _int(step.kwargs.get("total_iters", 5), f"{step.key}.kwargs.total_iters")
        if begin != 1.0:
            raise _Refused(
                f"{step.key}.kwargs.start_factor: a decay must start at the full lr; set it to "
                "1.0 (or make this LinearLR the first scheduler, as a warm-up ending at 1.0)"
            )
        if total == 0 or end == 1.0:
            return schedule
        return Schedule(
            schedule.warmup, schedule.warmup_factor, "linear", start + total, end * lr, None
        )
    _check_kwargs(step, ("T_max", "eta_min"))
    if "T_max" not in step.kwargs:
        raise _Refused(f"{step.key}.kwargs.T_max: required by CosineAnnealingLR; give it")
    t_max = _int(step.kwargs["T_max"], f"{step.key}.kwargs.T_max")
    eta_min = _kw(step, "eta_min", 0.0)
    if t_max == 0 or eta_min > lr:
        raise _Refused(
            f"{step.key}.kwargs: CosineAnnealingLR needs T_max > 0 and eta_min <= lr; fix them"
        )
    return Schedule(
        schedule.warmup, schedule.warmup_factor, "cosine", start + t_max, eta_min, start + t_max
    )


@dataclass
class Mapped:
    """A recipe with every DTensor section rewritten, and what validate says about it."""

    recipe: dict[str, Any]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)  # the rewritten ones


def _run_length(recipe: Mapping[str, Any]) -> int | None:
    for algorithm in ("grpo", "sft", "dpo", "distillation"):
        section = recipe.get(algorithm)
        if isinstance(section, Mapping) and isinstance(section.get("max_num_steps"), int):
            return section["max_num_steps"]
    return None


def _section(recipe: Mapping[str, Any], where: str, out: Mapped) -> dict[str, Any]:
    """The megatron_cfg that trains ``recipe[where]`` as its DTensor settings say."""
    dtensor = recipe[where]["dtensor_cfg"]
    d = f"{where}.dtensor_cfg"
    inactive = recipe[where]["megatron_cfg"]
    megatron: dict[str, Any] = {k: inactive[k] for k in KEPT_MEGATRON_KEYS if k in inactive}
    kernels = {
        k: v
        for k, v in (inactive.get("model_overrides") or {}).items()
        if k in KEPT_MODEL_OVERRIDES
    }
    if kernels:
        megatron["model_overrides"] = kernels
    megatron["enabled"] = True
    tp = dtensor.get("tensor_parallel_size", 1)
    cp = dtensor.get("context_parallel_size", 1)
    megatron["tensor_model_parallel_size"] = tp
    megatron["pipeline_model_parallel_size"] = 1
    megatron["expert_model_parallel_size"] = 1
    # Megatron's context parallelism splits each sequence over ranks as DTensor's does; the
    # rules check the size (type, worker count) under the Megatron key.
    megatron["context_parallel_size"] = 1 if cp is None else cp
    # Sequence parallelism shards activations over the tensor-parallel group: with one rank
    # there it is a no-op in DTensor, which megatron-core refuses to be asked for.
    megatron["sequence_parallel"] = dtensor.get("sequence_parallel", False) is True and (
        isinstance(tp, int) and tp > 1
    )
    megatron["activation_checkpointing"] = dtensor.get("activation_checkpointing", False) is True
    env_vars = dtensor.get("env_vars")
    if isinstance(env_vars, Mapping) and env_vars:
        megatron["env_vars"] = dict(env_vars)
    mapped = False
    try:
        _map_training(recipe, where, megatron, out)
        mapped = True
    except _Refused as exc:
        if where == "policy":  # the teacher never trains: its optimizer means nothing
            out.errors.append(str(exc))
            megatron["optimizer"] = {"optimizer": "adam", "lr": 0.0}  # stand-in: refused
    shown = ", ".join(
        f"{name}={show_value(megatron[name])}"
        for name in (
            "tensor_model_parallel_size",
            "context_parallel_size",
            "sequence_parallel",
            "activation_checkpointing",
        )
    )
    if mapped and where == "policy":
        opt, sched = megatron["optimizer"], megatron["scheduler"]
        shown += (
            f", optimizer adam lr={show_value(opt['lr'])} weight_decay="
            f"{show_value(opt['weight_decay'])} clip_grad={show_value(opt['clip_grad'])}, "
            f"schedule {_describe(sched)}"
        )
    out.warnings.append(
        f"warning: {d}: NeMo-RL's DTensor settings run on megatron-core here, as "
        f"{where}.megatron_cfg with {shown} (pipeline and expert parallel size 1); the "
        f"recipe's inactive {where}.megatron_cfg is not read, as in NeMo-RL, but for this "
        "backend's speed knobs (offloading, CUDA graphs, layer implementation, grouped expert "
        "GEMM)"
    )
    return megatron


def _describe(scheduler: Mapping[str, Any]) -> str:
    style = scheduler["lr_decay_style"]
    after = style if style == "constant" else f"{style} decay to step {scheduler['lr_decay_iters']}"
    if not scheduler["lr_warmup_iters"]:
        return after
    return f"{scheduler['lr_warmup_iters']}-step linear warm-up, then {after}"


def _map_training(
    recipe: Mapping[str, Any], where: str, megatron: dict[str, Any], out: Mapped
) -> None:
    """megatron_cfg.optimizer and .scheduler from the section's optimizer, scheduler,
    max_grad_norm and precision."""
    section = recipe[where]
    optimizer = map_optimizer(section.get("optimizer"), where)
    clip = section.get("max_grad_norm")
    # NeMo-RL clips only when max_grad_norm is set; megatron-core only when clip_grad > 0.
    optimizer["clip_grad"] = 0.0 if clip is None else _number(clip, f"{where}.max_grad_norm")
    precision = section.get("precision")
    optimizer["bf16"] = precision == "bfloat16"
    optimizer["fp16"] = precision == "float16"
    # FSDP2 keeps float32 weights and casts for compute, as megatron-core's float32 main
    # weights do; and it shards optimizer state, as the distributed optimizer does.
    optimizer["params_dtype"] = "float32"
    optimizer["use_distributed_optimizer"] = True
    # torch's optimizer gets every parameter in one group: biases and norms decay too.
    optimizer["weight_decay_all_params"] = True
    schedule = map_scheduler(section.get("scheduler"), optimizer["lr"], where)
    megatron["scheduler"], optimizer["min_lr"] = schedule.megatron(
        optimizer["lr"], optimizer["weight_decay"]
    )
    megatron["optimizer"] = optimizer
    steps = _run_length(recipe)
    until = schedule.exact_until
    if where == "policy" and until is not None and (steps is None or steps > until):
        out.warnings.append(
            f"warning: {where}.scheduler: torch's CosineAnnealingLR climbs again after T_max; "
            f"megatron-core holds eta_min after step {until}, where this run may go on (set "
            "the algorithm's max_num_steps to end there to match)"
        )


def to_megatron(recipe: dict[str, Any]) -> Mapped:
    """``recipe`` (as loaded: its switches as the user wrote them) with each policy/teacher
    section that selects DTensor given the megatron_cfg that trains it the same way (a copy;
    the recipe is not changed). A section whose optimizer
    or schedule cannot be mapped keeps the mapped layout with a stand-in optimizer, so the other
    checks still run on what the recipe means; the refusal is an error, so nothing trains."""
    out = Mapped(recipe)
    for where in ("policy", "teacher"):
        section = recipe.get(where)
        if not isinstance(section, Mapping):
            continue
        megatron, dtensor = section.get("megatron_cfg"), section.get("dtensor_cfg")
        if (
            isinstance(megatron, Mapping)
            and megatron.get("enabled") is True
            and isinstance(dtensor, Mapping)
            and dtensor.get("enabled") is True
        ):
            out.errors.append(
                f"{where}.dtensor_cfg.enabled: true with {where}.megatron_cfg.enabled true "
                "selects both of NeMo-RL's backends (NeMo-RL refuses this too); set one to false"
            )
        if not selects_dtensor(section):
            continue
        if out.recipe is recipe:
            out.recipe = copy.deepcopy(recipe)
        out.recipe[where]["megatron_cfg"] = _section(out.recipe, where, out)
        out.sections.append(where)
    return out
