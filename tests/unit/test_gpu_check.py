"""scripts/gpu-check's bookkeeping on CPU: a part passes only when its command succeeds and its
metrics hold the steps asked for; the resume part only when the second run resumed; the record
names the code it ran. (The GPU runs themselves are the script's job on a GPU machine.)"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = runpy.run_path(str(REPO / "scripts" / "gpu-check"))
Part = GPU_CHECK["Part"]


def _writer(rows: list[dict], log: str = "") -> list[str]:
    """A command that appends ``rows`` to logs/metrics.jsonl in its part folder and prints."""
    code = (
        "import json, pathlib, sys; d = pathlib.Path(sys.argv[1]) / 'logs'; "
        "d.mkdir(parents=True, exist_ok=True); f = (d / 'metrics.jsonl').open('a'); "
        f"[f.write(json.dumps(r) + '\\n') for r in {rows!r}]; print({log!r}, file=sys.stderr)"
    )
    return [sys.executable, "-c", code]


def _part(tmp_path: Path, name: str, argv: list[str], **kwargs) -> dict:
    folder = str(tmp_path / name)
    if kwargs.get("then"):
        kwargs["then"] = [*kwargs["then"], folder]
    return GPU_CHECK["run_part"](Part(name, [*argv, folder], 60, **kwargs), tmp_path)


def test_a_part_passes_with_its_steps_and_fails_without(tmp_path: Path) -> None:
    rows = [{"phase": "train", "step": s, "loss": 0.5} for s in (1, 2)]
    assert _part(tmp_path, "ok", _writer(rows), steps=2)["passed"]
    short = _part(tmp_path, "short", _writer(rows[:1]), steps=2)
    assert not short["passed"] and "1 train rows" in short["why"]
    nan = _part(
        tmp_path, "nan", _writer([{"phase": "train", "step": 1, "loss": float("nan")}]), steps=1
    )
    assert not nan["passed"]
    failed = _part(tmp_path, "failed", [sys.executable, "-c", "raise SystemExit(3)"])
    assert not failed["passed"] and failed["exit"] == 3 and "output_tail" in failed


def test_the_resume_part_needs_the_second_run_to_resume(tmp_path: Path) -> None:
    first = _writer([{"phase": "train", "step": 1, "loss": 0.5}])
    resumed = _writer([{"phase": "train", "step": 2, "loss": 0.4}], "resumed from ckpt (step 1)")
    fresh = _writer([{"phase": "train", "step": 2, "loss": 0.4}], "started")
    assert _part(tmp_path, "a", first, steps=1, then=resumed, then_steps=2)["passed"]
    result = _part(tmp_path, "b", first, steps=1, then=fresh, then_steps=2)
    assert not result["passed"] and "resumed" in result["why"]


def test_the_record_names_the_code_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    monkeypatch.setitem(GPU_CHECK["record"].__globals__, "environment", lambda: {"device": "x"})
    names = [p.name for p in GPU_CHECK["parts"](Path("."))]
    record = GPU_CHECK["record"]({"grpo": {"passed": True}}, ["grpo"], 1.0)
    assert record["commit"] == "abc1234" and record["passed"] and not record["complete"]
    assert len(record["source_sha256"]) == 64
    failed = GPU_CHECK["record"]({n: {"passed": n != "dpo"} for n in names}, names, 1.0)
    assert failed["complete"] and not failed["passed"]
    assert not GPU_CHECK["record"]({}, [], 1.0)["passed"]


def test_without_a_gpu_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert GPU_CHECK["main"](["--only", "grpo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0]


def test_every_part_is_a_recipe_command_or_the_gpu_tests() -> None:
    parts = GPU_CHECK["parts"](Path("/tmp/w"))
    names = [p.name for p in parts]
    assert names == ["gpu_tests", "grpo", "resume", "sft", "dpo", "distillation", "planner"]
    for part in parts[1:]:
        config = Path(part.argv[part.argv.index("--config") + 1])
        assert config.exists(), config
    assert all(isinstance(arg, str) for part in parts for arg in part.argv)


def test_a_part_past_its_time_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    """A timed-out part's children (a job's Ray workers) do not outlive it."""
    import time

    pid_file = tmp_path / "child.pid"
    # A shell starts in milliseconds even on a loaded machine, well inside the part's time.
    script = f"sleep 60 & echo $! > {pid_file}; sleep 60"
    result = GPU_CHECK["run_part"](Part("slow", ["bash", "-c", script], 5), tmp_path)
    assert not result["passed"] and result["exit"] == "timeout"
    child = int(pid_file.read_text())
    for _ in range(50):  # gone, or a zombie when nothing reaps it
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the part's child {child} outlived it")


def test_lanes_run_side_by_side_only_where_the_gpu_holds_both(tmp_path: Path) -> None:
    def stamped(name: str, partner: str = "") -> list[str]:
        """Marks its start; with a partner, waits (up to 60 s) to see the partner's start too,
        which only parts running at the same time can both see; then marks its end."""
        code = (
            "import pathlib, sys, time\n"
            "d, name, partner = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]\n"
            "start = time.time(); (d / f'{name}.start').write_text(str(start))\n"
            "met = not partner\n"
            "deadline = time.time() + 60\n"
            "while not met and time.time() < deadline:\n"
            "    met = (d / f'{partner}.start').exists(); time.sleep(0.05)\n"
            "(d / f'{name}.txt').write_text(f'{start} {time.time()} {int(met)}')\n"
        )
        return [sys.executable, "-c", code, str(tmp_path), name, partner]

    parts = [
        Part("gpu_tests", stamped("gpu_tests", "grpo"), 90),
        Part("grpo", stamped("grpo", "gpu_tests"), 90),
        Part("sft", stamped("sft"), 90),
    ]
    assert GPU_CHECK["lanes"](parts, side_by_side=False) == [parts]
    lanes = GPU_CHECK["lanes"](parts, side_by_side=True)
    assert lanes == [parts[:1], parts[1:]]
    results = GPU_CHECK["run_lanes"](lanes, tmp_path)
    assert list(results) == ["gpu_tests", "grpo", "sft"]
    assert all(r["passed"] for r in results.values())
    ran = {n: [float(t) for t in (tmp_path / f"{n}.txt").read_text().split()] for n in results}
    assert ran["gpu_tests"][2] == 1 and ran["grpo"][2] == 1  # each saw the other running
    assert ran["grpo"][1] <= ran["sft"][0]  # one lane runs in order
