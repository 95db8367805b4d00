"""A section written for NeMo-RL's DTensor backend trains on megatron-core with the same meaning:
each DTensor setting lands on the megatron-core setting that means the same, what cannot is
refused in one line, and the schedule gives torch's lr at every step."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl_offload.config import dtensor_recipes, ignored_keys
from nemo_rl_offload.config.dtensor_recipes import (
    map_optimizer,
    map_scheduler,
    selects_dtensor,
    to_megatron,
)
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.policy.policy_worker import build_param_scheduler

EXEMPLARS = Path(__file__).resolve().parents[1] / "reference_configs" / "nemo_rl"
TINY_SFT = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny" / "sft.yaml"


def _section(**overrides: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "model_name": "tiny-dense",
        "precision": "bfloat16",
        "max_grad_norm": 1.0,
        "megatron_cfg": {
            "enabled": False,
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 4,
            "context_parallel_size": 2,
            "optimizer": {"optimizer": "sgd", "lr": 1.0},
            "fine_grained_activation_offloading": True,
            "offload_modules": ["core_attn"],
        },
        "dtensor_cfg": {
            "enabled": True,
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
            "sequence_parallel": True,
            "activation_checkpointing": True,
            "env_vars": {"A": "1"},
        },
        "optimizer": {
            "name": "torch.optim.AdamW",
            "kwargs": {"lr": 5e-6, "weight_decay": 0.1, "betas": [0.9, 0.98], "eps": 1e-5},
        },
        "scheduler": None,
    }
    section.update(overrides)
    return section


# ------------------------------------------------------------------------------------ layout


def test_the_layout_comes_from_dtensor_cfg_not_the_inactive_megatron_cfg():
    recipe = {"policy": _section()}
    mapped = to_megatron(recipe)
    assert mapped.errors == []
    megatron = mapped.recipe["policy"]["megatron_cfg"]
    assert megatron["enabled"] is True
    assert megatron["tensor_model_parallel_size"] == 1
    assert megatron["pipeline_model_parallel_size"] == 1
    assert megatron["context_parallel_size"] == 1
    assert megatron["expert_model_parallel_size"] == 1
    assert megatron["sequence_parallel"] is False  # one tensor-parallel rank: a no-op
    assert megatron["activation_checkpointing"] is True
    assert megatron["env_vars"] == {"A": "1"}
    # This backend's own speed knobs stay; NeMo-RL's inactive Megatron settings do not.
    assert megatron["fine_grained_activation_offloading"] is True
    assert megatron["optimizer"]["optimizer"] == "adam"
    assert recipe["policy"]["megatron_cfg"]["enabled"] is False  # the input is not changed
    (line,) = [w for w in mapped.warnings if "dtensor_cfg" in w]
    assert line.startswith("warning: policy.dtensor_cfg: NeMo-RL's DTensor settings run on")


def test_tensor_parallel_size_maps_both_ways():
    for tp in (1, 4):
        section = _section()
        section["dtensor_cfg"]["tensor_parallel_size"] = tp
        megatron = to_megatron({"policy": section}).recipe["policy"]["megatron_cfg"]
        assert megatron["tensor_model_parallel_size"] == tp


def test_sequence_parallel_maps_with_tensor_parallelism_and_is_a_no_op_without():
    for tp, sp, expected in ((2, True, True), (2, False, False), (1, True, False)):
        section = _section()
        section["dtensor_cfg"].update(tensor_parallel_size=tp, sequence_parallel=sp)
        megatron = to_megatron({"policy": section}).recipe["policy"]["megatron_cfg"]
        assert megatron["sequence_parallel"] is expected


def test_activation_checkpointing_off_stays_off_and_on_is_full_recompute():
    from nemo_rl_offload.config.megatron_settings import effective_settings

    for on in (False, True):
        section = _section()
        section["dtensor_cfg"]["activation_checkpointing"] = on
        mapped = to_megatron({"policy": section}).recipe["policy"]
        effective = effective_settings(mapped, None, te_installed=False)
        assert effective.value("recompute_granularity") == ("full" if on else None)
        assert effective.value("recompute_method") == ("uniform" if on else None)


def test_context_parallelism_maps_onto_megatrons():
    section = _section()
    section["dtensor_cfg"]["context_parallel_size"] = 2
    mapped = to_megatron({"policy": section})
    assert mapped.errors == []
    assert mapped.recipe["policy"]["megatron_cfg"]["context_parallel_size"] == 2


def test_a_megatron_section_is_left_alone():
    megatron_recipe = {"policy": _section()}
    megatron_recipe["policy"]["megatron_cfg"]["enabled"] = True
    megatron_recipe["policy"]["dtensor_cfg"]["enabled"] = False
    mapped = to_megatron(megatron_recipe)
    assert mapped.recipe is megatron_recipe and mapped.errors == mapped.warnings == []


def test_both_backends_on_is_refused_as_nemo_rl_refuses_it():
    section = _section()
    section["megatron_cfg"]["enabled"] = True
    mapped = to_megatron({"policy": section})
    assert len(mapped.errors) == 1
    assert mapped.errors[0].startswith("policy.dtensor_cfg.enabled: true with policy.megatron_cfg")


def test_selects_dtensor_needs_megatron_off_and_dtensor_on():
    assert selects_dtensor(_section())
    assert not selects_dtensor({**_section(), "dtensor_cfg": {"enabled": False}})
    assert not selects_dtensor({"megatron_cfg": {"enabled": False}})


# --------------------------------------------------------------------------------- optimizer


def test_adamw_kwargs_map_onto_megatron_adam():
    optimizer = {
        "name": "torch.optim.AdamW",
        "kwargs": {
            "lr": 5e-6,
            "weight_decay": 0.1,
            "betas": [0.9, 0.98],
            "eps": 1e-5,
            "foreach": False,
            "fused": False,
        },
    }
    assert map_optimizer(optimizer, "policy") == {
        "optimizer": "adam",
        "lr": 5e-6,
        "min_lr": 5e-6,
        "weight_decay": 0.1,
        "adam_beta1": 0.9,
        "adam_beta2": 0.98,
        "adam_eps": 1e-5,
    }


def test_absent_kwargs_take_torchs_defaults():
    defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    mapped = map_optimizer({"name": "torch.optim.AdamW", "kwargs": {}}, "policy")
    assert mapped["lr"] == defaults["lr"]
    assert mapped["weight_decay"] == defaults["weight_decay"]
    assert (mapped["adam_beta1"], mapped["adam_beta2"]) == defaults["betas"]
    assert mapped["adam_eps"] == defaults["eps"]
    adam = map_optimizer({"name": "torch.optim.Adam", "kwargs": {"lr": 1e-4}}, "policy")
    assert adam["weight_decay"] == 0.0


def test_megatron_adam_decays_weights_as_adamw_does():
    """What the mapping of AdamW onto megatron-core's "adam" rests on: the optimizer class it
    builds with weight decay takes decoupled steps, like torch's AdamW."""
    from megatron.core import optimizer as megatron_optimizer

    adam = megatron_optimizer.Adam
    assert adam is torch.optim.AdamW or getattr(adam, "__name__", "") == "FusedAdam"


@pytest.mark.parametrize(
    ("optimizer", "start"),
    [
        ({"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}}, "policy.optimizer.name: "),
        (
            {"name": "torch.optim.Adam", "kwargs": {"lr": 0.1, "weight_decay": 0.01}},
            "policy.optimizer.kwargs.weight_decay: ",
        ),
        (
            {"name": "torch.optim.AdamW", "kwargs": {"amsgrad": True}},
            "policy.optimizer.kwargs.amsgrad: ",
        ),
        (
            {"name": "torch.optim.AdamW", "kwargs": {"momentum": 0.9}},
            "policy.optimizer.kwargs.momentum: ",
        ),
        (None, "policy.optimizer: missing"),
    ],
)
def test_an_optimizer_without_a_faithful_mapping_is_refused_in_one_line(optimizer, start):
    mapped = to_megatron({"policy": _section(optimizer=optimizer)})
    assert len(mapped.errors) == 1 and mapped.errors[0].startswith(start), mapped.errors
    assert "; " in mapped.errors[0]


def test_every_parameter_decays_as_under_torchs_adamw():
    """NeMo-RL's DTensor worker gives torch's AdamW all parameters in one group, so biases and
    norms decay too; megatron-core's standard groups exempt them, so the mapping opts out."""
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    from nemo_rl_offload.policy.policy_worker import weight_decay_overrides

    optimizer = to_megatron({"policy": _section()}).recipe["policy"]["megatron_cfg"]["optimizer"]
    assert optimizer["weight_decay_all_params"] is True
    assert weight_decay_overrides(optimizer) == {}
    assert weight_decay_overrides({"optimizer": "adam", "lr": 1.0}) is None
    standard = get_standard_config_overrides(OptimizerConfig(lr=1.0))
    assert [override.get("wd_mult") for override in standard.values()] == [0.0]


def test_max_grad_norm_is_clip_grad_and_null_does_not_clip():
    for norm, clip in ((1.0, 1.0), (0.5, 0.5), (None, 0.0)):
        mapped = to_megatron({"policy": _section(max_grad_norm=norm)}).recipe
        assert mapped["policy"]["megatron_cfg"]["optimizer"]["clip_grad"] == clip


def test_precision_sets_the_optimizers_compute_type_with_float32_main_weights():
    for precision, bf16 in (("bfloat16", True), ("float32", False)):
        optimizer = to_megatron({"policy": _section(precision=precision)}).recipe["policy"][
            "megatron_cfg"
        ]["optimizer"]
        assert optimizer["bf16"] is bf16 and optimizer["params_dtype"] == "float32"


# --------------------------------------------------------------------------------- scheduler


def _torch_lrs(scheduler_cfg: Any, lr: float, steps: int) -> list[float]:
    """The lr per step of NeMo-RL's DTensor worker (nemo_rl/models/automodel/setup.py)."""
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.AdamW([param], lr=lr)
    if scheduler_cfg is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda epoch: 1)
    elif isinstance(scheduler_cfg, dict):
        cls = getattr(torch.optim.lr_scheduler, scheduler_cfg["name"].rpartition(".")[2])
        scheduler = cls(optimizer, **scheduler_cfg["kwargs"])
    else:
        schedulers, milestones = [], []
        for entry in scheduler_cfg:
            if "name" in entry:
                cls = getattr(torch.optim.lr_scheduler, entry["name"].rpartition(".")[2])
                schedulers.append(cls(optimizer, **entry["kwargs"]))
            else:
                milestones = entry["milestones"]
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _megatron_lrs(section: dict[str, Any], steps: int) -> list[float]:
    """The lr per step of this backend's worker for the mapped section."""
    megatron_cfg = to_megatron({"policy": section}).recipe["policy"]["megatron_cfg"]
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.AdamW([param], lr=megatron_cfg["optimizer"]["lr"])
    scheduler = build_param_scheduler(
        optimizer, megatron_cfg["optimizer"], megatron_cfg.get("scheduler") or {}
    )
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return out


@pytest.mark.parametrize(
    "name",
    ["sft.yaml", "dpo.yaml", "grpo_math_1B.yaml", "grpo_math_8B.yaml", "distillation_math.yaml"],
)
def test_each_exemplars_schedule_gives_torchs_lr_at_every_step(name):
    policy = load_recipe(EXEMPLARS / name)["policy"]
    lr = policy["optimizer"]["kwargs"]["lr"]
    steps = 120
    expected = _torch_lrs(policy.get("scheduler"), lr, steps)
    got = _megatron_lrs(policy, steps)
    assert got == pytest.approx(expected, rel=1e-12, abs=0.0)


LINEAR = "torch.optim.lr_scheduler.LinearLR"
CONSTANT = "torch.optim.lr_scheduler.ConstantLR"
COSINE = "torch.optim.lr_scheduler.CosineAnnealingLR"


@pytest.mark.parametrize(
    "scheduler",
    [
        None,
        {"name": LINEAR, "kwargs": {"start_factor": 0.25, "end_factor": 1.0, "total_iters": 7}},
        {"name": CONSTANT, "kwargs": {"factor": 1.0, "total_iters": 3}},
        {"name": LINEAR, "kwargs": {"start_factor": 1.0, "end_factor": 0.1, "total_iters": 30}},
        {"name": COSINE, "kwargs": {"T_max": 40, "eta_min": 1e-7}},
        [
            {"name": LINEAR, "kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 5}},
            {"name": LINEAR, "kwargs": {"start_factor": 1.0, "end_factor": 0.0, "total_iters": 20}},
            {"milestones": [5]},
        ],
        [
            {"name": LINEAR, "kwargs": {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 5}},
            {"name": COSINE, "kwargs": {"T_max": 25, "eta_min": 1e-6}},
            {"milestones": [5]},
        ],
        [
            {"name": LINEAR, "kwargs": {"start_factor": 0.5, "end_factor": 1.0, "total_iters": 5}},
            {"name": CONSTANT, "kwargs": {"factor": 1.0, "total_iters": 10}},
            {"milestones": [9]},
        ],
    ],
    ids=[
        "none",
        "warmup",
        "constant",
        "linear",
        "cosine",
        "warmup-linear",
        "warmup-cosine",
        "late",
    ],
)
def test_each_expressible_schedule_gives_torchs_lr_up_to_its_end(scheduler):
    lr = 1e-4
    steps = 31  # within every cosine's T_max, where torch's cosine does not climb again
    expected = _torch_lrs(scheduler, lr, steps)
    got = _megatron_lrs(
        _section(
            optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": lr}}, scheduler=scheduler
        ),
        steps,
    )
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-18)


@pytest.mark.parametrize(
    ("scheduler", "start"),
    [
        (
            [{"name": "torch.optim.lr_scheduler.ExponentialLR", "kwargs": {"gamma": 0.9}}],
            "policy.scheduler.0.name: ",
        ),
        (
            [
                {"name": LINEAR, "kwargs": {"start_factor": 0.1, "total_iters": 10}},
                {"name": CONSTANT, "kwargs": {"factor": 1.0}},
            ],
            "policy.scheduler: 2 schedulers need 1 milestones",
        ),
        (
            [
                {"name": LINEAR, "kwargs": {"start_factor": 0.1, "total_iters": 10}},
                {"name": CONSTANT, "kwargs": {"factor": 1.0}},
                {"milestones": [4]},
            ],
            "policy.scheduler: milestone 4 cuts the warm-up",
        ),
        (
            [
                {"name": LINEAR, "kwargs": {"start_factor": 0.1, "total_iters": 10}},
                {"name": COSINE, "kwargs": {"T_max": 10}},
                {"milestones": [12]},
            ],
            "policy.scheduler: the decay starts at milestone 12",
        ),
        (
            {"name": CONSTANT, "kwargs": {"factor": 0.5, "total_iters": 4}},
            "policy.scheduler.kwargs.factor: ",
        ),
        (
            {"name": LINEAR, "kwargs": {"start_factor": 0.5, "end_factor": 0.1}},
            "policy.scheduler.kwargs.start_factor: ",
        ),
    ],
)
def test_a_schedule_megatron_cannot_follow_is_refused_in_one_line(scheduler, start):
    mapped = to_megatron({"policy": _section(scheduler=scheduler)})
    assert len(mapped.errors) == 1 and mapped.errors[0].startswith(start), mapped.errors


def test_a_cosine_the_run_outlasts_is_warned_about():
    cosine = {"name": COSINE, "kwargs": {"T_max": 10}}
    short = to_megatron({"sft": {"max_num_steps": 10}, "policy": _section(scheduler=cosine)})
    long = to_megatron({"sft": {"max_num_steps": 11}, "policy": _section(scheduler=cosine)})
    assert not [w for w in short.warnings if w.startswith("warning: policy.scheduler")]
    assert [w for w in long.warnings if w.startswith("warning: policy.scheduler")]


def test_the_schedule_record_is_what_the_worker_reads():
    schedule = map_scheduler(
        [
            {"name": LINEAR, "kwargs": {"start_factor": 0.1, "total_iters": 50}},
            {"name": CONSTANT, "kwargs": {"factor": 1.0, "total_iters": 10**10}},
            {"milestones": [50]},
        ],
        5e-6,
        "policy",
    )
    scheduler, min_lr = schedule.megatron(5e-6, 0.01)
    assert scheduler["lr_warmup_iters"] == 50
    assert scheduler["lr_warmup_init"] == pytest.approx(5e-7)
    assert scheduler["lr_decay_style"] == "constant" and min_lr == 5e-6


# ---------------------------------------------------------------------- the other dtensor keys


def test_lora_is_refused_only_when_the_section_selects_dtensor():
    on = {"policy": _section()}
    on["policy"]["dtensor_cfg"]["lora_cfg"] = {"enabled": True, "dim": 8}
    errors, _ = ignored_keys.check(to_megatron(on).recipe)
    assert [e for e in errors if e.startswith("policy.dtensor_cfg.lora_cfg: ")]
    off = copy.deepcopy(on)
    off["policy"]["dtensor_cfg"]["enabled"] = False
    off["policy"]["megatron_cfg"]["enabled"] = True
    off["policy"]["max_grad_norm"] = None
    assert ignored_keys.check(off) == ([], [])


def test_cpu_offload_warns_that_parameters_stay_on_the_gpu():
    recipe = {"policy": _section()}
    recipe["policy"]["dtensor_cfg"]["cpu_offload"] = True
    errors, warnings = ignored_keys.check(to_megatron(recipe).recipe)
    assert errors == []
    (line,) = [w for w in warnings if "cpu_offload" in w]
    assert "stay on the GPU" in line


def test_kept_megatron_keys_are_this_backends_own_speed_knobs():
    from typing import get_type_hints

    from nemo_rl_offload.config.schema import MegatronConfig

    assert set(dtensor_recipes.KEPT_MEGATRON_KEYS) <= set(get_type_hints(MegatronConfig))


# ------------------------------------------------------------------ a tiny recipe, DTensor-style

DTENSOR_TINY_SFT = [
    "policy.megatron_cfg.enabled=false",
    "+policy.dtensor_cfg={enabled: true, tensor_parallel_size: 1, context_parallel_size: 1, "
    "sequence_parallel: false, activation_checkpointing: false, cpu_offload: false}",
    "+policy.optimizer={name: torch.optim.AdamW, kwargs: {lr: 3.0e-3, weight_decay: 0.0, "
    "betas: [0.9, 0.999], eps: 1.0e-8, foreach: false, fused: false}}",
    "+policy.scheduler=[{name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.1, "
    "end_factor: 1.0, total_iters: 1}}, {name: torch.optim.lr_scheduler.ConstantLR, kwargs: "
    "{factor: 1.0, total_iters: 10}}, {milestones: [1]}]",
]


def test_the_tiny_sft_recipe_written_dtensor_style_validates(tmp_path, monkeypatch):
    from nemo_rl_offload.preflight import load_and_check

    monkeypatch.chdir(tmp_path)
    report = load_and_check(TINY_SFT, DTENSOR_TINY_SFT, megatron_crosscheck=False)
    assert report.ok, report.errors
    optimizer = report.recipe["policy"]["megatron_cfg"]["optimizer"]
    assert optimizer["lr"] == 3e-3 and optimizer["weight_decay"] == 0.0
    assert report.recipe["policy"]["megatron_cfg"]["scheduler"]["lr_warmup_iters"] == 1


def test_the_grouped_expert_gemm_choice_stays_and_other_model_overrides_do_not():
    section = _section()
    section["megatron_cfg"]["model_overrides"] = {"moe_grouped_gemm": True, "num_layers": 99}
    megatron = to_megatron({"policy": section}).recipe["policy"]["megatron_cfg"]
    assert megatron["model_overrides"] == {"moe_grouped_gemm": True}


def test_the_planners_full_recompute_plan_sets_dtensor_cfgs_switch():
    from nemo_rl_offload.planning.planner import Candidate, render_overrides, retarget

    patch = Candidate((), 1.0, None, full_recompute=True).patch()
    assert retarget(patch, False) == patch
    assert retarget(patch, True) == {
        "policy": {
            "megatron_cfg": {"fine_grained_activation_offloading": False},
            "dtensor_cfg": {"activation_checkpointing": True},
        }
    }
    loaded = load_recipe(TINY_SFT, DTENSOR_TINY_SFT)
    lines = render_overrides(retarget(patch, True), loaded)
    recipe = load_recipe(TINY_SFT, [*DTENSOR_TINY_SFT, *lines])
    megatron = to_megatron(recipe).recipe["policy"]["megatron_cfg"]
    assert megatron["activation_checkpointing"] is True
    assert megatron["fine_grained_activation_offloading"] is False
