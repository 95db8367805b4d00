"""Everything checked before a job starts: load, schema, offload rules, Megatron's own checks.

``nemo-rl-offload validate`` prints this report; the training commands run the same checks and
refuse to start on any error, so a mistake costs seconds, not a Ray cluster start-up.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_rl_offload.config import (
    checkpointing,
    dtensor_recipes,
    fp8,
    grpo_options,
    http_server,
    ignored_keys,
    megatron_settings,
    nemo_gym,
    on_policy_distillation,
    peft,
    policy_settings,
    quantization,
    router_replay,
    run_settings,
)
from nemo_rl_offload.config.batching_settings import BatchingSettings
from nemo_rl_offload.config.cluster_settings import ClusterSettings, cluster_settings
from nemo_rl_offload.config.data_settings import check_data_section, data_settings
from nemo_rl_offload.config.environment import Capabilities
from nemo_rl_offload.config.loader import load_recipe, unset_environment
from nemo_rl_offload.config.megatron_rules import MEGATRON_RULES
from nemo_rl_offload.config.model_presets import (
    Architecture,
    ModelNotOnMachine,
    architecture_for,
    section_architecture,
)
from nemo_rl_offload.config.policy_settings import PolicySettings
from nemo_rl_offload.config.rule_context import Findings, RuleContext
from nemo_rl_offload.config.run_settings import RunSettings
from nemo_rl_offload.config.schema import grpo_loss_problems
from nemo_rl_offload.config.tokenizer_settings import tokenizer_settings
from nemo_rl_offload.config.validate import detect_algorithm, schema_problems
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models.transformer_config import build_transformer_config
from nemo_rl_offload.offload import capabilities
from nemo_rl_offload.offload.rules import OFFLOAD_RULES

POLICY_SECTIONS = ("policy", "teacher")
_LOG = logging.getLogger("nemo_rl_offload.preflight")


@dataclass
class SectionSettings:
    """The resolved offload settings of one policy section, for printing."""

    where: str
    transformer_impl: str
    # name -> (value, where it came from: a recipe path or "megatron-core default")
    offload: dict[str, tuple[Any, str]]


@dataclass
class Report:
    algorithm: str | None
    recipe: dict[str, Any]
    caps: Capabilities
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    worker_env: dict[str, str] = field(default_factory=dict)
    sections: list[SectionSettings] = field(default_factory=list)
    # Sections written for NeMo-RL's DTensor backend, whose megatron_cfg here is the mapped one.
    dtensor_sections: list[str] = field(default_factory=list)
    # Each policy section resolved once (a recipe without errors only): what the workers, the
    # planner and the estimates read.
    policies: dict[str, PolicySettings] = field(default_factory=dict)
    # The run's schedule, checkpointing and logger, resolved once (a recipe without errors).
    run: RunSettings | None = None
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    @property
    def ok(self) -> bool:
        return not self.errors

    def worker_environment(self, where: str = "policy") -> dict[str, str]:
        """Environment variables for the workers of one policy section: the recipe's
        ``megatron_cfg.env_vars`` plus what the offload rules require (e.g. NVTE_CPU_OFFLOAD_V1
        for Transformer Engine >= 2.10), which is logged so users see it was set for them."""
        section = self.recipe.get(where) or {}
        env = dict((section.get("megatron_cfg") or {}).get("env_vars") or {})
        for key, value in self.worker_env.items():
            if env.get(key) != value:
                _LOG.info("%s workers: setting %s=%s (required for offloading)", where, key, value)
            env[key] = value
        return env


def _architecture(
    section: dict[str, Any], where: str, base_dir: Path | None, report: Report, starting: bool
) -> Architecture | None:
    """The model's architecture, or None when it is unknown (its problem is reported). A
    Hugging Face model that is not on this machine is a warning for ``validate`` (the checks
    that need the model are skipped, everything else is checked) and an error for a run.
    ``hf_config_overrides`` apply here, so every check sees the model that will be built."""
    model_name = section.get("model_name")
    if not isinstance(model_name, str):
        return None  # the schema reports it
    try:
        architecture = section_architecture(section, where=where, base_dir=base_dir)
    except ModelNotOnMachine as exc:
        _not_on_machine(exc, report, starting, "; the checks that need the model were skipped")
        return None
    except UserInputError as exc:
        report.errors += exc.problems
        return None
    report.warnings += [
        f"warning: {where}.hf_config_overrides.{key}: not read by this backend's Hugging Face "
        "to Megatron mapping, so it changes nothing here (export-hf still writes it to "
        "config.json)"
        for key in architecture.unread_overrides
    ]
    return architecture


def _resolved_offload(effective: megatron_settings.EffectiveSettings) -> dict[str, tuple[Any, str]]:
    defaults = capabilities.transformer_config_defaults()
    resolved: dict[str, tuple[Any, str]] = {}
    moe_keys = megatron_settings.MOE_DISPATCH_KEYS if effective.is_moe else ()
    for name in (*megatron_settings.FGO_KEYS, *megatron_settings.CUDA_GRAPH_KEYS, *moe_keys):
        setting = effective.settings.get(name)
        if setting is not None:
            resolved[name] = (setting.value, setting.source)
        elif name in defaults:
            resolved[name] = (defaults[name], "megatron-core default")
    return resolved


def _runtime_settings(
    section: dict[str, Any], where: str, effective: megatron_settings.EffectiveSettings
) -> dict[str, tuple[Any, str]]:
    """The offload runtime's own settings, resolved: the length buckets steps are padded to
    (with offloading or full-iteration CUDA graphs on), the host budget (offloading on), and
    which groups a fraction below 1 offloads."""
    from nemo_rl_offload.config.batching_settings import step_buckets
    from nemo_rl_offload.offload.runtime import pads_steps

    megatron = section.get("megatron_cfg") or {}
    offloading = effective.value("fine_grained_activation_offloading") is True
    graphed = effective.value("cuda_graph_impl") == "full_iteration"
    path = f"{where}.megatron_cfg"
    resolved: dict[str, tuple[Any, str]] = {}
    if megatron.get("offload_plan_budget_gib") is not None:
        resolved["offload_plan_budget_gib"] = (
            megatron["offload_plan_budget_gib"],
            f"{path}.offload_plan_budget_gib (planned at start; replaces the settings above)",
        )
    if not pads_steps(offloading, graphed):
        return resolved
    if isinstance(section.get("max_total_sequence_length"), int):
        buckets, default = step_buckets(section)
        packed = BatchingSettings.mode_of(section) == "packing"
        resolved["offload_sequence_length_buckets"] = (
            buckets,
            f"{where}.sequence_packing.train_mb_tokens (every pack has this length)"
            if packed
            else "default (up to max_total_sequence_length)"
            if default
            else f"{path}.offload_sequence_length_buckets",
        )
    if not offloading:
        return resolved
    budget = megatron.get("offload_host_memory_budget_gib")
    resolved["offload_host_memory_budget_gib"] = (
        (budget, f"{path}.offload_host_memory_budget_gib")
        if budget
        else ("half of each worker host's RAM / its GPUs", "default")
    )
    fraction = effective.value("activation_offload_fraction")
    if isinstance(fraction, int | float) and fraction < 1:
        placement = megatron_settings.runtime_choices(
            effective, megatron, graphed=graphed
        ).fraction_placement
        resolved["activation_offload_fraction_placement"] = (
            (placement, f"{path}.activation_offload_fraction_placement")
            if megatron.get("activation_offload_fraction_placement")
            else (
                placement,
                "default (each module's fraction, evenly over the layers)",
            )
        )
    return resolved


def _megatron_crosscheck(
    effective: megatron_settings.EffectiveSettings, where: str, report: Report
) -> None:
    """Build the real TransformerConfig: anything Megatron still rejects is reported too."""
    if capabilities.transformer_config_fields() is None:
        return
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build_transformer_config(effective)
    except Exception as exc:  # Megatron signals bad settings with AssertionError/ValueError/...
        message = " ".join(str(exc).split()) or type(exc).__name__
        report.errors.append(
            f"{where}.megatron_cfg: megatron-core {report.caps.megatron_version} rejects these "
            f"settings: {message}"
        )
        return
    for warning in caught:
        line = f"warning: {where}.megatron_cfg: megatron-core says: " + " ".join(
            str(warning.message).split()
        )
        if line not in report.warnings:
            report.warnings.append(line)


def _check_checkpointing(recipe: dict[str, Any], algorithm: str, report: Report) -> None:
    """checkpointing.metric_name names a metric the algorithm logs; with keep_top_k on a
    validation metric, checkpoints saved between validations would rank last (they record no
    validation value), which a user is told."""
    ckpt = recipe.get("checkpointing")
    section = recipe.get(algorithm)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("metric_name"), str):
        return
    try:
        metric = checkpointing.resolve_metric(ckpt["metric_name"], algorithm)
    except ValueError as exc:
        report.errors.append(f"checkpointing.metric_name: {exc}")
        return
    save_period = ckpt.get("save_period")
    val_period = section.get("val_period") if isinstance(section, dict) else None
    if (
        metric.phase == "val"
        and ckpt.get("keep_top_k")
        and isinstance(save_period, int)
        and isinstance(val_period, int)
        and save_period > 0
        and (val_period <= 0 or save_period % val_period)
    ):
        report.warnings.append(
            f"warning: checkpointing.save_period: {save_period} is not a multiple of "
            f"{algorithm}.val_period ({val_period}): checkpoints saved without a validation "
            f"record no {metric.name} and keep_top_k ranks them last; make save_period a "
            "multiple of val_period"
        )


def _workers(cluster: Any) -> int | None:
    """How many workers each policy group gets; None when the cluster section is not
    well-typed (the schema reports that)."""
    if not isinstance(cluster, dict):
        return None
    try:
        return cluster_settings(cluster).workers
    except (TypeError, ValueError):
        return None


def _check_tokenizer(recipe: dict[str, Any], report: Report, starting: bool) -> None:
    """The policy's tokenizer name, as the run will load it (data.tokenizer). A Hugging Face
    tokenizer that is not on this machine is a warning for ``validate`` and an error for a
    run, as the model is."""
    from nemo_rl_offload.data.tokenizer import tokenizer_source

    policy = recipe.get("policy")
    tokenizer = policy.get("tokenizer") if isinstance(policy, dict) else None
    if not (isinstance(tokenizer, dict) and isinstance(tokenizer.get("name"), str | None)):
        return  # the schema reports it
    try:
        tokenizer_source(tokenizer.get("name"), policy.get("model_name"))
    except ModelNotOnMachine as exc:
        _not_on_machine(exc, report, starting)
    except UserInputError as exc:
        report.errors += exc.problems
    try:  # chat_template and its kwargs (config/tokenizer_settings.py)
        tokenizer_settings(policy, "policy")
    except UserInputError as exc:
        report.errors += exc.problems


def _check_teachers(
    recipe: dict[str, Any], base_dir: Path | None, report: Report, starting: bool
) -> None:
    """On-policy distillation's rules, and its teachers' models: each must be on the machine
    (as the policy's) and score the policy's vocabulary, since each token's advantage is the
    teacher's log-probability of the policy's sampled token."""
    env = recipe.get("env") if isinstance(recipe.get("env"), dict) else {}
    errors, warnings_ = on_policy_distillation.problems(
        recipe, has_agents=env.get("should_use_nemo_gym") is True
    )
    report.errors += errors
    report.warnings += warnings_
    if errors or not on_policy_distillation.enabled(recipe):
        return
    policy = recipe.get("policy")
    if not isinstance(policy, dict) or not isinstance(policy.get("model_name"), str):
        return
    try:
        student: Architecture | None = section_architecture(policy, base_dir=base_dir)
    except (ModelNotOnMachine, UserInputError):
        student = None  # the policy's own checks report it
    routes = on_policy_distillation.routing(recipe)
    for alias, model in routes.models.items():
        if routes.group_of[alias] != alias:
            continue
        where = f"on_policy_distillation.teacher_model_by_agent_name.{alias}"
        try:
            teacher = architecture_for(model, base_dir=base_dir, where=where)
        except ModelNotOnMachine as exc:
            _not_on_machine(exc, report, starting, "; the teacher's checks were skipped")
            continue
        except UserInputError as exc:
            report.errors += exc.problems
            continue
        if student is not None and teacher.vocab_size != student.vocab_size:
            report.errors.append(
                f"{where}: {model}'s vocabulary ({teacher.vocab_size}) differs from the "
                f"policy's ({student.vocab_size}); a teacher must score the policy's tokens, "
                "so give a model of the same tokenizer"
            )


def _not_on_machine(
    exc: ModelNotOnMachine, report: Report, starting: bool, skipped: str = ""
) -> None:
    """A model or tokenizer the recipe names that is not on this machine: an error for a run,
    a warning (with what was ``skipped``) for ``validate``."""
    if starting:
        report.errors += exc.problems
    else:
        report.warnings += [f"warning: {line}{skipped}" for line in exc.problems]


def _mtp_loss_problems(
    recipe: dict[str, Any], algorithm: str | None, effective: megatron_settings.EffectiveSettings
) -> list[str]:
    """Multi-token prediction beside a loss that is not a per-token mean. Megatron adds the MTP
    losses per token and the step divides every gradient by the algorithm's count (models.
    train_step): pairs for DPO, sequences for GRPO with ``token_level_loss`` false, where the
    MTP losses would weigh a sequence's length times more than NeMo-RL's."""
    if not effective.value("mtp_num_layers"):
        return []
    loss_fn = recipe.get("loss_fn") if isinstance(recipe.get("loss_fn"), dict) else {}
    if algorithm == "dpo":
        counted = "pairs (DPO)"
    elif algorithm == "grpo" and loss_fn.get("token_level_loss") is False:
        counted = "sequences (loss_fn.token_level_loss: false)"
    else:
        return []
    path = effective.source("mtp_num_layers", "policy.megatron_cfg.mtp_num_layers")
    return [
        f"{path}: multi-token prediction is not implemented yet beside a loss averaged over "
        f"{counted}: its losses are per-token means; set {path} to 0"
    ]


def _check_deadline(recipe: dict[str, Any], report: Report) -> None:
    """checkpointing.checkpoint_must_save_by is DD:HH:MM:SS; without checkpointing the run
    stops at the deadline with nothing saved, which a user is told."""
    ckpt = recipe.get("checkpointing")
    deadline = ckpt.get("checkpoint_must_save_by") if isinstance(ckpt, dict) else None
    if not isinstance(deadline, str):
        return  # null, absent, or a wrong type the schema reports
    try:
        checkpointing.parse_deadline(deadline)
    except ValueError as exc:
        report.errors.append(f"checkpointing.checkpoint_must_save_by: {exc}")
        return
    if ckpt.get("enabled") is False:
        report.warnings.append(
            "warning: checkpointing.checkpoint_must_save_by: checkpointing.enabled is false, "
            "so the run stops at the deadline without saving; enable checkpointing"
        )


def _check_logger_and_batches(
    recipe: dict[str, Any], algorithm: str, report: Report, starting: bool
) -> None:
    """Keys that act only in some setups say so where they would not; logprob_batch_size is a
    positive row count, equal to the training micro-batch at TP >= 4."""
    logger = recipe.get("logger") if isinstance(recipe.get("logger"), dict) else {}
    cluster = recipe.get("cluster") if isinstance(recipe.get("cluster"), dict) else {}
    if logger.get("monitor_gpus") is True and cluster.get("gpus_per_node") == 0:
        report.warnings.append(
            "warning: logger.monitor_gpus: has no effect on CPU workers (cluster.gpus_per_node "
            "is 0)"
        )
    shown = logger.get("num_val_samples_to_print")
    if isinstance(shown, int) and shown > 0 and algorithm in ("sft", "dpo"):
        report.warnings.append(
            f"warning: logger.num_val_samples_to_print: has no effect for {algorithm}, whose "
            "validation generates nothing (as in NeMo-RL)"
        )
    for where in POLICY_SECTIONS:
        section = recipe.get(where)
        if not isinstance(section, dict):
            continue
        rows = section.get("logprob_batch_size")
        if isinstance(rows, int) and rows < 1:
            report.errors.append(
                f"{where}.logprob_batch_size: must be at least 1 (got: {rows}); it is the rows "
                "per micro-batch of forward-only passes"
            )
            continue
        megatron = (
            section.get("megatron_cfg") if isinstance(section.get("megatron_cfg"), dict) else {}
        )
        tp = megatron.get("tensor_model_parallel_size", 1)
        micro = section.get("train_micro_batch_size")
        forced = ((recipe.get("loss_fn") or {}).get("force_on_policy_ratio") is True) and (
            algorithm == "grpo"
        )
        differs = isinstance(rows, int) and isinstance(tp, int) and tp >= 4 and rows != micro
        if differs and not forced:
            _tp_batch_variance(where, rows, micro, tp, report, starting)
    policy = recipe.get("policy") if isinstance(recipe.get("policy"), dict) else {}
    if algorithm == "dpo":
        mode = BatchingSettings.mode_of(policy)
        if mode != "rows":
            key = "sequence_packing" if mode == "packing" else "dynamic_batching"
            report.errors.append(
                f"policy.{key}: not supported for DPO (as in NeMo-RL: chosen and rejected "
                f"responses train as pairs of padded rows); set policy.{key}.enabled: false"
            )
    max_input = (recipe.get("data") or {}).get("max_input_seq_length")
    max_total = policy.get("max_total_sequence_length")
    if isinstance(max_input, int) and max_input < 1:
        report.errors.append(
            f"data.max_input_seq_length: must be at least 1 (got: {max_input}); examples at "
            "least that long are cut and do not train"
        )
    elif isinstance(max_input, int) and isinstance(max_total, int) and max_input > max_total:
        report.warnings.append(
            f"warning: data.max_input_seq_length: {max_input} is more than "
            f"policy.max_total_sequence_length {max_total}: an example longer than the latter "
            "is refused at load, not cut"
        )


# NeMo-RL's switch for its TP >= 4 batch-variance check; its GRPO sets it itself under
# loss_fn.force_on_policy_ratio. Read when validate or a run checks the recipe.
TP_ACCURACY_SWITCH = "NRL_IGNORE_TP_ACCURACY_CHECK"


def _tp_batch_variance(
    where: str, rows: int, micro: Any, tp: int, report: Report, starting: bool
) -> None:
    """A forward-only batch that differs from the training micro-batch at TP >= 4: a run
    refuses it as NeMo-RL refuses it, since the old policy's log-probabilities would not be the
    training pass's; NeMo-RL's switch turns that into a warning that still names the risk. The
    switch is the launch environment's, which ``validate`` may not share (a recipe checked on a
    laptop and launched on a cluster), so without it ``validate`` warns and a run refuses, as
    for a recipe's unset environment variables."""
    what = (
        f"{rows} differs from train_micro_batch_size {micro} at tensor parallel size {tp}: at "
        "TP >= 4 results depend on the batch size, so the log-probabilities of the ratio's old "
        "policy would not be the training pass's"
    )
    if os.environ.get(TP_ACCURACY_SWITCH):
        report.warnings.append(
            f"warning: {where}.logprob_batch_size: {what}; accepted because "
            f"{TP_ACCURACY_SWITCH} is set, so importance ratios and their clipping may act on "
            "that difference rather than on the policy's change"
        )
        return
    ways_out = (
        "set them equal, or tensor_model_parallel_size below 4, or "
        f"loss_fn.force_on_policy_ratio: true (ratio 1), or set {TP_ACCURACY_SWITCH}=1 to "
        "accept it"
    )
    if starting:
        report.errors.append(
            f"{where}.logprob_batch_size: {what} (NeMo-RL refuses this too); {ways_out}"
        )
        return
    report.warnings.append(
        f"warning: {where}.logprob_batch_size: {what}; a run refuses it unless "
        f"{TP_ACCURACY_SWITCH} is set where it starts (NeMo-RL refuses it too); {ways_out}"
    )


def _check_data_source(
    recipe: dict[str, Any],
    report: Report,
    starting: bool,
    base_dir: Path | None,
    recipe_path: Path | None,
) -> None:
    """The data section (config/data_settings.py: NeMo-RL's datasets under data.train, or
    this backend's data.dataset_name), then the files it names."""
    lines = check_data_section(
        recipe,
        base_dir=base_dir or Path.cwd(),
        recipe_path=recipe_path,
        algorithm=report.algorithm,
        starting=starting,
    )
    report.errors += [line for line in lines if not line.startswith("warning: ")]
    report.warnings += [line for line in lines if line.startswith("warning: ")]
    from nemo_rl_offload.data.file_checks import problems  # the files named: open, first rows

    errors, warnings = problems(recipe, report.algorithm or "", starting=starting)
    report.errors += errors
    report.warnings += warnings


def _check_unset_environment(recipe: dict[str, Any], report: Report, starting: bool) -> None:
    """A value that reads an environment variable unset here (``${oc.env:NAME}``) is unknown:
    NeMo-RL resolves it when the run starts on its cluster, so ``validate`` warns and skips
    the checks of that value, and a run refuses to start without it."""
    unknown = unset_environment(recipe)
    for path, names in unknown:
        variables = ", ".join(names)
        if starting:
            report.errors.append(
                f"{path}: reads the environment variable {variables}, which is not set; set "
                f"it before the run (or give {path} on the command line)"
            )
        else:
            report.warnings.append(
                f"warning: {path}: reads the environment variable {variables}, which is not "
                "set on this machine, so the checks of its value were skipped; set it before "
                "a run"
            )
    if not starting:
        prefixes = tuple(f"{path}{end}" for path, _ in unknown for end in (":", "."))
        report.errors = [line for line in report.errors if not line.startswith(prefixes)]


def check_policy(
    policy_cfg: dict[str, Any],
    *,
    where: str,
    architecture: Architecture | None,
    caps: Capabilities,
    gpus_per_node: Any = None,
    workers: int | None = None,
    effective: megatron_settings.EffectiveSettings | None = None,
) -> Findings:
    """Every rule of one policy section (``policy`` or ``teacher``) that runs on ``workers``
    workers: Megatron's settings (:mod:`.config.megatron_rules`), then offloading and the
    recompute beside it (:mod:`.offload.rules`). ``effective``: the section's settings when
    the caller resolved them already."""
    megatron_cfg = policy_cfg.get("megatron_cfg")
    if not isinstance(megatron_cfg, dict):
        return Findings()  # the schema reports the missing or malformed section
    if effective is None:
        effective = megatron_settings.effective_settings(
            policy_cfg, architecture, where=where, te_installed=caps.has_transformer_engine
        )
    ctx = RuleContext(
        where,
        megatron_cfg,
        effective,
        architecture,
        caps,
        policy_cfg,
        gpus_per_node,
        workers,
        transformer_fields=capabilities.transformer_config_fields(),
    )
    for rule in (*MEGATRON_RULES, *OFFLOAD_RULES):
        rule(ctx)
    return ctx.findings


def check_recipe(
    recipe: dict[str, Any],
    *,
    caps: Capabilities | None = None,
    base_dir: Path | None = None,
    recipe_path: Path | None = None,
    megatron_crosscheck: bool = True,
    starting: bool = False,
) -> Report:
    """Check a loaded recipe completely; never raises for user mistakes (they are in .errors).

    ``starting``: the check before a run, which also refuses what ``validate`` only warns
    about because it is not on this machine (a Hugging Face model, NeMo-RL's datasets).
    ``recipe_path``: the recipe's file, above which files the recipe names relatively are
    also looked for (``config.quantization.search_dirs``)."""
    caps = caps or capabilities.detect()
    try:
        algorithm: str | None = detect_algorithm(recipe)
    except UserInputError as exc:
        return Report(None, recipe, caps, errors=exc.problems)
    report = Report(algorithm, recipe, caps)
    report.errors += schema_problems(recipe, algorithm)
    # A section written for NeMo-RL's DTensor backend becomes the megatron_cfg that trains it
    # the same way; every check below, and whoever reads report.recipe, sees that one.
    mapped = dtensor_recipes.to_megatron(recipe)
    recipe = report.recipe = mapped.recipe
    report.errors += mapped.errors
    report.warnings += mapped.warnings
    report.dtensor_sections = mapped.sections
    policy = recipe.get("policy")
    megatron_cfg = policy.get("megatron_cfg") if isinstance(policy, dict) else None
    if isinstance(megatron_cfg, dict) and "optimizer" not in megatron_cfg:
        report.errors.append(
            "policy.megatron_cfg.optimizer: required key is missing (the trained policy needs "
            "an optimizer section, e.g. {optimizer: adam, lr: 5.0e-6})"
        )
    _check_checkpointing(recipe, algorithm, report)
    _check_tokenizer(recipe, report, starting)
    _check_deadline(recipe, report)
    _check_logger_and_batches(recipe, algorithm, report, starting)
    _check_data_source(recipe, report, starting, base_dir, recipe_path)
    if algorithm == "grpo" and isinstance(recipe.get("loss_fn"), dict):
        loss_errors, loss_warnings = grpo_loss_problems(recipe["loss_fn"])
        report.errors += loss_errors
        report.warnings += loss_warnings
    if algorithm == "grpo" and isinstance(recipe.get("grpo"), dict):
        report.errors += grpo_options.check(recipe["grpo"])
        report.errors += grpo_options.async_problems(recipe)
        if isinstance(recipe.get("policy"), dict):
            report.warnings += grpo_options.sampling_warnings(recipe["policy"])
        _check_teachers(recipe, base_dir, report, starting)
    unused_errors, unused_warnings = ignored_keys.check(recipe, starting=starting)
    report.errors += unused_errors
    report.warnings += unused_warnings
    gym_errors, gym_warnings = nemo_gym.problems(recipe, algorithm, starting=starting)
    report.errors += gym_errors
    report.warnings += gym_warnings
    cluster = recipe.get("cluster")
    gpus_per_node = cluster.get("gpus_per_node") if isinstance(cluster, dict) else None
    workers = _workers(cluster)
    effective_by_section: dict[str, megatron_settings.EffectiveSettings] = {}
    architectures: dict[str, Architecture] = {}
    for where in POLICY_SECTIONS:
        section = recipe.get(where)
        if not isinstance(section, dict):
            continue
        architecture = _architecture(section, where, base_dir, report, starting)
        effective = megatron_settings.effective_settings(
            section, architecture, where=where, te_installed=caps.has_transformer_engine
        )
        findings = check_policy(
            section,
            where=where,
            architecture=architecture,
            caps=caps,
            gpus_per_node=gpus_per_node,
            workers=workers,
            effective=effective,
        )
        report.errors += findings.errors
        report.warnings += findings.warnings
        report.notes += [note for note in findings.notes if note not in report.notes]
        report.worker_env.update(findings.worker_env)
        fp8_errors, fp8_warnings = fp8.problems(
            section, where, transformer_impl=effective.value("transformer_impl")
        )
        report.errors += fp8_errors
        report.warnings += fp8_warnings
        if where == "policy":  # a teacher's peft and MTP keys are inert or refused elsewhere
            report.errors += _mtp_loss_problems(recipe, algorithm, effective)
            serving_errors, serving_warnings = http_server.problems(section, where, algorithm)
            report.errors += serving_errors
            report.warnings += serving_warnings
            m = f"{where}.megatron_cfg"
            replay_errors, replay_warnings = router_replay.problems(
                section,
                where,
                algorithm,
                has_experts=effective.is_moe,
                routing=(
                    effective.value("moe_router_load_balancing_type"),
                    effective.source("moe_router_load_balancing_type", m),
                ),
                fused_topk=(
                    effective.value("moe_router_fusion"),
                    effective.source("moe_router_fusion", f"{m}.moe_router_fusion"),
                ),
                graphs=(
                    effective.value("cuda_graph_impl"),
                    effective.source("cuda_graph_impl", f"{m}.cuda_graph_impl"),
                ),
            )
            report.errors += replay_errors
            report.warnings += replay_warnings
            from nemo_rl_offload.models.quantization import config_names

            dirs = quantization.search_dirs(base_dir or Path.cwd(), recipe_path)
            quant_errors, quant_warnings = quantization.problems(
                recipe,
                dirs=dirs,
                peft_enabled=peft.lora_settings(section) is not None,
                graphs=effective.value("cuda_graph_impl"),
                config_names=config_names,
            )
            report.errors += quant_errors
            report.warnings += quant_warnings
            quantization.name_file_absolutely(section, dirs)
            report.errors += peft.problems(section, where) + peft.model_problems(
                section,
                where,
                has_experts=effective.is_moe,
                transformer_impl=effective.value("transformer_impl"),
                cuda_graph_impl=effective.value("cuda_graph_impl"),
            )
        if architecture is not None:  # Megatron cannot build a config without the model
            effective_by_section[where] = effective
            architectures[where] = architecture
        report.sections.append(
            SectionSettings(
                where,
                effective.value("transformer_impl"),
                {**_resolved_offload(effective), **_runtime_settings(section, where, effective)},
            )
        )
    _check_unset_environment(recipe, report, starting)
    if megatron_crosscheck and report.ok:
        for where, effective in effective_by_section.items():
            _megatron_crosscheck(effective, where, report)
    if report.ok:
        report.cluster = cluster_settings(cluster)
    if report.ok and algorithm is not None:
        data = None
        try:
            data = data_settings(recipe, base_dir=base_dir or Path.cwd(), recipe_path=recipe_path)
        except UserInputError as exc:  # validate warned (a file not on this machine)
            if starting:
                report.errors += exc.problems
        if report.ok:
            report.run = run_settings.resolve(recipe, algorithm, data)
    if report.ok:
        for where, effective in effective_by_section.items():
            report.policies[where] = policy_settings.resolve(
                recipe[where],
                where=where,
                architecture=architectures[where],
                te_installed=caps.has_transformer_engine,
                pair_rows=algorithm == "dpo",
                effective=effective,
            )
    return report


def resolve_policy(
    section: dict[str, Any],
    *,
    where: str = "policy",
    base_dir: Path | None = None,
    pair_rows: bool = False,
) -> PolicySettings:
    """A section resolved outside a whole recipe's check (benchmarks, tools, tests): its
    model from its ``model_name``, this environment's Transformer Engine."""
    return policy_settings.resolve(
        section,
        where=where,
        architecture=section_architecture(section, where=where, base_dir=base_dir or Path.cwd()),
        te_installed=capabilities.detect().has_transformer_engine,
        pair_rows=pair_rows,
    )


def load_and_check(
    path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = (), **kwargs: Any
) -> Report:
    """Load a recipe with its defaults and overrides, then :func:`check_recipe` it. Loading
    problems (missing file, YAML syntax, bad override) raise UserInputError."""
    recipe = load_recipe(path, overrides)
    return check_recipe(recipe, base_dir=Path.cwd(), recipe_path=Path(path), **kwargs)
