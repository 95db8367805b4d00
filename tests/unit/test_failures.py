"""Why a case failed (nemo_rl_offload/planning/failures.py): an out-of-memory with the sizes PyTorch
reported, else the exception's type and message, never the last line a process printed; the
benchmark's child writes it and its parent reads it, the planner records it per trial."""

from __future__ import annotations

import os
import sys
from io import StringIO
from pathlib import Path

import pytest
from support.fake_planner import graphed_records, small_costs

from nemo_rl_offload.distributed.worker_group import WorkerError
from nemo_rl_offload.planning import failures, planner

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import offload_benchmark as bench  # noqa: E402

# torch's caching allocator's message, as an H100 printed it.
OOM = (
    "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 812.00 MiB is free. Including non-PyTorch memory, this process has 78.38 GiB "
    "memory in use. Of the allocated memory 75.02 GiB is allocated by PyTorch, and 2.61 GiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
    "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
NCCL_WARNING = (
    "[rank0]:[W1125 16:02:11.123 ProcessGroupNCCL.cpp:1476] Warning: WARNING: destroy_process_"
    "group() was not called before program exit, which can leak resources."
)


def test_an_out_of_memory_keeps_the_sizes_torch_reported():
    failure = failures.describe("OutOfMemoryError", OOM)
    assert failure.oom == {
        "tried_gib": 1.5,
        "total_gib": 79.19,
        "free_gib": pytest.approx(812 / 1024),
        "in_use_gib": 78.38,
        "allocated_gib": 75.02,
        "reserved_unallocated_gib": 2.61,
    }
    assert failure.summary() == (
        "out of memory: tried to allocate 1.50 GiB; 79.19 GiB total; 0.79 GiB free; "
        "75.02 GiB allocated by PyTorch; 2.61 GiB reserved but unallocated"
    )


def test_other_errors_are_their_type_and_message():
    failure = failures.from_exception(ValueError("bad shape [2, 3]\nmore detail"))
    assert failure.oom is None
    assert failure.summary() == "ValueError: bad shape [2, 3]"


def test_stderr_gives_its_last_exception_not_its_last_line():
    stderr = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "x.py", line 3, in <module>',
            f"torch.OutOfMemoryError: {OOM}",
            NCCL_WARNING,
        ]
    )
    failure = failures.from_text(stderr)
    assert failure.type == "OutOfMemoryError" and failure.oom["tried_gib"] == 1.5
    bug = failures.from_text("Traceback ...\nKeyError: 'offload_modules'\n" + NCCL_WARNING)
    assert bug.summary() == "KeyError: 'offload_modules'"
    assert failures.from_text(NCCL_WARNING).type == "unknown"


def test_a_worker_error_is_read_from_the_workers_text():
    error = WorkerError("policy", 0, f"OutOfMemoryError: {OOM} (at module.py:12 in forward)")
    failure = failures.from_exception(error)
    assert failure.type == "OutOfMemoryError" and failure.oom["free_gib"] < 1


CHILD = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
import offload_benchmark as bench
def run():
    kind = sys.argv[2]
    if kind == "oom":  # torch.OutOfMemoryError's name and message, without importing torch
        class OutOfMemoryError(RuntimeError):
            pass
        raise OutOfMemoryError({oom!r})
    if kind == "bug":
        raise RuntimeError("the schedule lost a micro-batch")
    if kind == "ok":
        return {{"case": "c", "peak_gib": 1.0}}
    if kind == "dies":  # before it could write anything: a traceback, then a shutdown warning
        sys.stderr.write("Traceback:\\nAssertionError: rank mismatch\\n" + {warning!r} + "\\n")
        sys.stderr.flush()
        os._exit(3)
    if kind == "exits":  # the recipe's problems, as recipe_section ends a case
        raise SystemExit("policy.model_name: no such model")
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(bench.write_case_record(Path(sys.argv[1]), "c", {{"k": 1}}, run))
"""


@pytest.fixture
def child(tmp_path, monkeypatch):
    """child(kind) -> the record the benchmark's parent reads from a child that ends so."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(bench=str(REPO / "benchmarks"), oom=OOM, warning=NCCL_WARNING))
    target = tmp_path / ".case_c.json"

    def run(kind: str) -> dict:
        command = [sys.executable, str(script), str(target), kind]
        return bench.run_child(command, target, "c", {"k": 1})

    return run


def test_the_benchmark_child_reports_why_it_failed(child):
    oom = child("oom")
    assert oom["failure"]["type"] == "OutOfMemoryError"
    assert oom["failure"]["oom"]["tried_gib"] == 1.5
    assert oom["failed"].startswith("out of memory: tried to allocate 1.50 GiB; 79.19 GiB total")
    assert child("bug")["failed"] == "RuntimeError: the schedule lost a micro-batch"
    assert child("ok") == {"case": "c", "peak_gib": 1.0}
    assert child("dies")["failed"] == "AssertionError: rank mismatch"
    assert child("exits")["failed"] == "SystemExit: policy.model_name: no such model"
    assert child("killed")["failed"] == "killed: the process was killed by signal 9"
    row = bench.table([{"case": "c", "settings": {}, **child("bug")}]).splitlines()[-1]
    assert row.startswith("| c | failed: RuntimeError: the schedule lost a micro-batch |")


GRAPHS_RECIPE = str(REPO / "examples" / "configs" / "grpo_math_1B_megatron_fgo_graphs.yaml")


# An out-of-memory of this process on a shared GPU: what it had allocated (16 GiB) plus what
# it asked for is in scale with the planner tests' simulated plans (planner.Calibrator learns
# from it), while the GPU's other users hold the rest.
SHARED_GPU_OOM = OOM.replace(
    "75.02 GiB is allocated by PyTorch", "16.00 GiB is allocated by PyTorch"
)


def test_a_planner_trial_that_fails_is_reported_and_the_plan_goes_on(monkeypatch):
    offloaded: list[str] = []

    def measure(config, overrides, steps, err):
        modules = next((line for line in overrides if "offload_modules=[" in line), "")
        if modules and not offloaded:  # the first offload trial runs out of memory
            offloaded.append(modules)
            raise WorkerError("policy", 0, f"OutOfMemoryError: {SHARED_GPU_OOM} (at a.py:1 in f)")
        if any("recompute_granularity=full" in line for line in overrides):
            raise WorkerError("policy", 0, "ValueError: recompute said no (at b.py:2 in g)")
        records = graphed_records(overrides, steps)
        if any("recompute_granularity=selective" in line for line in overrides):
            for record in records:  # it fits, slowly: offload plans are tried after it
                record["fwd_bwd_time_s"] = 0.5
        return records

    monkeypatch.setattr(planner, "_measure", measure)
    monkeypatch.setattr(planner, "_layer_costs", lambda *_: small_costs())
    result = planner.plan(
        GRAPHS_RECIPE, [], budgets_gib=[19.0], steps=3, max_trials=6, err=StringIO()
    )
    (entry,) = result["plans"]
    failed = {c.name: c.failed for c in entry["tried"] if c.failed}
    assert failed["full recompute"] == "ValueError: recompute said no (at b.py:2 in g)"
    (first,) = [c for c in entry["tried"] if c.modules and c.failed]
    assert failed[first.name].startswith("out of memory: tried to allocate 1.50 GiB")
    assert entry["chosen"] is not None and entry["chosen"].name not in failed
    out = StringIO()
    planner.format_plan(result, out)
    assert "failed: out of memory: tried to allocate 1.50 GiB" in out.getvalue()
    tried = {t["name"]: t for t in planner.as_json(result)["plans"][0]["tried"]}
    assert tried[first.name]["failure"]["oom"]["total_gib"] == 79.19


def test_a_failed_profile_ends_the_plan_with_its_reason(monkeypatch):
    def measure(config, overrides, steps, err):
        raise WorkerError("policy", 0, f"OutOfMemoryError: {OOM}")

    monkeypatch.setattr(planner, "_measure", measure)
    monkeypatch.setattr(planner, "_layer_costs", lambda *_: small_costs())
    with pytest.raises(planner.ProfileFailed, match="without offloading or recompute: out of"):
        planner.plan(GRAPHS_RECIPE, [], budgets_gib=[19.0], steps=3, err=StringIO())
