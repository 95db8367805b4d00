"""What every algorithm loop shares: the pre-start check, the cluster, the tokenizer, data
encoding, checkpoints with resume, and the metrics logger.

A run directory layout (``checkpointing.checkpoint_dir``)::

    step_000010/policy/          the workers' sharded checkpoint (megatron dist_checkpointing:
                                 weights, optimizer, scheduler, generators, worker step) and
                                 layout.json, the layout it was saved with (models.checkpoint)
    step_000010/state.json       the driver's state: step, data position

A checkpoint directory is written as ``.tmp_step_N`` and renamed to ``step_N`` only when the
workers' parts and state.json are all written, so a stop mid-save leaves the previous
checkpoint as the latest complete one; resume looks only at ``step_N`` directories with a
state.json, and removes ``.tmp_*`` leftovers. Old checkpoints are renamed away before they are
deleted, for the same reason.

Resume is exact: everything a step's outcome depends on is restored (the workers' full state,
the data order position; GRPO's and distillation's sampling seeds are derived from the step
number, the data order from the seed and the epoch). Records of steps after the checkpoint,
left in the metrics file by the run that stopped, are dropped, since those steps run again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.policy_group import PolicyGroup
from nemo_rl_offload.config import checkpointing
from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.data.datasets import encode_and_check_lengths
from nemo_rl_offload.data.tokenizer import Tokenizer, load_tokenizer
from nemo_rl_offload.distributed import cluster
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.metrics_logger import MetricsLogger
from nemo_rl_offload.preflight import Report, load_and_check

_LOG = logging.getLogger("nemo_rl_offload.run")
STATE_FILE = "state.json"
# Directories being written or deleted: never read as checkpoints, removed at the next start.
TMP_PREFIX = ".tmp_"


def _remove(directory: Path) -> None:
    """Delete a checkpoint directory: renamed out of the ``step_*`` names first, so that a
    stop halfway through never leaves a partly deleted one that looks complete."""
    doomed = directory.with_name(f"{TMP_PREFIX}delete_{directory.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_incomplete(root: str | Path) -> list[Path]:
    """Remove what a stopped run left half-written or half-deleted under ``root``."""
    root = Path(root)
    leftovers = sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)
    return leftovers


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resolve_checkpoint(path: str, where: str) -> Path:
    """A checkpoint step directory, or the latest one under a checkpoint_dir."""
    candidate = Path(path)
    if (candidate / STATE_FILE).is_file():
        return candidate
    found = checkpoint_dirs(candidate)
    if not found:
        raise UserInputError(
            f"{where}: no checkpoint at '{path}' (expected a step_N directory with {STATE_FILE},"
            " or a checkpoint_dir that holds some); run the earlier stage first"
        )
    return found[-1]


def data_where(data_cfg: dict, split: str) -> str:
    """The recipe key to name in a data error: the file's key for jsonl data."""
    return f"data.{split}_data_path" if data_cfg.get("dataset_name") == "jsonl" else "data"


def check_batch_sizes(policy_cfg: dict, dp_size: int) -> None:
    """The global batch must split evenly into data-parallel shards of whole micro-batches."""
    gbs = int(policy_cfg["train_global_batch_size"])
    mbs = int(policy_cfg["train_micro_batch_size"])
    if gbs % (mbs * dp_size):
        raise UserInputError(
            f"policy.train_global_batch_size: {gbs} does not split into {dp_size} data-parallel "
            f"rank(s) x micro-batches of {mbs}; use a multiple of {mbs * dp_size}"
        )


class EpochSampler:
    """Examples in a (seeded) shuffled order, epoch after epoch; its position is checkpointed."""

    def __init__(self, size: int, *, seed: int, shuffle: bool, position: int = 0) -> None:
        if size == 0:
            raise UserInputError("data: the training split is empty; add examples")
        self.size, self.seed, self.shuffle, self.position = size, seed, shuffle, position

    @property
    def epoch(self) -> int:
        return self.position // self.size

    def take(self, count: int) -> list[int]:
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, self.size)
            order = np.arange(self.size)
            if self.shuffle:
                order = np.random.default_rng(self.seed + epoch).permutation(self.size)
            out.append(int(order[index]))
            self.position += 1
        return out


@dataclass
class Run:
    """Everything a loop needs, prepared before any worker starts."""

    algorithm: str
    recipe: dict[str, Any]
    report: Report
    tokenizer: Tokenizer
    logger: MetricsLogger
    cluster_info: cluster.ClusterInfo | None
    start_step: int = 0
    driver_state: dict[str, Any] = field(default_factory=dict)
    resume_from: Path | None = None
    max_steps: int = 0
    last_step: int = 0
    last_position: int = 0
    _saved_step: int = 0
    # What keep_top_k ranks checkpoints by (checkpointing.metric_name), and what the current
    # step has logged of each phase, which its checkpoint records.
    metric: checkpointing.Metric | None = None
    _step_metrics: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def policy_cfg(self) -> dict[str, Any]:
        return self.recipe["policy"]

    @property
    def max_len(self) -> int:
        return int(self.policy_cfg["max_total_sequence_length"])

    @property
    def round_to(self) -> int:
        return int(self.policy_cfg.get("make_sequence_length_divisible_by", 1) or 1)

    def encode(self, examples: list[dict[str, Any]], where: str) -> list[TokenSequence]:
        encoded = encode_and_check_lengths(examples, self.tokenizer, self.max_len, where)
        return [TokenSequence(list(e.input_ids), e.prompt_len) for e in encoded]

    # ------------------------------------------------------------------- checkpoints
    def save(self, policy: Any, step: int, state: dict[str, Any]) -> Path | None:
        """Write ``step_N`` (the workers' state, then the driver's ``state``) atomically."""
        ckpt = self.recipe["checkpointing"]
        if not ckpt.get("enabled", True):
            return None
        root = Path(ckpt["checkpoint_dir"])
        final = root / f"step_{step:06d}"
        tmp = root / f"{TMP_PREFIX}step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        policy.save(str(tmp / "policy"))
        recorded = checkpointing.record(self.metric, self._step_metrics)
        (tmp / STATE_FILE).write_text(
            json.dumps({"step": step, **state, "metrics": recorded}, indent=1)
        )
        if final.exists():  # the same step again (e.g. the last one): replace it
            _remove(final)
        os.replace(tmp, final)
        self._saved_step = step
        self._retain(root)
        return final

    def _retain(self, root: Path) -> None:
        """keep_top_k: delete the checkpoints it does not keep (config.checkpointing says
        which: the best k by metric_name, or the newest k, and always the newest)."""
        ckpt = self.recipe["checkpointing"]
        directories = {int(path.name.split("_")[1]): path for path in checkpoint_dirs(root)}
        history = [
            (step, json.loads((path / STATE_FILE).read_text()).get("metrics") or {})
            for step, path in directories.items()
        ]
        for step in checkpointing.steps_to_delete(
            history,
            keep_top_k=ckpt.get("keep_top_k"),
            metric=self.metric,
            higher_is_better=bool(ckpt.get("higher_is_better", True)),
        ):
            _remove(directories[step])

    def sampler(self, size: int, seed: int) -> EpochSampler:
        """The training-data order, continuing where a resumed run stopped."""
        return EpochSampler(
            size,
            seed=seed,
            shuffle=bool(self.recipe["data"].get("shuffle", True)),
            position=int(self.driver_state.get("position", 0)),
        )

    def steps(self) -> range:
        """The step numbers still to run (1-based; after a resume, from the next one)."""
        return range(self.start_step + 1, self.max_steps + 1)

    def log_train_step(
        self,
        step: int,
        metrics: dict[str, float],
        *,
        elapsed: float,
        tokens: int,
        per_count: dict[str, str] | None = None,
        **values: float,
    ) -> None:
        """Log one training step: the loss and each ``per_count`` sum divided by the step's
        count (tokens, or pairs for DPO), the algorithm's own ``values``, the workers' other
        metrics, and the driver's wall time and throughput (generation included)."""
        count = metrics["num_tokens"]
        record = {"loss": mean(metrics.pop("loss"), count)}
        for name, sum_key in (per_count or {}).items():
            if sum_key in metrics:
                record[name] = mean(metrics.pop(sum_key), count)
        record.update(values)
        record.update({k: v for k, v in metrics.items() if not k.endswith("_sum")})
        record["train_time_s"] = record.pop("step_time_s", elapsed)
        record.update(tokens_per_s=tokens / elapsed, step_time_s=elapsed)
        self.logger.log(step, record)
        self._step_metrics = {"train": record}

    def end_step(
        self,
        step: int,
        policy: Any,
        position: int,
        *,
        val_period: int,
        validate: Callable[[], dict[str, Any]],
    ) -> None:
        """After a training step: validate every ``val_period`` steps, save every
        ``checkpointing.save_period`` steps and at the last step."""
        if val_period and step % val_period == 0:
            self._step_metrics["val"] = validate()
            self.logger.log(step, self._step_metrics["val"], phase="val")
        save_period = int(self.recipe["checkpointing"].get("save_period", 0) or 0)
        if step == self.max_steps or (save_period and step % save_period == 0):
            self.save(policy, step, {"position": position})
        self.last_step, self.last_position = step, position

    def finish(self, policy: Any) -> None:
        """Save the last step when the loop ended early (data epochs used up)."""
        if self.last_step and self.last_step != self._saved_step:
            self.save(policy, self.last_step, {"position": self.last_position})

    def restore(self, policy: Any) -> None:
        """Load the resume checkpoint (full state) or ``policy.init_checkpoint`` (weights).

        On resume, a policy group that holds a reference model first loads the
        init_checkpoint's weights, which the reference keeps (the resume checkpoint holds the
        trained policy, not the reference it is compared with)."""
        init = self.policy_cfg.get("init_checkpoint")
        if self.resume_from is not None:
            policy_dir = self.resume_from / "policy"
            for note in policy.check_resumable(str(policy_dir)):
                print(f"note: {note}", file=sys.stderr)
            if init and policy.holds_reference:
                path = resolve_checkpoint(init, "policy.init_checkpoint")
                policy.load(str(path / "policy"), weights_only=True)
                print(f"reference weights loaded from {path}", file=sys.stderr)
            policy.load(str(policy_dir))
            print(f"resumed from {self.resume_from} (step {self.start_step})", file=sys.stderr)
            return
        if init:
            path = resolve_checkpoint(init, "policy.init_checkpoint")
            policy.load(str(path / "policy"), weights_only=True)
            print(f"policy weights loaded from {path}", file=sys.stderr)

    def connect(self) -> None:
        """Start or join Ray: after the data has loaded, so a bad data file fails in seconds."""
        self.cluster_info = cluster.start_or_join(
            self.recipe["cluster"], num_cpus=max(os.cpu_count() or 1, 4)
        )

    def start_group(
        self,
        where: str,
        *,
        seed: int,
        trainable: bool,
        with_reference: bool = False,
        gpu_fraction: float = 1.0,
    ) -> PolicyGroup:
        """The workers of one policy section (``policy`` or ``teacher``), set up and ready;
        their environment carries what the offload rules require, and their warnings (e.g.
        offloading not applied on CPU) are shown."""
        group = PolicyGroup(
            self.recipe[where],
            where=where,
            cluster_cfg=self.recipe["cluster"],
            seed=seed,
            trainable=trainable,
            with_reference=with_reference,
            env_vars=self.report.worker_environment(where) or None,
            gpu_fraction=gpu_fraction,
        )
        for line in group.warnings:
            print(f"warning: {line}", file=sys.stderr)
        return group

    def close(self) -> None:
        self.logger.close()
        if self.cluster_info is not None:
            cluster.shutdown(self.cluster_info)


def _apply_plan(config_path: str, overrides: list[str], budget_gib: float) -> Any:
    """``policy.megatron_cfg.offload_plan_budget_gib``: plan for the budget (the planner's
    profiling runs first, on the recipe's own workers) and return the recipe checked again
    with the chosen settings as overrides; no plan that fits stops the job with the reason."""
    from nemo_rl_offload import planner

    without_key = [*overrides, "~policy.megatron_cfg.offload_plan_budget_gib"]
    print(f"plan: finding the fastest settings for {budget_gib:g} GiB ...", file=sys.stderr)
    result = planner.plan(config_path, without_key, budgets_gib=[budget_gib])
    planner.format_plan(result, sys.stderr)
    (entry,) = result["plans"]
    chosen = entry["chosen"]
    if chosen is None:
        raise UserInputError(
            "policy.megatron_cfg.offload_plan_budget_gib: "
            + planner.why_none(result["profile"], budget_gib, entry["tried"])
        )
    report = load_and_check(config_path, [*without_key, *planner.plan_overrides(result, chosen)])
    if report.errors:
        raise UserInputError(report.errors)
    print(f"plan applied: {chosen.name}", file=sys.stderr)
    return report


def prepare(config_path: str, overrides: list[str], algorithm: str, *, total_steps_key: str) -> Run:
    """Check the recipe, load the tokenizer, find a checkpoint to resume (Ray starts later,
    in :meth:`Run.connect`)."""
    report = load_and_check(config_path, overrides)
    if report.errors:
        raise UserInputError(report.errors)
    for line in report.warnings:
        print(line, file=sys.stderr)
    if report.algorithm != algorithm:
        command = "distill" if report.algorithm == "distillation" else report.algorithm
        raise UserInputError(
            f"{config_path}: a recipe for {report.algorithm}, not {algorithm}; run "
            f"nemo-rl-offload {command} --config {config_path}"
        )
    budget = (report.recipe["policy"].get("megatron_cfg") or {}).get("offload_plan_budget_gib")
    if budget is not None:
        report = _apply_plan(config_path, overrides, float(budget))
    recipe = report.recipe
    policy = recipe["policy"]
    architecture = architecture_for(policy["model_name"], base_dir=Path.cwd())
    tokenizer_cfg = policy.get("tokenizer") or {}
    tokenizer = load_tokenizer(tokenizer_cfg.get("name"), architecture.hf_directory)
    if tokenizer.vocab_size > architecture.vocab_size:
        raise UserInputError(
            f"policy.tokenizer.name: the tokenizer has {tokenizer.vocab_size} tokens but "
            f"{policy['model_name']} only {architecture.vocab_size}; use the model's tokenizer"
        )
    if architecture.hf_directory and not policy.get("init_checkpoint"):
        from nemo_rl_offload.models.hf_checkpoint import check_hf_directory

        check_hf_directory(architecture)  # a bad directory fails here, not in the workers
    ckpt = recipe["checkpointing"]
    resume_from, start_step, driver_state = None, 0, {}
    existing = []
    if ckpt.get("enabled", True):
        for leftover in remove_incomplete(ckpt["checkpoint_dir"]):
            print(f"removed an incomplete checkpoint: {leftover}", file=sys.stderr)
        existing = checkpoint_dirs(ckpt["checkpoint_dir"])
    if existing:
        resume_from = existing[-1]
        driver_state = json.loads((resume_from / STATE_FILE).read_text())
        start_step = int(driver_state.get("step", 0))
    logger_cfg = recipe["logger"]
    logger = MetricsLogger(
        logger_cfg["log_dir"],
        total_steps=int(recipe[algorithm][total_steps_key]),
        tensorboard=bool(logger_cfg.get("tensorboard_enabled", False)),
        resume_step=start_step if resume_from is not None else None,
    )
    print(
        f"{algorithm}: metrics -> {logger.path}; checkpoints -> {ckpt['checkpoint_dir']}",
        file=sys.stderr,
    )
    metric_name = ckpt.get("metric_name")
    return Run(
        algorithm,
        recipe,
        report,
        tokenizer,
        logger,
        None,
        start_step,
        driver_state,
        resume_from,
        max_steps=int(recipe[algorithm][total_steps_key]),
        metric=checkpointing.resolve_metric(metric_name, algorithm) if metric_name else None,
    )


def mean(total: float, count: float) -> float:
    return total / count if count else float("nan")
