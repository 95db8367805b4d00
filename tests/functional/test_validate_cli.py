"""``nemo-rl-offload validate``: what a user sees, the exit code, and where each line goes.

Most tests call the CLI in-process (fast); the subprocess tests at the end prove the real console
behaviour: exit codes and no traceback on stderr.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest

from nemo_rl_offload.cli import main
from nemo_rl_offload.config import megatron_settings

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
FGO = str(CONFIGS / "grpo_math_1B_megatron_fgo.yaml")
PLAIN = str(CONFIGS / "grpo_math_1B.yaml")
MCFG = "policy.megatron_cfg"
OFFLOAD_KEYS = (*megatron_settings.FGO_KEYS, *megatron_settings.CUDA_GRAPH_KEYS)
# A problem line starts with where it is: a dotted recipe path.
DOTTED_PROBLEM = re.compile(r"^[A-Za-z_]\w*(\.\w+)+: \S")


def validate(config: str | Path, *overrides: str) -> tuple[int, list[str], list[str]]:
    """Run ``validate`` in-process; return the exit code and the stdout and stderr lines."""
    out, err = StringIO(), StringIO()
    code = main(["validate", "--config", str(config), *overrides], out=out, err=err)
    return code, out.getvalue().splitlines(), err.getvalue().splitlines()


def setting_line(out: list[str], name: str) -> str:
    """The line of the offload settings table for ``name``."""
    matches = [line for line in out if re.match(rf"^\s+{name}\s", line)]
    assert len(matches) == 1, f"{name}: expected one settings line in:\n" + "\n".join(out)
    return matches[0]


# --------------------------------------------------------------------------- valid recipes


def test_valid_fgo_recipe_prints_settings_and_their_sources() -> None:
    code, out, err = validate(FGO)

    assert code == 0, err
    # The estimate's one warning: sampling 512 sequences of 4096 tokens in one call needs a
    # KV cache larger than a GPU (test_the_memory_estimate_is_printed_...).
    assert [line for line in err if not line.startswith("warning: memory estimate: ")] == []
    assert out[-1] == "valid"
    assert out[0] == f"recipe: {FGO} (algorithm: grpo)"
    assert "policy: offload settings (transformer_impl " in "\n".join(out)
    assert re.fullmatch(
        rf"\s+offload_modules\s+\[core_attn, attn_proj\]\s+# {MCFG}\.offload_modules",
        setting_line(out, "offload_modules"),
    )
    assert re.fullmatch(
        rf"\s+fine_grained_activation_offloading\s+true\s+# {MCFG}\."
        "fine_grained_activation_offloading",
        setting_line(out, "fine_grained_activation_offloading"),
    )
    # Every knob is shown with where its value came from; this recipe sets them all.
    for name in OFFLOAD_KEYS:
        assert setting_line(out, name).endswith(f"# {MCFG}.{name}")


def test_the_memory_estimate_is_printed_and_warns_when_the_gpu_is_too_small() -> None:
    code, out, err = validate(PLAIN, "--gpu-memory-gib", "80")
    assert code == 0, err
    assert out[-1] == "valid"
    text = "\n".join(out)
    assert "memory estimate per GPU" in text
    for part in ("weights", "gradient buffers", "optimizer state", "activations"):
        assert f"  policy {part}: " in text, part
    assert out[-2].startswith("  peak: ") and out[-2].endswith("(--gpu-memory-gib)")
    assert not [line for line in err if "memory estimate" in line]
    code, out, err = validate(PLAIN, "--gpu-memory-gib", "4")
    assert code == 0  # a warning, not an error: the estimate may be wrong
    warning = [line for line in err if line.startswith("warning: memory estimate: ")]
    assert len(warning) == 1 and "more than the GPU's 4.00 GiB" in warning[0], err
    code, out, err = validate(PLAIN, "--no-estimate")
    assert "memory estimate per GPU" not in "\n".join(out)


def test_offload_runtime_settings_are_shown_resolved_when_offloading_is_on() -> None:
    # The exemplar packs: every pack has one length, its only bucket.
    code, out, err = validate(FGO)
    assert code == 0, err
    assert re.fullmatch(
        r"\s+offload_sequence_length_buckets\s+\[8192\]\s+"
        r"# policy\.sequence_packing\.train_mb_tokens \(every pack has this length\)",
        setting_line(out, "offload_sequence_length_buckets"),
    )
    unpacked = "policy.sequence_packing.enabled=false"
    code, out, err = validate(FGO, unpacked, "policy.make_sequence_length_divisible_by=1024")
    assert code == 0, err
    assert re.fullmatch(
        r"\s+offload_sequence_length_buckets\s+\[1024, 2048, 3072, 4096\]\s+"
        r"# default \(up to max_total_sequence_length\)",
        setting_line(out, "offload_sequence_length_buckets"),
    )
    assert setting_line(out, "offload_host_memory_budget_gib").endswith("# default")
    code, out, err = validate(
        FGO,
        unpacked,
        f"++{MCFG}.offload_sequence_length_buckets=[2048,4096]",
        f"++{MCFG}.offload_host_memory_budget_gib=24",
    )
    assert code == 0, err
    assert setting_line(out, "offload_sequence_length_buckets").endswith(
        f"# {MCFG}.offload_sequence_length_buckets"
    )
    assert re.fullmatch(
        rf"\s+offload_host_memory_budget_gib\s+24\s+# {MCFG}\.offload_host_memory_budget_gib",
        setting_line(out, "offload_host_memory_budget_gib"),
    )
    code, out, _ = validate(PLAIN)
    assert code == 0
    assert not any("offload_sequence_length_buckets" in line for line in out)


def test_unset_knob_shows_megatron_default_as_its_source() -> None:
    code, out, err = validate(
        FGO, f"~{MCFG}.cuda_graph_warmup_steps", f"~{MCFG}.min_offloaded_tensor_size"
    )

    assert code == 0, err
    assert re.fullmatch(
        r"\s+cuda_graph_warmup_steps\s+3\s+# megatron-core default",
        setting_line(out, "cuda_graph_warmup_steps"),
    )
    assert re.fullmatch(
        r"\s+min_offloaded_tensor_size\s+1048576\s+# megatron-core default",
        setting_line(out, "min_offloaded_tensor_size"),
    )
    assert setting_line(out, "offload_modules").endswith(f"# {MCFG}.offload_modules")


def test_override_changes_what_is_validated_and_shown() -> None:
    code, out, err = validate(FGO, f"{MCFG}.offload_modules=[core_attn]")

    assert code == 0, err
    assert re.fullmatch(
        rf"\s+offload_modules\s+\[core_attn\]\s+# {MCFG}\.offload_modules",
        setting_line(out, "offload_modules"),
    )


# --------------------------------------------------------------------------- invalid recipes


def test_override_that_breaks_a_rule_exits_2_with_the_path_first() -> None:
    code, out, err = validate(FGO, f"{MCFG}.offload_modules=[attn_proj]")

    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"{MCFG}.offload_modules: "), err
    assert "core_attn" in err[0]
    assert "valid" not in out


def test_offload_modules_as_one_string_is_one_line_not_split_into_letters() -> None:
    code, out, err = validate(FGO, f"{MCFG}.offload_modules=core_attn")

    assert code == 2
    assert err == [
        f"{MCFG}.offload_modules: must be a list, not a single string (got: 'core_attn'); "
        "write [core_attn]"
    ]
    assert "valid" not in out


def test_several_mistakes_are_reported_together() -> None:
    code, out, err = validate(
        FGO,
        f"{MCFG}.offload_modules=[attn_proj]",
        f"{MCFG}.activation_offload_fraction=half",
        f"++{MCFG}.fine_grained_activation_offload=true",
        "~checkpointing.checkpoint_dir",
    )

    assert code == 2
    assert all(DOTTED_PROBLEM.match(line) for line in err), err
    assert sorted(line.split(": ", 1)[0] for line in err) == sorted(
        [
            f"{MCFG}.offload_modules",
            f"{MCFG}.activation_offload_fraction",
            f"{MCFG}.fine_grained_activation_offload",
            "checkpointing.checkpoint_dir",
        ]
    )
    assert "valid" not in out
    assert not any("offload settings" in line for line in out)


# --------------------------------------------------------------------------- warnings


def _assert_warning_only(code: int, out: list[str], err: list[str], path: str) -> None:
    assert code == 0, err
    assert out[-1] == "valid"
    assert err, "expected a warning on stderr"
    assert all(line.startswith("warning: ") for line in err), err
    assert not any(line.startswith("warning: warning:") for line in err), err
    assert any(line.startswith(f"warning: {path}: ") for line in err), err


def test_offload_modules_with_offloading_off_warns() -> None:
    code, out, err = validate(PLAIN, f"{MCFG}.offload_modules=[core_attn]")
    _assert_warning_only(code, out, err, f"{MCFG}.offload_modules")


def test_delay_offload_without_cuda_graphs_warns() -> None:
    code, out, err = validate(PLAIN, f"{MCFG}.delay_offload_until_cuda_graph=true")
    _assert_warning_only(code, out, err, f"{MCFG}.delay_offload_until_cuda_graph")


# --------------------------------------------------------------------------- loading mistakes


def test_missing_recipe_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    code, out, err = validate(missing)
    assert code == 2
    assert err == [f"{missing}: no such recipe file"]
    assert out == []


def test_yaml_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("grpo:\n  seed: 1\npolicy:\n  offload_modules: [core_attn\n  x: 1\n")
    code, out, err = validate(broken)
    assert code == 2
    assert len(err) == 1, err
    assert re.match(rf"^{re.escape(str(broken))}:5:\d+: \S", err[0]), err
    assert out == []


def test_bad_override_syntax() -> None:
    code, out, err = validate(PLAIN, "policy.x=[1,")
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("override 'policy.x=[1,': "), err
    assert out == []


def test_override_of_a_missing_key_suggests_the_right_one() -> None:
    code, out, err = validate(PLAIN, f"{MCFG}.ofload_modules=[core_attn]")
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"{MCFG}.ofload_modules=[core_attn]: no such key 'ofload_modules'")
    assert "did you mean 'offload_modules'?" in err[0]
    assert out == []


# --------------------------------------------------------------------------- real console

_CONSOLE_RUNS = {
    "valid": ["--config", FGO],
    "invalid": [
        "--config",
        FGO,
        f"{MCFG}.offload_modules=[attn_proj]",
        f"{MCFG}.activation_offload_fraction=half",
    ],
    "missing": ["--config", str(REPO / "examples" / "configs" / "no_such_recipe.yaml")],
}


@pytest.fixture(scope="module", autouse=True)
def _console_processes() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Start ``python -m nemo_rl_offload.cli validate`` for each case when this module starts:
    each process imports megatron-core, which takes seconds, so they run beside the in-process
    tests instead of after them."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = {
        name: subprocess.Popen(
            [sys.executable, "-m", "nemo_rl_offload.cli", "validate", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in _CONSOLE_RUNS.items()
    }
    yield started
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.fixture(scope="module")
def console(
    _console_processes: dict[str, subprocess.Popen[str]],
) -> dict[str, subprocess.CompletedProcess[str]]:
    finished = {}
    for name, process in _console_processes.items():
        stdout, stderr = process.communicate(timeout=300)
        finished[name] = subprocess.CompletedProcess(
            process.args, process.returncode, stdout, stderr
        )
    return finished


def test_console_valid_recipe(console: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = console["valid"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "valid"
    assert "Traceback" not in run.stderr


def test_console_invalid_recipe(console: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = console["invalid"]
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    assert any(line.startswith(f"{MCFG}.offload_modules: ") for line in lines), run.stderr
    assert any(line.startswith(f"{MCFG}.activation_offload_fraction: ") for line in lines)
    assert "valid" not in run.stdout.splitlines()


def test_console_missing_recipe_is_one_line(
    console: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    run = console["missing"]
    assert run.returncode == 2
    assert run.stderr.splitlines() == [f"{_CONSOLE_RUNS['missing'][1]}: no such recipe file"]
    assert run.stdout == ""


# --------------------------------------------------------------------------- CUDA graphs

GRAPHS = str(CONFIGS / "grpo_math_1B_megatron_fgo_graphs.yaml")


def test_graphs_recipe_is_valid_and_shows_the_buckets_its_steps_are_padded_to() -> None:
    code, out, err = validate(GRAPHS)
    assert code == 0, err
    assert re.search(r"cuda_graph_impl\s+full_iteration", setting_line(out, "cuda_graph_impl"))
    assert "1024" in setting_line(out, "offload_sequence_length_buckets")


def test_graphs_recipe_without_the_inflight_cap_is_refused_before_start() -> None:
    code, out, err = validate(GRAPHS, f"~{MCFG}.fine_grained_offloading_max_inflight_offloads")
    assert code == 2
    assert err[0].startswith(f"{MCFG}.fine_grained_offloading_max_inflight_offloads: "), err
    assert "full_iteration" in err[0] and "set it to 4" in err[0]


def test_graphs_without_offloading_still_show_their_buckets() -> None:
    code, out, err = validate(PLAIN, f"{MCFG}.cuda_graph_impl=full_iteration")
    assert code == 0, err
    assert setting_line(out, "offload_sequence_length_buckets")
    assert not any("offload_host_memory_budget_gib" in line for line in out)


def test_a_plan_budget_is_shown_with_what_it_does() -> None:
    code, out, err = validate(PLAIN, f"+{MCFG}.offload_plan_budget_gib=19")
    assert code == 0, err
    assert "planned at start" in setting_line(out, "offload_plan_budget_gib")
