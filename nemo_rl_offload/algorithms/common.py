"""What every algorithm loop shares: the pre-start check, the cluster, the tokenizer, data
encoding, checkpoints with resume, and the metrics logger.

Checkpoints go to the run's directory (:mod:`nemo_rl_offload.policy.checkpoint_dirs`). Resume is
exact: everything a step's outcome depends on is restored (the workers' full state, the data
order position; GRPO's and distillation's sampling seeds are derived from the step number, the
data order from the seed and the epoch). Records of steps after the checkpoint, left in the
metrics file by the run that stopped, are dropped, since those steps run again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_offload.algorithms import batching, packing
from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.config import checkpointing, quantization
from nemo_rl_offload.config.data_settings import DataSettings
from nemo_rl_offload.config.policy_settings import PolicySettings
from nemo_rl_offload.config.run_settings import RunSettings
from nemo_rl_offload.data.datasets import (
    CUT_PART_TOKENS,
    EncodedExample,
    encode_and_check_lengths,
    load_split,
)
from nemo_rl_offload.data.nemo_rl_datasets import load_rows
from nemo_rl_offload.data.processors import process
from nemo_rl_offload.data.tokenizer import Tokenizer
from nemo_rl_offload.distributed import cluster
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.metrics_logger import MetricsLogger
from nemo_rl_offload.policy.checkpoint_dirs import (
    STATE_FILE,
    TMP_PREFIX,
    checkpoint_dirs,
    find_resume,
    read_state,
    remove_dir,
    resolve_checkpoint,
    step_of,
)
from nemo_rl_offload.policy.policy_group import PolicyGroup
from nemo_rl_offload.policy.tokenizer import policy_tokenizer
from nemo_rl_offload.preflight import Report, resolve_policy
from nemo_rl_offload.progress import Progress

_LOG = logging.getLogger("nemo_rl_offload.run")


def data_where(data: DataSettings, split: str) -> str:
    """The recipe key to name in a data error: the file's key for jsonl data."""
    return f"data.{split}_data_path" if data.source == "jsonl" else "data"


def token_sequence(example: EncodedExample) -> TokenSequence:
    """An encoded example as the trainers batch it (its masked turns as spans that never
    train)."""
    return TokenSequence(
        list(example.input_ids),
        example.prompt_len,
        loss_multiplier=example.loss_multiplier,
        env_spans=tuple(example.masked_spans),
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


class Deadline:
    """``checkpointing.checkpoint_must_save_by``: when to save and stop so that a job with a
    wall-time limit (a SLURM allocation, a preemptible node) ends with a checkpoint instead of
    being killed mid-step.

    NeMo-RL's rule: after each step, if the time elapsed plus the expected time of a step (the
    mean of this run's steps so far, each counted from the end of the previous one, so their
    validation and saving are in it) reaches the deadline, save and stop. Elapsed time counts
    from the start of the command (NeMo-RL counts from its training loop's start): Ray's
    start-up and the model's loading take the job's wall time too. ``clock`` is injectable so
    the rule is testable without waiting."""

    def __init__(
        self,
        seconds: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
    ) -> None:
        self.seconds, self.clock = seconds, clock
        self.started = clock() if started is None else started
        self.step_times: list[float] = []
        self._last_mark: float | None = None

    def start_steps(self) -> None:
        """The first step starts now."""
        self._last_mark = self.clock()

    def mark_step(self) -> None:
        """A step (with its validation and saving) ended now."""
        now = self.clock()
        if self._last_mark is not None:
            self.step_times.append(now - self._last_mark)
        self._last_mark = now

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    @property
    def expected_step(self) -> float:
        return sum(self.step_times) / len(self.step_times) if self.step_times else 0.0

    def due(self) -> bool:
        """Whether another step would pass the deadline."""
        return self.seconds is not None and self.elapsed + self.expected_step >= self.seconds


def validation_due(
    step: int, *, val_period: int, val_start_at: int, val_at_end: bool, last: bool
) -> bool:
    """Whether validation runs after training step ``step`` (1-based), NeMo-RL's rule for all
    four algorithms: every ``val_period`` steps from step ``val_start_at`` on (-1, the
    default, and any value up to 1 start at once), and after the last step with
    ``val_at_end``."""
    periodic = val_period > 0 and step >= val_start_at and step % val_period == 0
    return periodic or (val_at_end and last)


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
    last_state: dict[str, Any] = field(default_factory=dict)  # the last step's driver state
    _saved_step: int = 0
    # What keep_top_k ranks checkpoints by (checkpointing.metric_name), and what the current
    # step has logged of each phase, which its checkpoint records.
    metric: checkpointing.Metric | None = None
    _step_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    # checkpointing.checkpoint_must_save_by; ``stopped_at`` is the step the loop stopped after
    # for it (None while the run goes on).
    deadline: Deadline = field(default_factory=lambda: Deadline(None))
    stopped_at: int | None = None
    # logger.monitor_gpus on GPU workers (started in connect).
    gpu_monitor: Any = None
    # The worker groups start_group began, shut down by close in that order.
    groups: list[PolicyGroup] = field(default_factory=list)
    # The policy's HTTP servers (expose_http_server), stopped by close before the workers.
    servers: list[Any] = field(default_factory=list)
    # Where the run is, on stderr (nemo_rl_offload.progress): loop.drive names the step, the
    # algorithms start its phases, a thread repeats a phase's line while the workers run it.
    progress: Progress = field(default_factory=lambda: Progress(heartbeat=True))
    # NeMo-RL's datasets' rows (train, validation), loaded once (:meth:`examples`).
    _rows: tuple[list[Any], list[Any]] | None = None

    @property
    def settings(self) -> RunSettings:
        """The run's schedule, checkpointing and logger as validate resolved them."""
        assert self.report.run is not None, "prepare() takes a checked recipe"
        return self.report.run

    @property
    def policy_settings(self) -> PolicySettings:
        """The policy section as validate resolved it (:mod:`.config.policy_settings`)."""
        return self.report.policies["policy"]

    @property
    def max_len(self) -> int:
        return self.policy_settings.max_total_sequence_length

    @property
    def round_to(self) -> int:
        return self.policy_settings.batching.round_to

    def logprob_rows(self, where: str = "policy") -> int:
        """Rows per micro-batch of the forward-only passes of ``where``'s workers
        (``logprob_batch_size``; :class:`.config.batching_settings.BatchingSettings`)."""
        return self.batching(where).logprob_rows

    def batching(self, where: str = "policy") -> packing.BatchingSettings:
        """How ``where``'s workers group sequences: padded rows, sequence packing or dynamic
        batching, as validate resolved the section."""
        return self.report.policies[where].batching

    def training_batches(self, sequences: list[TokenSequence], dp_size: int) -> packing.Batches:
        """A training step's micro-batches per data-parallel rank, as the policy's batching
        settings group them; ``attach`` puts per-sequence results on them."""
        return packing.training_batches(
            sequences, self.batching(), dp_size, pad_id=self.tokenizer.pad_id
        )

    def forward_only(
        self,
        sequences: list[TokenSequence],
        run_pass: Any,
        *,
        where: str = "policy",
        keep_labels: bool = True,
        rows: int | None = None,
    ) -> list[Any]:
        """Per-sequence results of a forward-only pass of ``where``'s workers over
        micro-batches of :meth:`logprob_rows` rows (``rows`` when given: an on-policy
        distillation teacher's ``micro_batch_size``), or of ``logprob_mb_tokens`` tokens with
        sequence packing or dynamic batching (``batching.forward_only`` says how results map
        back)."""
        settings = self.batching(where)
        if settings.mode == "rows":
            return batching.forward_only(
                sequences,
                self.logprob_rows(where) if rows is None else rows,
                run_pass,
                pad_id=self.tokenizer.pad_id,
                round_to=self.round_to,
                keep_labels=keep_labels,
            )
        batches = packing.forward_batches(sequences, settings, pad_id=self.tokenizer.pad_id)
        mbs = batches.flat
        if not keep_labels:
            for mb in mbs:
                del mb["labels"]
        return batches.per_sequence(run_pass(mbs))

    @property
    def data(self) -> DataSettings:
        """The data section as validate resolved it (:mod:`.config.data_settings`)."""
        assert self.settings.data is not None, "prepare() takes a recipe checked to start"
        return self.settings.data

    def examples(self, kind: str, split: str) -> list[EncodedExample]:
        """One split's examples, tokenized and checked: NeMo-RL's datasets (``data.train``,
        ``data.validation``) through their processors and the policy's chat template, or this
        backend's arithmetic and jsonl data. ``kind``: sft, preference or prompts."""
        if self.data.source != "nemo_rl":
            grader = self.settings.math_env.math_verify_impl
            raw = load_split(self.data, kind, split, grader=grader)  # type: ignore[arg-type]
            return self.encode_examples(raw, split)
        if self._rows is None:
            self._rows = load_rows(self.data)
        rows = self._rows[0 if split == "train" else 1]
        limit = self.data.max_input_seq_length or self.max_len
        flags = self.settings.processor_flags
        encoded = [process(row, self.tokenizer, limit, flags) for row in rows]
        too_long = [
            f"{row.where}: {len(e.input_ids)} tokens, longer than "
            "policy.max_total_sequence_length "
            f"{self.max_len}; shorten it, raise the limit, or set data.max_input_seq_length"
            for row, e in zip(rows, encoded, strict=True)
            if max(len(e.input_ids), len(e.rejected_ids or ())) > self.max_len
        ]
        if too_long:
            shown = too_long[:20] + ([f"{len(too_long) - 20} more"] if len(too_long) > 20 else [])
            raise UserInputError(shown)
        self._report_cut(encoded, split, "data.train" if split == "train" else "data.validation")
        return encoded

    def encode_examples(self, examples: list[dict[str, Any]], split: str) -> list[EncodedExample]:
        """Tokenize one split of this backend's own data: an example longer than
        max_total_sequence_length is refused, one over ``data.max_input_seq_length`` cut and
        kept with loss multiplier 0 (NeMo-RL's rule: it keeps its place, and a prompt its
        samples, but does not train)."""
        where = data_where(self.data, split)
        max_input = self.data.max_input_seq_length
        encoded = encode_and_check_lengths(
            examples, self.tokenizer, self.max_len, where, max_input_len=max_input
        )
        self._report_cut(encoded, split, where)
        return encoded

    def _report_cut(self, encoded: list[EncodedExample], split: str, where: str) -> None:
        """How many examples ``data.max_input_seq_length`` cut is said here (and counted in
        each step's metrics); a training split it cut whole is refused."""
        max_input = self.data.max_input_seq_length
        cut = sum(1 for e in encoded if e.loss_multiplier == 0)
        if cut and split == "train" and cut == len(encoded):
            raise UserInputError(
                f"data.max_input_seq_length: every training example of {where} reaches "
                f"{max_input} tokens, so none would train; raise it"
            )
        if cut:
            print(
                f"data.max_input_seq_length: {cut} of {len(encoded)} {split} examples reach "
                f"{max_input} tokens: cut to {CUT_PART_TOKENS} tokens a part and kept with loss "
                "multiplier 0 (they do not train)",
                file=sys.stderr,
            )

    def encode(self, kind: str, split: str) -> list[TokenSequence]:
        """:meth:`examples` as token sequences."""
        return [token_sequence(e) for e in self.examples(kind, split)]

    def truncated(self, sequences: list[TokenSequence]) -> dict[str, int]:
        """``{name: how many of the step's sequences data.max_input_seq_length cut}``, empty
        when the key is not set: GRPO and distillation count prompts (``prompts_truncated``),
        SFT and DPO examples (``examples_truncated``)."""
        if self.data.max_input_seq_length is None:
            return {}
        name = (
            "prompts_truncated"
            if self.algorithm in ("grpo", "distillation")
            else ("examples_truncated")
        )
        return {name: sum(1 for s in sequences if s.loss_multiplier == 0)}

    # ------------------------------------------------------------------- checkpoints
    def save(self, policy: Any, step: int, state: dict[str, Any]) -> Path | None:
        """Write ``step_N`` (the workers' state, then the driver's ``state``) atomically."""
        ckpt = self.settings.checkpointing
        if not ckpt.enabled:
            return None
        root = Path(ckpt.checkpoint_dir)
        final = root / f"step_{step:06d}"
        tmp = root / f"{TMP_PREFIX}step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with self.progress.phase("checkpoint save"):
            policy.save(str(tmp / "policy"))
        recorded = checkpointing.record(self.metric, self._step_metrics)
        (tmp / STATE_FILE).write_text(
            json.dumps({"step": step, **state, "metrics": recorded}, indent=1)
        )
        if final.exists():  # the same step again (e.g. the last one): replace it
            remove_dir(final)
        os.replace(tmp, final)
        self._saved_step = step
        self._retain(root)
        return final

    def _retain(self, root: Path) -> None:
        """keep_top_k: delete the checkpoints it does not keep (config.checkpointing says
        which: the best k by metric_name, or the newest k, and always the newest)."""
        ckpt = self.settings.checkpointing
        directories = {step_of(path) or 0: path for path in checkpoint_dirs(root)}
        history = [(step, _recorded(path)) for step, path in directories.items()]
        for step in checkpointing.steps_to_delete(
            history,
            keep_top_k=ckpt.keep_top_k,
            metric=self.metric,
            higher_is_better=ckpt.higher_is_better,
        ):
            remove_dir(directories[step])

    def sampler(self, size: int, seed: int) -> EpochSampler:
        """The training-data order, continuing where a resumed run stopped."""
        return EpochSampler(
            size,
            seed=seed,
            shuffle=self.data.shuffle,
            position=int(self.driver_state.get("position", 0)),
        )

    def steps(self) -> Iterator[int]:
        """The step numbers still to run (1-based; after a resume, from the next one); none
        after :meth:`end_step` has stopped the run for ``checkpoint_must_save_by``."""
        self.deadline.start_steps()
        if self.gpu_monitor is not None:
            self.gpu_monitor.take()  # the first step's figures start here
        for step in range(self.start_step + 1, self.max_steps + 1):
            if self.stopped_at is not None:
                return
            yield step

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
        if self.gpu_monitor is not None:
            record.update(self.gpu_monitor.take())
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
        data_done: bool = False,
        stop_when: Callable[[dict[str, Any]], str | None] | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        """After a training step: validate when :func:`validation_due` says so (the recipe's
        ``val_start_at`` and ``val_at_end``; ``data_done``: the data epochs are used up, so
        this is the last step), save every ``checkpointing.save_period`` steps and at the last
        step; and save and stop the run (:meth:`steps` yields no more) when ``stop_when``
        finds the validation metrics good enough (its line is printed), or when another step
        would pass ``checkpointing.checkpoint_must_save_by`` (:class:`Deadline`). ``state``:
        more of the driver's state to checkpoint beside the data position."""
        schedule = self.settings.schedule
        last = step == self.max_steps or data_done
        stop = None
        if validation_due(
            step,
            val_period=val_period,
            val_start_at=schedule.val_start_at,
            val_at_end=schedule.val_at_end,
            last=last,
        ):
            with self.progress.phase("validation"):
                self._step_metrics["val"] = validate()
            self.logger.log(step, self._step_metrics["val"], phase="val")
            stop = stop_when(self._step_metrics["val"]) if stop_when is not None else None
        save_period = self.settings.checkpointing.save_period
        self.last_step, self.last_state = step, {"position": position, **(state or {})}
        if last or stop is not None or (save_period and step % save_period == 0):
            self.save(policy, step, self.last_state)
        self.deadline.mark_step()
        if stop is not None:
            print(stop, file=sys.stderr, flush=True)
            self.stopped_at = step
        elif not last and self.deadline.due():
            self._stop_for_deadline(policy, step)

    def _stop_for_deadline(self, policy: Any, step: int) -> None:
        saved = self.save(policy, step, self.last_state) if step != self._saved_step else None
        ckpt = self.settings.checkpointing
        if saved is None and ckpt.enabled:
            saved = Path(ckpt.checkpoint_dir) / f"step_{step:06d}"
        where = (
            f"checkpoint {saved}; to continue, run the same command again"
            if saved is not None
            else "no checkpoint (checkpointing.enabled is false)"
        )
        print(
            f"checkpointing.checkpoint_must_save_by: stopped after step {step} of "
            f"{self.max_steps}: {self.deadline.elapsed:.0f} s elapsed + "
            f"{self.deadline.expected_step:.0f} s for another step would reach the deadline "
            f"({ckpt.must_save_by}, {self.deadline.seconds:.0f} s); {where}",
            file=sys.stderr,
            flush=True,
        )
        self.stopped_at = step

    def finish(self, policy: Any) -> None:
        """Save the last step when the loop ended early (data epochs used up)."""
        if self.last_step and self.last_step != self._saved_step:
            self.save(policy, self.last_step, self.last_state)

    def restore(self, policy: Any, calibration: Sequence[TokenSequence] = ()) -> None:
        """Load the resume checkpoint (full state) or ``policy.init_checkpoint`` (weights),
        and make the policy quantization-aware (``policy.quant_cfg``) once its weights are
        final, calibrating on ``calibration`` (the algorithm's training sequences).

        On resume, a policy group that holds a reference model first loads the
        init_checkpoint's weights, which the reference keeps (the resume checkpoint holds the
        trained policy, not the reference it is compared with). A quantized policy gets its
        quantizers before the resume checkpoint loads, which restores their state."""
        init = self.policy_settings.init_checkpoint
        if self.resume_from is not None:
            policy_dir = self.resume_from / "policy"
            for note in policy.check_resumable(str(policy_dir)):
                print(f"note: {note}", file=sys.stderr)
            if init and policy.holds_reference:
                path = resolve_checkpoint(init, "policy.init_checkpoint")
                _not_quantized(path / "policy", "policy.init_checkpoint")
                policy.load(str(path / "policy"), weights_only=True)
                print(f"reference weights loaded from {path}", file=sys.stderr)
            self._quantize(policy, calibration)
            policy.load(str(policy_dir))
            print(f"resumed from {self.resume_from} (step {self.start_step})", file=sys.stderr)
            return
        if init:
            path = resolve_checkpoint(init, "policy.init_checkpoint")
            _not_quantized(path / "policy", "policy.init_checkpoint")
            policy.load(str(path / "policy"), weights_only=True)
            print(f"policy weights loaded from {path}", file=sys.stderr)
        self._quantize(policy, calibration)

    def _quantize(self, policy: Any, sequences: Sequence[TokenSequence]) -> None:
        """``policy.quant_cfg``: the workers quantize (``models.quantization``), calibrating on
        ``config.quantization.calibration_batches`` of the training sequences."""
        settings = self.policy_settings
        value = settings.quant_cfg
        if value is None:
            return
        batches = quantization.calibration_batches(
            [s.ids for s in sequences], settings.quant_calibration
        )
        print(quantization.summary(value, policy.quantize(value, batches)), file=sys.stderr)

    def connect(self) -> None:
        """Start or join Ray: after the data has loaded, so a bad data file fails in seconds."""
        self.cluster_info = cluster.start_or_join(
            self.report.cluster, num_cpus=max(os.cpu_count() or 1, 4)
        )
        if self.report.cluster.on_gpu and self.settings.logger.monitor_gpus:
            from nemo_rl_offload.gpu_monitor import GpuMonitor

            self.gpu_monitor = GpuMonitor()

    def start_group(
        self,
        where: str,
        *,
        seed: int,
        trainable: bool,
        with_reference: bool = False,
        gpu_fraction: float = 1.0,
        logits_temperature: float = 1.0,
        section: dict[str, Any] | None = None,
    ) -> PolicyGroup:
        """The workers of one policy section (``policy`` or ``teacher``), set up and ready;
        their environment carries what the offload rules require, and their warnings (e.g.
        offloading not applied on CPU) are shown. ``logits_temperature``: the temperature of
        the distribution the workers' log-probabilities are taken from (GRPO's sampling one).
        ``section``: a section the recipe does not hold under ``where`` (an on-policy
        distillation teacher's, built from the policy's: its workers get the policy's
        environment)."""
        settings = (
            self.report.policies[where]
            if section is None
            else resolve_policy(section, where=where, base_dir=Path.cwd())
        )
        group = PolicyGroup(
            settings,
            cluster=self.report.cluster,
            seed=seed,
            trainable=trainable,
            with_reference=with_reference,
            env_vars=self.report.worker_environment(where if section is None else "policy") or None,
            gpu_fraction=gpu_fraction,
            logits_temperature=logits_temperature,
        )
        self.groups.append(group)
        for line in group.warnings:
            print(f"warning: {line}", file=sys.stderr)
        if group.fp8_linears:
            print(f"{where}: {group.fp8_linears} linears make FP8 products", file=sys.stderr)
        return group

    def serve(
        self,
        policy: PolicyGroup,
        *,
        seed: int,
        force: bool = False,
        stop_token_ids: Sequence[int] | None = None,
    ) -> Any:
        """Serve the policy over HTTP when the recipe exposes it (``expose_http_server``) or
        ``force`` says so (:mod:`nemo_rl_offload.serving`); each completion reports the last
        step trained as its ``policy_epoch``. The server, stopped by :meth:`close`, or None."""
        from nemo_rl_offload.serving.policy_endpoint import serve_policy

        server = serve_policy(
            self.policy_settings,
            policy,
            self.tokenizer,
            seed=seed,
            policy_epoch=lambda: self.last_step or self.start_step,
            force=force,
            stop_token_ids=stop_token_ids,
        )
        if server is not None:
            self.servers.append(server)
        return server

    def close(self) -> None:
        """Stop the policy's HTTP servers, shut down the workers, the GPU monitor, the logger
        and Ray (if this run started it)."""
        self.progress.close()
        for server in self.servers:
            server.stop()
        for group in self.groups:
            group.shutdown()
        if self.gpu_monitor is not None:
            self.gpu_monitor.close()
        self.logger.close()
        if self.cluster_info is not None:
            cluster.shutdown(self.cluster_info)


def _recorded(step_dir: Path) -> dict[str, float]:
    """The metrics a checkpoint recorded (none for a damaged state.json: it ranks last)."""
    try:
        return read_state(step_dir).get("metrics") or {}
    except UserInputError:
        return {}


def _not_quantized(policy_dir: Path, key: str) -> None:
    """A quantization-aware run's checkpoint (ModelOpt's entries, models.quantization) gives
    weights to a run by resuming only; one line naming the other ways."""
    from nemo_rl_offload.policy.checkpoint import is_legacy, read_saved

    if is_legacy(policy_dir):
        return
    saved = read_saved(policy_dir).quant_cfg
    if saved is not None:
        raise UserInputError(
            f"{key}: {policy_dir.parent} was written by a quantization-aware run "
            f"(policy.quant_cfg: {saved}), whose checkpoint only that run reads (by resuming "
            "from its checkpoint_dir); to start a new run from its weights, export them with "
            "nemo-rl-offload export-hf and give the directory as policy.model_name"
        )


def prepare(report: Report, algorithm: str, *, started: float | None = None) -> Run:
    """From a recipe checked for ``algorithm`` (and planned, with a budget:
    :mod:`nemo_rl_offload.planning.plan_at_start`): load the tokenizer, find a checkpoint to resume
    (Ray starts later, in :meth:`Run.connect`). ``started``: when the command started
    (``time.monotonic``), which checkpoint_must_save_by counts from; by default, now."""
    started = time.monotonic() if started is None else started
    for line in report.warnings:
        print(line, file=sys.stderr)
    recipe = report.recipe
    if report.run is None:
        raise ValueError("prepare() takes a recipe checked without errors")
    settings = report.run
    tokenizer = policy_tokenizer(recipe["policy"], report.policies["policy"].tokenizer)
    ckpt, logged = settings.checkpointing, settings.logger
    resume_from, start_step, driver_state = None, 0, {}
    if ckpt.enabled:
        resume_from, driver_state = find_resume(ckpt.checkpoint_dir)
        start_step = int(driver_state.get("step", 0))
    logger = MetricsLogger(
        logged.log_dir,
        total_steps=settings.schedule.max_steps,
        tensorboard=logged.tensorboard,
        resume_step=start_step if resume_from is not None else None,
    )
    print(
        f"{algorithm}: metrics -> {logger.path}; checkpoints -> {ckpt.checkpoint_dir}",
        file=sys.stderr,
    )
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
        max_steps=settings.schedule.max_steps,
        metric=ckpt.metric,
        deadline=Deadline(ckpt.must_save_by_seconds, started=started),
    )


def mean(total: float, count: float) -> float:
    return total / count if count else float("nan")
