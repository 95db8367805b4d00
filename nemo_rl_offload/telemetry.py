"""``nemo-rl-offload telemetry``: what a recipe's offload settings do, measured before a run.

It starts the recipe's policy workers (same cluster, parallel layout, precision, optimizer and
offload settings), trains a few steps on random tokens shaped like the recipe's training step
(``train_global_batch_size`` rows per step in micro-batches of ``train_micro_batch_size``, at
``max_total_sequence_length`` or the lengths asked for), and prints per step what the offload
runtime reports: peak GPU memory, step time, bytes offloaded per module, the time and achieved
bandwidth of the device-to-host and host-to-device copies, pinned host memory and plans. With
``--baseline`` the same steps run again with offloading off, and the two are compared (median
over the steps after the first: the first step of each shape records its offload plan).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from nemo_rl_offload.config import quantization
from nemo_rl_offload.config.batch_checks import check_batch_sizes
from nemo_rl_offload.config.cluster_settings import ClusterSettings
from nemo_rl_offload.config.policy_settings import PolicySettings
from nemo_rl_offload.distributed import cluster
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy.policy_group import PolicyGroup, holds_reference
from nemo_rl_offload.preflight import load_and_check, resolve_policy

RUN_OFFLOAD, RUN_AS_GIVEN, RUN_BASELINE = "offload", "recipe", "no offload"
_COLUMNS = (
    ("step", "step", "{:.0f}"),
    ("run", "run", "{}"),
    ("length", "offload_step_length", "{:.0f}"),
    ("peak GiB", "peak_fwd_bwd_gpu_memory_gib", "{:.2f}"),
    ("train s", "train_time_s", "{:.3f}"),
    ("offloaded GiB", "offloaded_gib_per_step", "{:.2f}"),
    ("D2H s", "d2h_time_s", "{:.3f}"),
    ("D2H GB/s", "d2h_gb_per_s", "{:.1f}"),
    ("H2D s", "h2d_time_s", "{:.3f}"),
    ("H2D GB/s", "h2d_gb_per_s", "{:.1f}"),
    ("pinned GiB", "pinned_host_gib", "{:.2f}"),
    ("plans", "offload_plans_kept", "{:.0f}"),
)


def _check_lengths(lengths: list[int] | None, longest: int) -> list[int]:
    if not lengths:
        return [longest]
    bad = [n for n in lengths if n < 2 or n > longest]
    if bad:
        raise UserInputError(
            f"--lengths: {bad} outside 2..{longest} (policy.max_total_sequence_length); "
            "give lengths the recipe allows"
        )
    return lengths


def _shards(
    settings: PolicySettings, dp_size: int, length: int, vocab: int, rng: np.random.Generator
) -> list[list[dict[str, np.ndarray]]]:
    """Random-token micro-batches for each data-parallel rank, in the recipe's step shape."""
    gbs, mbs = settings.train_global_batch_size, settings.batching.train_rows
    check_batch_sizes(gbs, settings.batching, dp_size)
    count = gbs // (mbs * dp_size)
    shards = []
    for _ in range(dp_size):
        shard = []
        for _ in range(count):
            ids = rng.integers(0, vocab, (mbs, length))
            shard.append(
                {"input_ids": ids, "labels": ids, "loss_mask": np.ones((mbs, length), np.float32)}
            )
        shards.append(shard)
    return shards


def _run_steps(
    section: dict[str, Any],
    settings: PolicySettings,
    cluster: ClusterSettings,
    env: dict[str, str] | None,
    *,
    name: str,
    lengths: list[int],
    steps: int,
    seed: int,
    with_reference: bool,
    err: TextIO,
) -> list[dict[str, Any]]:
    group = PolicyGroup(
        settings,
        cluster=cluster,
        seed=seed,
        trainable=True,
        with_reference=with_reference,  # the job's workers hold it too: its memory counts
        env_vars=env,
    )
    try:
        for line in group.warnings:
            print(f"warning: {line}", file=err)
        vocab = settings.architecture.vocab_size
        rng = np.random.default_rng(seed)
        quantized = _quantize_as_the_run_would(group, section, lengths[0], vocab, rng)
        if quantized:
            print(f"{name}: {quantized}", file=err)
        records = []
        for step in range(1, steps + 1):
            length = lengths[(step - 1) % len(lengths)]
            shards = _shards(settings, group.dp_size, length, vocab, rng)
            start = time.perf_counter()
            metrics = group.train(shards, {"name": "nll"})
            metrics["driver_time_s"] = time.perf_counter() - start
            metrics.setdefault("offload_step_length", float(length))
            metrics.setdefault("train_time_s", metrics.pop("step_time_s", 0.0))
            records.append({"step": step, "run": name, "length": length, **metrics})
        return records
    finally:
        group.shutdown()


def _quantize_as_the_run_would(
    group: PolicyGroup, section: dict[str, Any], length: int, vocab: int, rng: np.random.Generator
) -> str | None:
    """A quantization-aware recipe (``policy.quant_cfg``) is measured quantized, as it trains.
    It calibrates on random sequences of the measured length cut as a run cuts its data
    (``config.quantization.calibration_batches``): the ranges differ from the run's, what a
    step costs does not. Returns the run's line for it (None: not quantized)."""
    value = quantization.policy_config(section)
    if value is None:
        return None
    examples = int(section.get("quant_calib_size") or 0)
    random = rng.integers(0, vocab, (examples, length)).tolist()
    batches = quantization.calibration_batches(random, quantization.calibration(section))
    return quantization.summary(value, group.quantize(value, batches))


def environment() -> dict[str, Any]:
    """Where the numbers come from: the driver's view (workers run the same installation).
    Every measurement this project records (telemetry, the benchmark, the GPU tests) carries it."""
    import platform
    from importlib import metadata

    import torch

    versions = {}
    for package in ("megatron-core", "transformer-engine", "ray"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    gpus: list[str] = []
    try:
        import pynvml

        pynvml.nvmlInit()
        gpus = [
            str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
    except Exception:  # no NVML (CPU machine): the list stays empty
        pass
    return {
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        **versions,
    }


def measure(
    config_path: str,
    overrides: list[str],
    *,
    steps: int,
    lengths: list[int] | None = None,
    baseline: bool = False,
    err: TextIO = sys.stderr,
) -> dict[str, Any]:
    """Train ``steps`` steps of the recipe's policy (and, with ``baseline``, the same steps
    without offloading); returns the recipe's facts and one record per step."""
    if steps < 1:
        raise UserInputError(f"--steps: must be >= 1 (got: {steps})")
    report = load_and_check(config_path, overrides)
    if report.errors:
        raise UserInputError(report.errors)
    for line in report.warnings:
        print(line, file=err)
    recipe = report.recipe
    policy_cfg = recipe["policy"]
    lengths = _check_lengths(lengths, int(policy_cfg["max_total_sequence_length"]))
    seed = int(next((s["seed"] for s in recipe.values() if isinstance(s, dict) and "seed" in s), 0))
    env = report.worker_environment("policy") or None
    fgo = bool(policy_cfg["megatron_cfg"].get("fine_grained_activation_offloading"))
    runs = [(RUN_OFFLOAD if fgo else RUN_AS_GIVEN, policy_cfg, report.policies["policy"])]
    if baseline:
        plain = copy.deepcopy(policy_cfg)
        plain["megatron_cfg"]["fine_grained_activation_offloading"] = False
        runs.append((RUN_BASELINE, plain, resolve_policy(plain, base_dir=Path.cwd())))
    info = cluster.start_or_join(report.cluster, num_cpus=4)
    try:
        records = []
        for name, section, settings in runs:
            records += _run_steps(
                section,
                settings,
                report.cluster,
                env,
                name=name,
                lengths=lengths,
                steps=steps,
                seed=seed,
                with_reference=holds_reference(recipe, report.algorithm),
                err=err,
            )
    finally:
        cluster.shutdown(info)
    megatron_cfg = policy_cfg["megatron_cfg"]
    return {
        "environment": environment(),
        "recipe": config_path,
        "overrides": overrides,
        "model": policy_cfg["model_name"],
        "gpus_per_node": report.cluster.gpus_per_node,
        "offload_modules": list(report.policies["policy"].effective.listed_offload_modules),
        "fine_grained_activation_offloading": bool(
            megatron_cfg.get("fine_grained_activation_offloading")
        ),
        "train_global_batch_size": int(policy_cfg["train_global_batch_size"]),
        "train_micro_batch_size": int(policy_cfg["train_micro_batch_size"]),
        "records": records,
    }


def _cell(record: dict[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    return "-" if value is None else fmt.format(value)


def replayed_median(records: list[dict[str, Any]], key: str) -> float | None:
    """Median over the steady steps: those that replay a plan (each length's first step
    records one) and, with CUDA graphs, those replayed as a graph (a shape's warm-up and
    capture steps are not steady). All steps when none is."""
    seen: set[int] = set()
    replayed = []
    for record in records:
        graph_warmup = "cuda_graph_replayed" in record and (
            not record["cuda_graph_replayed"] or record["cuda_graph_captured"]
        )
        if record["length"] in seen and key in record and not graph_warmup:
            replayed.append(record[key])
        seen.add(record["length"])
    values = replayed or [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def format_report(result: dict[str, Any], out: TextIO) -> None:
    """The per-step table, the last offload step's module breakdown, and the comparison."""
    on = result["fine_grained_activation_offloading"]
    modules = ", ".join(result["offload_modules"]) or "none"
    print(
        f"telemetry: {result['recipe']} (model {result['model']}, offload "
        f"{'on: ' + modules if on else 'off'}; {result['train_global_batch_size']} rows per "
        f"step in micro-batches of {result['train_micro_batch_size']})",
        file=out,
    )
    rows = [[title for title, _, _ in _COLUMNS]]
    rows += [[_cell(r, key, fmt) for _, key, fmt in _COLUMNS] for r in result["records"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    for row in rows:
        print(
            "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)), file=out
        )
    offload = [r for r in result["records"] if r["run"] != RUN_BASELINE]
    last = offload[-1] if offload else {}
    per_module = {
        key.removeprefix("offloaded_gib_"): value
        for key, value in last.items()
        if key.startswith("offloaded_gib_") and key != "offloaded_gib_per_step"
    }
    if per_module:
        parts = ", ".join(f"{name} {gib:.2f} GiB" for name, gib in per_module.items())
        print(f"offloaded per module (step {last['step']}, all micro-batches): {parts}", file=out)
    elif result["gpus_per_node"] == 0:
        print(
            "note: the recipe runs on CPU workers (cluster.gpus_per_node: 0), where offloading "
            "is off: no offload telemetry; run it on a GPU machine",
            file=out,
        )
    elif on:
        print("note: nothing was offloaded (see the warnings above)", file=out)
    baseline = [r for r in result["records"] if r["run"] == RUN_BASELINE]
    if offload and baseline:
        for label, key, unit in (
            ("peak", "peak_fwd_bwd_gpu_memory_gib", "GiB"),
            ("train time", "train_time_s", "s"),
        ):
            with_fgo, without = replayed_median(offload, key), replayed_median(baseline, key)
            if with_fgo is None or without is None or without == 0:
                continue
            change = 100 * (with_fgo - without) / without
            print(
                f"{label}: no offload {without:.3f} {unit} -> {offload[0]['run']} {with_fgo:.3f} "
                f"{unit} "
                f"({change:+.1f}%, median of the steps that replay a plan)",
                file=out,
            )


def write_json(result: dict[str, Any], path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(target)
