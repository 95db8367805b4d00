"""Offloading against its alternatives, side by side in one run on one GPU.

For one model preset and sequence length, each case (no offload; fine-grained offload module
sets, with fraction and max-inflight variants; selective and full recompute; offload combined
with selective recompute; torch's save_on_cpu) builds the policy worker in this process, trains
``--steps`` steps of the same random batches, and records the forward-backward peak memory, the
median forward-backward time (the optimizer step is the same for every case and left out),
bytes offloaded and the copy bandwidth. The floor of each offload case comes from the physical
model (nemo_rl_offload/planning/cost_model.py) with this run's own numbers: the no-offload
forward and backward times and the bandwidth of a plain pinned copy measured here.

Each case runs in its own process, which the parent starts with ``--one-case``: a fresh CUDA
allocator, and no state left by the case before (before PolicyWorker.close broke the MoE token
dispatcher's reference cycle, MoE models were not freed in-process at all).

Output in --out: ``<model>_seq<N>.json`` (every step of every case, the environment), a
markdown table, and a PNG of peak memory against time when matplotlib is installed.

Run on a GPU machine (measured on an H100: 6.3 minutes for moe-1b at 4096, one process per case):
    python3 benchmarks/offload_benchmark.py --model llama-1b --seq 4096 --out /tmp/bench
Cases can be narrowed with --cases NAME,NAME; --list prints them. --rounds N measures every
case in N processes (the order reversed every other round) and reports their median. Steps
follow each other as a training loop's do (the host begins a step while the GPU finishes the
previous one's optimizer); --standing-start waits for the GPU before each step instead, as a
step after a pause begins (benchmarks/results/2026-11-27_h100_forward_lead_3b_seq8192.md shows
what that lead is worth at 8k).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nemo_rl_offload.planning.planner import DENSE_MODULES, EXPERT_MODULES  # noqa: E402
from nemo_rl_offload.telemetry import environment  # noqa: E402

FGO = {"fine_grained_activation_offloading": True}
DENSE_FIVE = list(DENSE_MODULES)
# This package's offload points in the dense MLP (nemo_rl_offload/models/mlp_offload.py).
DENSE_MLP = ["mlp_fc1", "mlp_act", "mlp_fc2"]
SELECTIVE_CORE_ATTN = {
    "activation_checkpointing": True,
    "recompute_granularity": "selective",
    "recompute_modules": ["core_attn"],
}
FULL_RECOMPUTE = {"activation_checkpointing": True}
# Selective recompute sets of a dense layer (name -> recompute_modules); "cheap" re-runs only
# elementwise work (the norms, the MLP's activation).
RECOMPUTE_SETS = {
    "layernorm": ["layernorm"],
    "mlp_act": ["mlp_act"],
    "cheap": ["layernorm", "mlp_act"],
    "mlp": ["mlp"],
    "mlp_layernorm": ["layernorm", "mlp"],
}


def _selective(modules: list[str]) -> dict[str, Any]:
    return {**SELECTIVE_CORE_ATTN, "recompute_modules": list(modules)}


SAVE_ON_CPU = "save_on_cpu"  # not a recipe setting: torch.autograd.graph.save_on_cpu
# Not recipe settings either: the case runs with Megatron's own copies of non-contiguous
# tensors (contiguous() first), or with Megatron's own hook code instead of the runtime's lean
# one, to measure the runtime's change in the same run. Suffixes of an offload case's name;
# each names the offload runtime's per-plan choice the case turns off (eager MoE plans have
# the copies off already).
MEGATRON_COPIES = "megatron_copies"
MEGATRON_HOOKS = "megatron_hooks"
# ... or with a copy per saved tensor, as Megatron makes, instead of one per saved storage.
PER_TENSOR_COPIES = "per_tensor_copies"
RUNTIME_CHOICES = {
    MEGATRON_COPIES: "strided_copies",
    MEGATRON_HOOKS: "lean_hooks",
    PER_TENSOR_COPIES: "one_copy_per_storage",
}
# A policy setting, not a megatron_cfg one: the section's own key (``mixed_case``'s ``lp:N``).
LOGPROB_CHUNK = "logprob_chunk_size"
BENCHMARK_ONLY = (SAVE_ON_CPU, LOGPROB_CHUNK, *RUNTIME_CHOICES)
# Full-iteration CUDA graphs: 3 eager steps (the 2nd and 3rd time the copies), the 4th
# captured, then replays (medians of those; a graph case runs that many more steps).
GRAPHS = {"cuda_graph_impl": "full_iteration", "cuda_graph_warmup_steps": 3}


def _graphed(settings: dict[str, Any], inflight: int = 4) -> dict[str, Any]:
    """A case's settings under full-iteration graphs (offloading there needs the cap; 4 was
    the fastest measured on the 1B step)."""
    if settings.get("fine_grained_activation_offloading"):
        return {**settings, **GRAPHS, "fine_grained_offloading_max_inflight_offloads": inflight}
    return {**settings, **GRAPHS}


def cases_for(model: str) -> dict[str, dict[str, Any]]:
    """The case matrix: name -> megatron_cfg settings (or SAVE_ON_CPU)."""
    cases: dict[str, dict[str, Any]] = {
        "no_offload": {},
        "fgo_attn_pair": {**FGO, "offload_modules": ["core_attn", "attn_proj"]},
        "fgo_attn_qkv": {**FGO, "offload_modules": ["qkv_linear", "core_attn", "attn_proj"]},
        "fgo_norms": {**FGO, "offload_modules": ["attn_norm", "mlp_norm"]},
        "fgo_all5": {**FGO, "offload_modules": DENSE_FIVE},
        "fgo_attention_block": {**FGO, "offload_modules": DENSE_FIVE[:4]},
        "fgo_all5_fraction_0.5": {
            **FGO,
            "offload_modules": DENSE_FIVE,
            "activation_offload_fraction": 0.5,
        },
        "fgo_all5_fraction_0.5_earliest": {
            **FGO,
            "offload_modules": DENSE_FIVE,
            "activation_offload_fraction": 0.5,
            "activation_offload_fraction_placement": "earliest",
        },
        "fgo_all5_inflight_1": {
            **FGO,
            "offload_modules": DENSE_FIVE,
            "fine_grained_offloading_max_inflight_offloads": 1,
        },
        "recompute_core_attn": SELECTIVE_CORE_ATTN,
        "recompute_full": FULL_RECOMPUTE,
        # Full recompute with each recomputed layer's input offloaded (Megatron-LM PR 5218's
        # layer_input; nemo_rl_offload/offload/layer_input.py).
        "recompute_full+layer_input": {**FULL_RECOMPUTE, **FGO, "offload_modules": ["layer_input"]},
        "fgo_norms_qkv+recompute_core_attn": {
            **FGO,
            **SELECTIVE_CORE_ATTN,
            "offload_modules": ["attn_norm", "qkv_linear", "mlp_norm"],
        },
        SAVE_ON_CPU: {SAVE_ON_CPU: True},
    }
    # The same step as one CUDA graph: without the CPU's launch and hook costs, what is left of
    # an offload case's overhead is the copies' own.
    for name in ("no_offload", "fgo_attn_pair", "fgo_norms", "fgo_all5"):
        cases[f"{name}_graph"] = _graphed(cases[name])
    cases["fgo_all5_graph_inflight_2"] = _graphed(cases["fgo_all5"], inflight=2)
    if "moe" not in model:  # the rules refuse the MLP's offload points on experts
        cases["fgo_mlp"] = {**FGO, "offload_modules": DENSE_MLP}
        cases["fgo_mlp_act"] = {**FGO, "offload_modules": ["mlp_act"]}
        cases["fgo_all5_mlp"] = {**FGO, "offload_modules": DENSE_FIVE + DENSE_MLP}
        # Selective recompute of the dense layer without Transformer Engine
        # (nemo_rl_offload/models/local_recompute.py): the cheap elementwise ones, the whole
        # MLP, and the cheap ones beside the offload modules they combine with.
        for name, modules in RECOMPUTE_SETS.items():
            cases[f"recompute_{name}"] = _selective(modules)
        cases["fgo_norm_inputs_attn+recompute_cheap"] = {
            **FGO,
            **_selective(RECOMPUTE_SETS["cheap"]),
            "offload_modules": ["attn_norm", "core_attn", "attn_proj", "mlp_norm"],
        }
        # The same with fc1's input offloaded too and the activation recomputed: what stays
        # on the GPU is qkv's input and fc1's output.
        cases["fgo_norm_inputs_attn_fc1+recompute_mlp_act"] = {
            **FGO,
            **_selective(RECOMPUTE_SETS["mlp_act"]),
            "offload_modules": ["attn_norm", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"],
        }
        # The cheap recompute beside the whole MLP's recompute and the attention offload.
        cases["fgo_attn_pair+recompute_mlp_layernorm"] = {
            **FGO,
            **_selective(RECOMPUTE_SETS["mlp_layernorm"]),
            "offload_modules": ["core_attn", "attn_proj"],
        }
    if "moe" in model:
        experts = list(EXPERT_MODULES)
        cases["fgo_experts"] = {**FGO, "offload_modules": experts}
        cases["fgo_attn_pair_experts"] = {
            **FGO,
            "offload_modules": ["core_attn", "attn_proj", *experts],
        }
        # Graphed only with drop-and-pad dispatch (--model-override); rejected otherwise.
        for name in ("fgo_experts", "fgo_attn_pair_experts"):
            cases[f"{name}_graph"] = _graphed(cases[name])
    return cases


# mixed_case's parts that take a number: the setting each sets and how its value reads.
NUMBER_PARTS: dict[str, tuple[str, Any]] = {
    "frac": ("activation_offload_fraction", float),
    "lp": (LOGPROB_CHUNK, int),
    "lpo": (LOGPROB_CHUNK, int),  # with chunked_output_layer (mixed_case)
}


def _module_fractions(value: str) -> dict[str, float]:
    """``MOD=F+MOD=F`` -> {MOD: F}."""
    pairs = [part.partition("=") for part in value.split("+")]
    if not all(name and sep for name, sep, _ in pairs):
        raise ValueError(value)
    return {name: float(share) for name, _, share in pairs}


def mixed_case(name: str) -> dict[str, Any]:
    """The settings of a case written as its parts joined by ``__``: ``fgo:MOD+MOD`` (offload
    modules), ``rc:MOD+MOD`` (selective recompute modules), ``frac:F`` (offload fraction),
    ``mfrac:MOD=F+MOD=F`` (``activation_offload_fraction_by_module``: those modules' own
    fractions), ``lp:N`` (``policy.logprob_chunk_size``: the loss's log-softmax N positions at a
    time, no float32 copy of the logits kept), ``lpo:N`` (the same with
    ``chunked_output_layer``: the output layer in those chunks too), ``fp8:RECIPE``
    (``megatron_cfg.fp8_cfg`` on, e4m3, with ``blockwise`` or ``tensorwise`` scaling). Raises
    KeyError naming the case when a part is none of these."""
    settings: dict[str, Any] = {}
    for part in name.split("__"):
        kind, _, value = part.partition(":")
        if kind == "fgo" and value:
            settings.update(FGO, offload_modules=value.split("+"))
        elif kind == "rc" and value:
            settings.update(_selective(value.split("+")))
        elif kind == "fp8" and value:
            settings["fp8_cfg"] = {
                "enabled": True,
                "fp8": "e4m3",
                "fp8_recipe": value,
                "fp8_param": False,
            }
        elif kind == "mfrac" and value:
            try:
                settings["activation_offload_fraction_by_module"] = _module_fractions(value)
            except ValueError:
                raise KeyError(name) from None
        elif kind in NUMBER_PARTS and value:
            key, parse = NUMBER_PARTS[kind]
            try:
                settings[key] = parse(value)
            except ValueError:
                raise KeyError(name) from None
            if kind == "lpo":
                settings["chunked_output_layer"] = True
        else:
            raise KeyError(name)
    return settings


def resolve_cases(model: str, names: list[str] | None) -> dict[str, dict[str, Any]]:
    """The named cases (all when ``names`` is None), no_offload first. Besides the matrix's
    names, ``fgo:MOD+MOD`` is an offload case of those modules, optionally with
    ``__rc:MOD+MOD`` (selective recompute beside it) and ``__frac:F`` (its offload fraction),
    e.g. a planner's choice ``fgo:core_attn__rc:layernorm+mlp_act`` (``rc:MOD+MOD`` alone is
    selective recompute), ``recompute_block_N`` full recompute of the first N layers only,
    ``CASE_graph_inflight_N``
    is an offload case of the matrix under full-iteration graphs with
    max inflight N, ``CASE_megatron_copies`` an offload case with Megatron's own copies of
    non-contiguous tensors, ``CASE_megatron_hooks`` one with Megatron's own hook code and
    ``CASE_per_tensor_copies`` one that copies every saved tensor, views of one storage
    included (to measure the runtime's strided copies, lean hooks or one copy per storage in
    the same run)."""
    import re

    matrix = cases_for(model)
    if names is None:
        return matrix

    def resolve(name: str) -> dict[str, Any]:
        graphed = re.fullmatch(r"(.+)_graph_inflight_(\d+)", name)
        partial = re.fullmatch(r"recompute_block_(\d+)", name)
        if name in matrix:
            return matrix[name]
        if partial:  # full recompute of the first N layers only (Megatron's block method)
            return {
                **FULL_RECOMPUTE,
                "recompute_method": "block",
                "recompute_num_layers": int(partial[1]),
            }
        if graphed:
            return _graphed(resolve(graphed[1]), inflight=int(graphed[2]))
        left_out = next((k for k in RUNTIME_CHOICES if name.endswith(f"_{k}")), None)
        if left_out:
            base = resolve(name.removesuffix(f"_{left_out}"))
            if base.get("fine_grained_activation_offloading"):
                return {**base, left_out: True}
        elif name.startswith(("fgo:", "rc:", "lp:", "lpo:", "fp8:")):
            return mixed_case(name)
        raise KeyError(name)

    return {name: resolve(name) for name in ["no_offload", *names]}


def section_for(
    model: str,
    seq: int,
    settings: dict[str, Any],
    precision: str = "bfloat16",
    model_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A case's policy section on the preset ``model``; ``model_overrides`` (TransformerConfig
    fields, e.g. drop-and-pad dispatch for a MoE model) apply to every case."""
    megatron = {k: v for k, v in settings.items() if k not in BENCHMARK_ONLY}
    overrides = dict(model_overrides or {})
    if "moe" in model:  # every case on the grouped experts, the layout expert offload needs
        overrides.setdefault("moe_grouped_gemm", True)
    if overrides:
        megatron["model_overrides"] = overrides
    return {
        "model_name": model,
        "precision": precision,
        "max_total_sequence_length": seq,
        "make_sequence_length_divisible_by": seq,
        **({LOGPROB_CHUNK: settings[LOGPROB_CHUNK]} if LOGPROB_CHUNK in settings else {}),
        "megatron_cfg": {
            "enabled": True,
            **megatron,
            "optimizer": {
                "optimizer": "adam",
                "lr": 1e-6,
                "min_lr": 1e-6,
                "use_distributed_optimizer": False,
            },
        },
    }


def recipe_section(
    recipe: str, overrides: list[str], model: str, seq: int, settings: dict[str, Any]
) -> dict[str, Any]:
    """A case on a recipe's own policy (what ``nemo-rl-offload plan`` measures), with the
    step shape of the benchmark: every micro-batch one sequence padded to ``seq``."""
    import copy

    from nemo_rl_offload.preflight import load_and_check

    report = load_and_check(recipe, overrides)
    if report.errors:
        raise SystemExit("\n".join(report.errors))
    section = copy.deepcopy(report.recipe["policy"])
    if section["model_name"] != model:
        raise SystemExit(
            f"--recipe: its policy.model_name is {section['model_name']}, --model says {model}; "
            "give the same model (the batches use --model's vocabulary)"
        )
    section["max_total_sequence_length"] = seq
    section["make_sequence_length_divisible_by"] = seq
    megatron = section["megatron_cfg"]
    megatron["fine_grained_activation_offloading"] = False
    megatron.update({k: v for k, v in settings.items() if k not in BENCHMARK_ONLY})
    if LOGPROB_CHUNK in settings:
        section[LOGPROB_CHUNK] = settings[LOGPROB_CHUNK]
    return section


def check_section(section: dict[str, Any]) -> list[str]:
    """The offload and FP8 rules' verdict on a case (a case the rules reject is reported, not
    run)."""
    from nemo_rl_offload.config import fp8
    from nemo_rl_offload.config.megatron_settings import resolve_transformer_impl
    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.offload.capabilities import detect
    from nemo_rl_offload.preflight import check_policy

    caps = detect()
    offload_errors = check_policy(
        section,
        where="policy",
        architecture=architecture_for(section["model_name"]),
        caps=caps,
        gpus_per_node=1,
    ).errors
    impl = resolve_transformer_impl(
        section["megatron_cfg"].get("transformer_impl"), caps.has_transformer_engine
    )
    fp8_errors, _ = fp8.problems(section, "policy", transformer_impl=impl)
    return offload_errors + fp8_errors


def use_megatron_handler(worker: Any, settings: dict[str, Any]) -> None:
    """For a ``MEGATRON_COPIES`` or ``MEGATRON_HOOKS`` case: the worker's offload runtime
    records its plans with that change of Megatron's handler turned off (before its first
    step), so they run Megatron's own code."""
    for key, choice in RUNTIME_CHOICES.items():
        if settings.get(key):
            worker.runtime.choices = dataclasses.replace(worker.runtime.choices, **{choice: False})


def build_worker(section: dict[str, Any], on_gpu: bool):
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    worker = PolicyWorker(
        settings=resolve_policy(section), rank=0, world_size=1, seed=1, on_gpu=on_gpu
    )
    worker.setup(*worker.node_address())
    return worker


def batches(
    steps: int, microbatches: int, rows: int, seq: int, vocab: int
) -> list[list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(microbatches):
            ids = rng.integers(0, vocab, (rows, seq))
            step.append({"input_ids": ids, "labels": ids, "loss_mask": np.ones((rows, seq), "f4")})
        out.append(step)
    return out


def copy_bandwidth(gib: float = 1.0) -> dict[str, float]:
    """Bytes per second of one plain pinned copy each way (the hardware limit offloading has)."""
    import torch

    if not torch.cuda.is_available():
        return {"d2h_bytes_per_s": 0.0, "h2d_bytes_per_s": 0.0}
    n = int(gib * 2**30)
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    result = {}
    for name, dst, src in (("d2h", host, device), ("h2d", device, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        samples = []
        # The best of five: one sample can catch the host busy (once measured at 31.5 GB/s
        # H2D while offloading itself reached 54 GB/s in the same run).
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            samples.append(n / (time.perf_counter() - start))
        result[f"{name}_bytes_per_s"] = max(samples)
    return result


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping intervals merged (sorted)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def forward_gpu_s(worker: Any, microbatch: dict[str, np.ndarray]) -> float:
    """The GPU's own time for a forward pass of one micro-batch: the union of its kernels'
    spans. An eager forward at short sequences waits for the CPU to launch kernels; a CUDA
    graph replays the same kernels without those gaps, so this is the forward time that the
    copies of a graphed step can hide behind."""
    import torch

    worker.token_logprobs([microbatch])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        worker.token_logprobs([microbatch])
        torch.cuda.synchronize()
    spans = [
        (event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
        and not event.name.lower().startswith(("memcpy", "memset"))
    ]
    return sum(end - start for start, end in union(spans)) * 1e-6


def forward_time_s(worker: Any, microbatch: dict[str, np.ndarray]) -> float:
    """Median time of a forward pass of one micro-batch (no autograd graph kept)."""
    import torch

    times = []
    for _ in range(3):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        worker.token_logprobs([microbatch])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case_in_subprocess(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run one case in a fresh process; returns its record (or the failure, as a record)."""
    target = out / f".case_{name}.json"
    command = [
        sys.executable,
        __file__,
        "--model",
        args.model,
        "--seq",
        str(args.seq),
        "--microbatches",
        str(args.microbatches),
        "--rows",
        str(args.rows),
        "--steps",
        str(args.steps),
        "--precision",
        args.precision,
        *(["--recipe", args.recipe] if args.recipe else []),
        *[f"--recipe-override={line}" for line in args.recipe_override],
        *[f"--model-override={line}" for line in args.model_override],
        *(["--standing-start"] if getattr(args, "standing_start", False) else []),
        "--one-case",
        name,
        "--out",
        str(target),
    ]
    settings = resolve_cases(args.model, [name])[name]
    return run_child(command, target, name, settings)


def run_child(
    command: list[str], target: Path, name: str, settings: dict[str, Any]
) -> dict[str, Any]:
    """Run a case's child process (``command`` writes its record to ``target``); returns the
    record. A child that failed wrote its failure there (:func:`write_case_record`); one that
    died before it could is described from its stderr's last exception, or its exit status
    (a signal: killed, for instance by the host running out of memory)."""
    import subprocess

    from nemo_rl_offload.planning.failures import Failure, from_text

    target.unlink(missing_ok=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if target.is_file():
        record = json.loads(target.read_text())
        target.unlink()
        return record
    text = done.stderr or done.stdout
    failure = from_text(text)
    if failure.type == "unknown" and done.returncode < 0:
        failure = Failure("killed", f"the process was killed by signal {-done.returncode}")
    elif failure.type == "unknown":
        failure = Failure(
            "unknown", f"exit status {done.returncode}; last output: {failure.message}"
        )
    return failed_record(name, settings, failure)


def failed_record(name: str, settings: dict[str, Any], failure: Any) -> dict[str, Any]:
    """A case's record when it failed: ``failed`` the one line the table prints, ``failure``
    the structured reason (type, message, out-of-memory sizes)."""
    return {
        "case": name,
        "settings": settings,
        "failed": failure.summary(),
        "failure": failure.as_dict(),
    }


def write_case_record(target: Path, name: str, settings: dict[str, Any], run: Any) -> int:
    """The child's side: ``run()``'s record written to ``target``, or, when it raises, the
    failure it raised (so the parent reads why, not the last line of stderr). Returns the
    child's exit status."""
    from nemo_rl_offload.planning.failures import from_exception

    try:
        record = run()
    except (Exception, SystemExit) as exc:  # any failure of the case is its result
        target.write_text(json.dumps(failed_record(name, settings, from_exception(exc))))
        return 1
    target.write_text(json.dumps(record))
    return 0


def parse_model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--model-override KEY=VALUE`` lines as a dict, each value read as a recipe override's
    (``1.0``, ``true``, ``[a, b]``: :func:`nemo_rl_offload.config.overrides.parse_value`).
    Raises ValueError with one line naming a malformed one."""
    from nemo_rl_offload.config.overrides import parse_value
    from nemo_rl_offload.errors import UserInputError

    overrides: dict[str, Any] = {}
    for line in args.model_override:
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--model-override {line!r}: write KEY=VALUE")
        try:
            overrides[key.strip()] = parse_value(value)
        except UserInputError as bad:
            raise ValueError(f"--model-override {line!r}: {bad}") from None
    return overrides


def model_overrides_refused(args: argparse.Namespace) -> bool:
    """Print the one-line reason and return True when ``--model-override`` lines are malformed
    (the main functions then exit 2)."""
    try:
        parse_model_overrides(args)
    except ValueError as bad:
        print(bad, file=sys.stderr)
        return True
    return False


GC_ENV = "OFFLOAD_BENCHMARK_GC"


def _python_gc_after_first_step() -> None:
    """An experiment's switch (``OFFLOAD_BENCHMARK_GC``): after the first step, ``freeze``
    moves every object alive into the collector's permanent generation (later collections do
    not walk them); ``off`` turns automatic collection off. Unset: Python's defaults."""
    import gc

    mode = os.environ.get(GC_ENV, "")
    if mode == "freeze":
        gc.collect()
        gc.freeze()
    elif mode == "off":
        gc.collect()
        gc.disable()
    elif mode:
        raise SystemExit(f"{GC_ENV}={mode}: give freeze, off or nothing")


def _main_thread_counters() -> dict[str, float] | None:
    """This thread's CPU seconds, context switches and the CPU it last ran on (Linux), read
    around each step: a host-bound step whose thread lost the CPU (involuntary switches) or
    waited (voluntary ones) is slow for its host, not for its offloading."""
    try:
        status = Path("/proc/thread-self/status").read_text()
        stat = Path("/proc/thread-self/stat").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "cpu_s": time.thread_time(),
        "involuntary": float(fields["nonvoluntary_ctxt_switches"]),
        "voluntary": float(fields["voluntary_ctxt_switches"]),
        "cpu": float(stat.rsplit(")", 1)[1].split()[36]),  # field 39: processor
    }


def _host_share(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """A step's host figures from the counters around it (none off Linux)."""
    if before is None or after is None:
        return {}
    return {
        "host_thread_cpu_s": after["cpu_s"] - before["cpu_s"],
        "host_involuntary_switches": after["involuntary"] - before["involuntary"],
        "host_voluntary_switches": after["voluntary"] - before["voluntary"],
        "host_cpu": after["cpu"],
    }


def run_case(
    name: str, settings: dict[str, Any], args: argparse.Namespace, data: list, on_gpu: bool
) -> dict[str, Any]:
    import torch

    if args.recipe:
        section = recipe_section(args.recipe, args.recipe_override, args.model, args.seq, settings)
    else:
        section = section_for(
            args.model, args.seq, settings, args.precision, parse_model_overrides(args)
        )
    errors = check_section(section)
    if errors:
        return {"case": name, "settings": settings, "rejected": errors}
    # The recipe's worker environment, as its Ray workers get it (e.g. the CUDA allocator's
    # PYTORCH_CUDA_ALLOC_CONF, read when this process first allocates on the GPU).
    os.environ.update(section["megatron_cfg"].get("env_vars") or {})
    worker = build_worker(section, on_gpu)
    use_megatron_handler(worker, settings)
    try:
        context = (
            torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            if settings.get(SAVE_ON_CPU)
            else contextlib.nullcontext()
        )
        steps = []
        standing_start = bool(getattr(args, "standing_start", False)) and on_gpu
        for index, step in enumerate(data):
            if index == 1:
                _python_gc_after_first_step()
            if standing_start:  # the GPU idle when the step begins, as after a pause
                torch.cuda.synchronize()
            before = _main_thread_counters()
            with context:
                metrics = worker.train(step, {"name": "nll"})
            metrics.update(_host_share(before, _main_thread_counters()))
            steps.append(metrics)
        forward: dict[str, float] = {}
        if name == "no_offload":
            forward["forward_s_per_microbatch"] = forward_time_s(worker, data[0][0])
            if on_gpu:
                forward["forward_gpu_s_per_microbatch"] = forward_gpu_s(worker, data[0][0])
    finally:
        worker.close()  # frees the model before the next case is built
    later = steps[1:] or steps  # the first step records plans and allocates optimizer state
    timed = later  # steps whose copies were timed (a replayed graph runs no Python to time)
    if settings.get("cuda_graph_impl") == "full_iteration":
        # Graph cases: medians of the replays; copy rates from the eager warm-up steps after
        # the first (they replay the same offload plan with the copies timed).
        timed = [s for s in later if not s.get("cuda_graph_replayed")] or later
        replays = [
            s for s in steps if s.get("cuda_graph_replayed") and not s.get("cuda_graph_captured")
        ]
        later = replays or later
    record = {
        "case": name,
        "settings": settings,
        "peak_gib": max(s.get("peak_fwd_bwd_gpu_memory_gib", 0.0) for s in later),
        "fwd_bwd_s": statistics.median(s["fwd_bwd_time_s"] for s in later),
        "steps_in_medians": len(later),
        "offloaded_gib_per_step": statistics.median(
            s.get("offloaded_gib_per_step", 0.0) for s in later
        ),
        "d2h_gb_per_s": statistics.median(s.get("d2h_gb_per_s", 0.0) for s in timed),
        "h2d_gb_per_s": statistics.median(s.get("h2d_gb_per_s", 0.0) for s in timed),
        "losses": [s["loss"] / s["num_tokens"] for s in steps],
        "standing_start": standing_start,
        "steps": steps,
    }
    record.update(forward)
    return record


def combine_processes(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case measured in several processes (``--rounds``), as one record: the median of the
    processes' step-time medians, the highest peak, the median copy rates and forward times,
    and each process's own time (``fwd_bwd_s_by_process``). Eager steps of the 1B models are
    host-bound, and the H100 host's speed drifted by more than offloading costs, within a
    process and between processes (the MoE step without offloading: 0.462 and 0.527 s in one
    process, before and after another case; 0.526 s in another), so one measurement per case
    cannot rank close cases. A single run is returned as it is."""
    done = [r for r in runs if "peak_gib" in r]
    if len(runs) == 1 or not done:
        return runs[0]
    merged = {key: value for key, value in done[0].items() if key != "steps"}
    times = [r["fwd_bwd_s"] for r in done]
    merged["fwd_bwd_s"] = statistics.median(times)
    merged["fwd_bwd_s_by_process"] = times
    merged["peak_gib"] = max(r["peak_gib"] for r in done)
    for key in (
        "d2h_gb_per_s",
        "h2d_gb_per_s",
        "forward_s_per_microbatch",
        "forward_gpu_s_per_microbatch",
    ):
        values = [r[key] for r in done if key in r]
        if values:
            merged[key] = statistics.median(values)
    merged["steps_by_process"] = [r.get("steps", []) for r in done]
    if len(done) < len(runs):
        merged["failed_processes"] = [r.get("failed", "") for r in runs if "peak_gib" not in r]
    return merged


def _is_graphed(record: dict[str, Any]) -> bool:
    return record.get("settings", {}).get("cuda_graph_impl") == "full_iteration"


RECOMPUTE_KEYS = ("activation_checkpointing", "recompute_granularity", "recompute_modules")


def _recompute_twin(record: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """For an offload case that also recomputes: the case with the same recompute settings and
    no offloading (its added time is compute the recompute itself costs, outside any copy
    floor)."""
    wanted = {k: record["settings"].get(k) for k in RECOMPUTE_KEYS}
    if not wanted["activation_checkpointing"]:
        return None
    return next(
        (
            r
            for r in records
            if "peak_gib" in r
            and not r["settings"].get("fine_grained_activation_offloading")
            and _is_graphed(r) == _is_graphed(record)
            and {k: r["settings"].get(k) for k in RECOMPUTE_KEYS} == wanted
        ),
        None,
    )


def add_floors(records: list[dict[str, Any]], bandwidth: dict[str, float], mbs: int) -> None:
    """Each case's change against no_offload, and for offload cases two floors from the
    physical model (nemo_rl_offload/planning/cost_model.py): with the bandwidth of one plain
    pinned copy (the hardware's limit) and with the copy rate offloading itself achieved (its
    copies are many tensors of a few MiB; a graphed case's rate is from its eager warm-up). A
    graphed case's floor starts from the graphed no-offload step, and its forward is the GPU's
    own forward time (``forward_gpu_s``): without the CPU's launch gaps the passes are
    shorter, so less copy time hides behind them. A case that offloads and recomputes adds
    what the recompute alone costs (its twin without offloading, when the run has it)."""
    from nemo_rl_offload.planning.cost_model import PassTimes, step_floor_s

    done = [r for r in records if "peak_gib" in r]
    base = next((r for r in done if r["case"] == "no_offload"), None)
    if base is None:
        return
    graph_base = next((r for r in done if r["case"] == "no_offload_graph"), None)

    def pass_times(start: dict[str, Any], graphed: bool) -> PassTimes:
        """A micro-batch's forward and backward seconds in the step ``start`` measured: its
        forward share from the eager forward; a graphed step's forward from the GPU's time."""
        per_mb, eager_per_mb = start["fwd_bwd_s"] / mbs, base["fwd_bwd_s"] / mbs
        eager_forward = base.get("forward_s_per_microbatch", eager_per_mb / 3)
        forward = per_mb * min(eager_forward, eager_per_mb) / eager_per_mb
        if graphed and "forward_gpu_s_per_microbatch" in base:
            forward = min(base["forward_gpu_s_per_microbatch"], per_mb)
        return PassTimes(forward, per_mb - forward)

    for r in done:
        if base["peak_gib"] > 0:  # 0 on CPU, which has no allocator statistics
            r["peak_change"] = r["peak_gib"] / base["peak_gib"] - 1
        r["time_change"] = r["fwd_bwd_s"] / base["fwd_bwd_s"] - 1
        moved = r["offloaded_gib_per_step"] * 2**30
        if not moved or bandwidth["d2h_bytes_per_s"] <= 0:
            continue
        graphed = _is_graphed(r) and graph_base is not None
        start = graph_base if graphed else base
        step = start["fwd_bwd_s"]
        times = pass_times(start, graphed)
        twin = _recompute_twin(r, done)
        recompute_s = twin["fwd_bwd_s"] - step if twin else 0.0
        floor = recompute_s + step_floor_s(
            step, mbs, moved, times, bandwidth["d2h_bytes_per_s"], bandwidth["h2d_bytes_per_s"]
        )
        r["floor_time_change"] = floor / base["fwd_bwd_s"] - 1
        r["gap_to_floor_pp"] = 100 * (r["time_change"] - r["floor_time_change"])
        # The same gap in points of the case's own mode's step without offloading: for a
        # graphed case the graphed step, which can be much shorter than the eager one (the
        # 1B MoE step: 0.16 s graphed, 0.42-0.56 s eager), so its points are larger.
        r["gap_to_floor_own_step_pp"] = 100 * (r["fwd_bwd_s"] - floor) / step
        if r.get("d2h_gb_per_s") and r.get("h2d_gb_per_s"):
            achieved = recompute_s + step_floor_s(
                step, mbs, moved, times, r["d2h_gb_per_s"] * 1e9, r["h2d_gb_per_s"] * 1e9
            )
            r["floor_achieved_time_change"] = achieved / base["fwd_bwd_s"] - 1
            r["gap_to_achieved_floor_pp"] = 100 * (
                r["time_change"] - r["floor_achieved_time_change"]
            )
            r["gap_to_achieved_floor_own_step_pp"] = 100 * (r["fwd_bwd_s"] - achieved) / step


def _pct(record: dict[str, Any], key: str) -> str:
    return f"{100 * record[key]:+.1f}%" if key in record else "-"


def _pp(record: dict[str, Any], key: str) -> str:
    return f"{record[key]:.1f}" if key in record else "-"


def _rate(record: dict[str, Any], key: str) -> str:
    """A copy bandwidth, or '-' where none was timed (graph replays: no Python runs there)."""
    return f"{record[key]:.1f}" if record.get(key) else "-"


def _spread(record: dict[str, Any]) -> str:
    """Processes, and how far apart their times were (max - min over the median)."""
    times = record.get("fwd_bwd_s_by_process", [record["fwd_bwd_s"]])
    return f"{len(times)}: {100 * (max(times) - min(times)) / record['fwd_bwd_s']:.0f}%"


def table(records: list[dict[str, Any]]) -> str:
    """The markdown table; with ``--rounds``, a last column of processes and their spread.
    Times and gaps are against the eager step without offloading; the "own step" columns give
    each gap in points of the case's own mode's step without offloading (the graphed one for a
    graphed case: the same as the eager columns for an eager case)."""
    rounds = any("fwd_bwd_s_by_process" in r for r in records)
    head = (
        "| case | peak GiB | peak | fwd-bwd s | time | floor | gap (pp) | gap, own step (pp) "
        "| floor at achieved GB/s | gap (pp) | gap, own step (pp) | offloaded GiB/step "
        "| D2H GB/s | H2D GB/s |"
        + (" processes: spread |" if rounds else "")
        + "\n"
        + "|---" * (15 if rounds else 14)
        + "|\n"
    )
    rows = []
    for r in records:
        if "peak_gib" not in r:
            why = f"rejected: {r['rejected'][0]}" if "rejected" in r else f"failed: {r['failed']}"
            rows.append(f"| {r['case']} | {why} |||||||||||||" + ("|" if rounds else ""))
            continue
        rows.append(
            f"| {r['case']} | {r['peak_gib']:.2f} | {_pct(r, 'peak_change')} | "
            f"{r['fwd_bwd_s']:.3f} | {_pct(r, 'time_change')} | {_pct(r, 'floor_time_change')} | "
            f"{_pp(r, 'gap_to_floor_pp')} | {_pp(r, 'gap_to_floor_own_step_pp')} | "
            f"{_pct(r, 'floor_achieved_time_change')} | {_pp(r, 'gap_to_achieved_floor_pp')} | "
            f"{_pp(r, 'gap_to_achieved_floor_own_step_pp')} | {r['offloaded_gib_per_step']:.2f} "
            f"| {_rate(r, 'd2h_gb_per_s')} | {_rate(r, 'h2d_gb_per_s')} |"
            + (f" {_spread(r)} |" if rounds else "")
        )
    return head + "\n".join(rows) + "\n"


def chart(records: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [r for r in records if "peak_gib" in r]
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in done:
        ax.scatter(r["fwd_bwd_s"], r["peak_gib"])
        ax.annotate(r["case"], (r["fwd_bwd_s"], r["peak_gib"]), fontsize=7)
    ax.set_xlabel("forward-backward time per step (s)")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def retable(path: Path) -> int:
    """Floors and table of a results JSON, derived again from its measured records."""
    try:
        payload = json.loads(path.read_text())
        records, bandwidth = payload["cases"], payload["copy_bandwidth"]
        microbatches = payload["microbatches"]
    except (OSError, ValueError, KeyError) as bad:
        print(f"--retable {path}: not a benchmark results JSON ({bad})", file=sys.stderr)
        return 2
    add_floors(records, bandwidth, microbatches)
    path.write_text(json.dumps(payload, indent=1))
    path.with_suffix(".md").write_text(table(records))
    print(table(records))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument(
        "--steps",
        type=int,
        default=11,
        help="first one excluded from medians (graph cases: that many replays, after warm-up)",
    )
    parser.add_argument("--precision", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--cases", default=None, help="comma-separated case names")
    parser.add_argument(
        "--recipe",
        default=None,
        help="run the cases on this recipe's policy (its model, precision, optimizer) instead "
        "of the preset's defaults; --model must name the same model",
    )
    parser.add_argument(
        "--recipe-override",
        action="append",
        default=[],
        help="an override of --recipe (repeatable), e.g. --recipe-override=policy.precision=...",
    )
    parser.add_argument(
        "--model-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a TransformerConfig field for every case of the preset (repeatable), e.g. "
        "drop-and-pad MoE dispatch, which full-iteration graphs need: "
        "--model-override moe_expert_capacity_factor=1.0 "
        "--model-override moe_pad_expert_input_to_capacity=true",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every case in this many processes, the case order reversed every other "
        "round, and report the median (the host's speed drifts during a run)",
    )
    parser.add_argument(
        "--standing-start",
        action="store_true",
        help="wait for the GPU before each step, so that the host begins the step's first "
        "forward level with it (as a step after a pause, such as the first training step "
        "after generation); by default steps follow each other and the host starts while the "
        "GPU still runs the previous step's optimizer",
    )
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument(
        "--retable",
        metavar="JSON",
        default=None,
        help="derive the floors and the table of a results JSON again from its measurements "
        "(after the bookkeeping changed), rewriting the JSON and the .md beside it; runs nothing",
    )
    parser.add_argument("--out", default="results/benchmark")
    parser.add_argument("--one-case", default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    import torch

    from nemo_rl_offload.config.model_presets import architecture_for

    if args.retable:
        return retable(Path(args.retable))
    if args.list:
        print("\n".join(cases_for(args.model)))
        return 0
    if args.one_case:
        settings = resolve_cases(args.model, [args.one_case])[args.one_case]
        vocab = architecture_for(args.model).vocab_size
        steps = args.steps
        if settings.get("cuda_graph_impl") == "full_iteration":
            steps += GRAPHS["cuda_graph_warmup_steps"] + 1  # as many replays as eager steps
        data = batches(steps, args.microbatches, args.rows, args.seq, vocab)
        return write_case_record(
            Path(args.out),
            args.one_case,
            settings,
            lambda: run_case(args.one_case, settings, args, data, torch.cuda.is_available()),
        )
    try:
        cases = resolve_cases(args.model, args.cases.split(",") if args.cases else None)
    except KeyError as unknown:
        print(
            f"--cases: unknown {unknown}; --list shows them; also fgo:MOD+MOD, "
            "CASE_graph_inflight_N, OFFLOAD_CASE_megatron_copies and OFFLOAD_CASE_megatron_hooks",
            file=sys.stderr,
        )
        return 2
    if model_overrides_refused(args):
        return 2
    if args.recipe and args.model_override:
        print("--model-override: give it in --recipe-override lines with --recipe", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"--rounds: {args.rounds}; give 1 or more", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for round_index in range(args.rounds):
        # Reversed every other round: a host that drifts over the run favours no case.
        order = list(cases) if round_index % 2 == 0 else list(reversed(cases))
        for name in order:
            record = run_case_in_subprocess(name, args, out)
            runs[name].append(record)
            # Each record as it comes: a run cut short (a time limit) keeps its finished cases.
            with (out / f"{args.model}_seq{args.seq}.cases.jsonl").open("a") as done:
                done.write(json.dumps(record) + "\n")
            shown = {k: v for k, v in record.items() if k not in ("steps", "settings", "losses")}
            print(json.dumps(shown), flush=True)
    # After the cases: this process's CUDA context and cached buffers would otherwise take GPU
    # memory from every case (benchmarks/results/2026-11-25_h100x2_long_context_3b.md, caveat).
    bandwidth = copy_bandwidth()
    records = [combine_processes(runs[name]) for name in cases]
    add_floors(records, bandwidth, args.microbatches)
    stem = f"{args.model}_seq{args.seq}"
    payload = {
        "environment": environment(),
        "command": " ".join(["python3", "benchmarks/offload_benchmark.py", *sys.argv[1:]]),
        "model": args.model,
        "recipe": args.recipe,
        "recipe_overrides": list(args.recipe_override),
        "model_overrides": parse_model_overrides(args),
        "seq": args.seq,
        "microbatches": args.microbatches,
        "rows": args.rows,
        "steps": args.steps,
        "rounds": args.rounds,
        "copy_bandwidth": bandwidth,
        "cases": records,
    }
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{stem}.md").write_text(table(records))
    chart(records, out / f"{stem}.png", f"{args.model}, seq {args.seq}")
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
