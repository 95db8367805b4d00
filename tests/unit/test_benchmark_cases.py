"""The benchmark's case names (benchmarks/offload_benchmark.py: resolve_cases): the matrix, and
the names built from it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import offload_benchmark as bench  # noqa: E402


def test_graph_cases_default_to_max_inflight_4_and_take_any_cap():
    cases = bench.resolve_cases("llama-1b", ["fgo_all5_graph", "fgo_attn_qkv_graph_inflight_2"])
    assert list(cases) == ["no_offload", "fgo_all5_graph", "fgo_attn_qkv_graph_inflight_2"]
    assert cases["fgo_all5_graph"]["fine_grained_offloading_max_inflight_offloads"] == 4
    graphed = cases["fgo_attn_qkv_graph_inflight_2"]
    assert graphed["cuda_graph_impl"] == "full_iteration"
    assert graphed["fine_grained_offloading_max_inflight_offloads"] == 2
    assert graphed["offload_modules"] == ["qkv_linear", "core_attn", "attn_proj"]


@pytest.mark.parametrize("key", list(bench.RUNTIME_CHOICES))
def test_megatron_handler_cases_are_built_from_offload_cases_and_compose_with_graphs(key):
    name = f"fgo:core_attn+attn_proj_{key}_graph_inflight_4"
    settings = bench.resolve_cases("llama-1b", [name])[name]
    assert settings[key] is True
    assert settings["offload_modules"] == ["core_attn", "attn_proj"]
    assert settings["fine_grained_offloading_max_inflight_offloads"] == 4
    section = bench.section_for("llama-1b", 128, settings)  # not a recipe key
    assert key not in section["megatron_cfg"]


def test_both_megatron_handler_suffixes_compose():
    name = "fgo_attn_pair_megatron_copies_megatron_hooks"
    settings = bench.resolve_cases("llama-1b", [name])[name]
    assert settings[bench.MEGATRON_COPIES] is settings[bench.MEGATRON_HOOKS] is True


@pytest.mark.parametrize(
    ("key", "choice"),
    [
        (bench.MEGATRON_COPIES, "strided_copies"),
        (bench.MEGATRON_HOOKS, "lean_hooks"),
        (bench.PER_TENSOR_COPIES, "one_copy_per_storage"),
    ],
)
def test_a_megatron_handler_case_turns_off_only_its_runtime_choice(key, choice):
    from nemo_rl_offload.offload.runtime import OffloadRuntime

    config = SimpleNamespace(fine_grained_activation_offloading=False)
    worker = SimpleNamespace(runtime=OffloadRuntime(config))
    bench.use_megatron_handler(worker, {key: True})
    assert getattr(worker.runtime.choices, choice) is False
    for other in (c for k, c in bench.RUNTIME_CHOICES.items() if k != key):
        assert getattr(worker.runtime.choices, other) is True
    untouched = SimpleNamespace(runtime=OffloadRuntime(config))
    bench.use_megatron_handler(untouched, {})  # a case without a suffix
    assert all(getattr(untouched.runtime.choices, c) for c in bench.RUNTIME_CHOICES.values())


@pytest.mark.parametrize(
    "name",
    ["recompute_full_megatron_copies", "no_offload_megatron_hooks", "fgo_al5", "no_offload_x"],
)
def test_unknown_or_meaningless_names_are_refused(name):
    with pytest.raises(KeyError):
        bench.resolve_cases("llama-1b", [name])


def test_the_default_run_graphs_at_max_inflight_4_and_uses_the_runtimes_own_copies():
    matrix = bench.resolve_cases("llama-1b", None)
    assert not any(key in settings for settings in matrix.values() for key in bench.RUNTIME_CHOICES)
    graphed = {
        name: settings["fine_grained_offloading_max_inflight_offloads"]
        for name, settings in matrix.items()
        if settings.get("cuda_graph_impl") == "full_iteration"
        and settings.get("fine_grained_activation_offloading")
    }
    assert graphed and all(
        cap == (2 if name.endswith("_inflight_2") else 4) for name, cap in graphed.items()
    ), graphed


def test_dense_matrix_offloads_the_mlp_and_the_rules_accept_it():
    """The dense MLP's offload points are cases of the dense matrix only (refused on experts)."""
    dense = bench.cases_for("llama-1b")
    assert dense["fgo_all5_mlp"]["offload_modules"] == bench.DENSE_FIVE + bench.DENSE_MLP
    for name in ("fgo_mlp", "fgo_mlp_act", "fgo_all5_mlp"):
        assert bench.check_section(bench.section_for("llama-1b", 4096, dense[name])) == []
    assert not any(name.startswith("fgo_mlp") for name in bench.cases_for("moe-1b"))


def test_dense_matrix_recomputes_the_layer_selectively_and_the_rules_accept_it():
    """Selective recompute of the norms, the activation and the MLP (no Transformer Engine):
    dense cases only (mlp and mlp_act are refused on experts)."""
    dense = bench.cases_for("llama-1b")
    names = [n for n in dense if "recompute_" in n and n != "recompute_full"]
    assert dense["recompute_cheap"]["recompute_modules"] == ["layernorm", "mlp_act"]
    for name in names:
        assert bench.check_section(bench.section_for("llama-1b", 4096, dense[name])) == [], name
    assert not any("recompute_mlp" in n for n in bench.cases_for("moe-1b"))


def test_partial_full_recompute_cases_recompute_the_first_n_layers_and_the_rules_accept_them():
    cases = bench.resolve_cases("llama-1b", ["recompute_block_6"])
    assert cases["recompute_block_6"] == {
        "activation_checkpointing": True,
        "recompute_method": "block",
        "recompute_num_layers": 6,
    }
    assert (
        bench.check_section(bench.section_for("llama-1b", 4096, cases["recompute_block_6"])) == []
    )


def test_mixed_cases_name_offload_recompute_and_fraction_and_unknown_parts_are_refused():
    """A planner's choice is a case by name: offload modules, selective recompute beside them
    and the offload fraction; the rules accept it; a part that is none of these is unknown."""
    name = "fgo:core_attn+attn_proj__rc:layernorm+mlp_act__frac:0.5"
    settings = bench.resolve_cases("llama-1b", [name])[name]
    assert settings["offload_modules"] == ["core_attn", "attn_proj"]
    assert settings["recompute_modules"] == ["layernorm", "mlp_act"]
    assert settings["activation_offload_fraction"] == 0.5
    assert bench.check_section(bench.section_for("llama-1b", 4096, settings)) == []
    alone = bench.resolve_cases("llama-1b", ["rc:layernorm"])["rc:layernorm"]
    assert alone["recompute_modules"] == ["layernorm"] and "offload_modules" not in alone
    chunked = "fgo:core_attn__rc:layernorm__lp:2048"
    settings = bench.resolve_cases("llama-1b", [chunked])[chunked]
    section = bench.section_for("llama-1b", 4096, settings)
    assert section["logprob_chunk_size"] == 2048
    assert "logprob_chunk_size" not in section["megatron_cfg"]
    assert bench.check_section(section) == []
    output = "fgo:core_attn+mlp_norm__mfrac:mlp_norm=0.5__lpo:1024"
    settings = bench.resolve_cases("llama-1b", [output])[output]
    section = bench.section_for("llama-1b", 4096, settings)
    assert section["logprob_chunk_size"] == 1024
    assert section["megatron_cfg"]["chunked_output_layer"] is True
    assert section["megatron_cfg"]["activation_offload_fraction_by_module"] == {"mlp_norm": 0.5}
    assert bench.check_section(section) == []
    for bad in ("fgo:core_attn__mfrac:attn_proj", "fgo:core_attn__lpo:many"):
        with pytest.raises(KeyError, match=bad.split("__")[1]):
            bench.resolve_cases("llama-1b", [bad])
    plain = bench.section_for(
        "llama-1b", 4096, bench.resolve_cases("llama-1b", ["lp:512"])["lp:512"]
    )
    assert plain["logprob_chunk_size"] == 512
    assert "offload_modules" not in plain["megatron_cfg"]
    for bad in ("fgo:core_attn__frac:half", "fgo:core_attn__xx:1", "rc:", "lp:half", "fp8:"):
        with pytest.raises(KeyError):
            bench.resolve_cases("llama-1b", [bad])


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_an_fp8_case_part_turns_on_nemo_rls_fp8_keys_and_validates(recipe):
    name = f"fgo:core_attn__rc:layernorm+mlp_act__fp8:{recipe}"
    section = bench.section_for("llama-1b", 4096, bench.resolve_cases("llama-1b", [name])[name])
    assert section["megatron_cfg"]["fp8_cfg"] == {
        "enabled": True,
        "fp8": "e4m3",
        "fp8_recipe": recipe,
        "fp8_param": False,
    }
    assert bench.check_section(section) == []
    wrong = bench.section_for(
        "llama-1b", 4096, bench.resolve_cases("llama-1b", ["fp8:delayed"])["fp8:delayed"]
    )
    assert any("fp8_recipe" in line for line in bench.check_section(wrong))


DROP_AND_PAD = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}


def test_moe_graph_cases_run_only_with_drop_and_pad_dispatch():
    """The MoE matrix graphs its expert sets too; the rules refuse them (reported, not run)
    unless every case gets drop-and-pad dispatch through the model overrides."""
    matrix = bench.cases_for("moe-1b")
    graphed = [name for name, s in matrix.items() if s.get("cuda_graph_impl") == "full_iteration"]
    assert {"fgo_experts_graph", "fgo_attn_pair_experts_graph", "no_offload_graph"} <= set(graphed)
    for overrides, refused in ((None, True), (DROP_AND_PAD, False)):
        for name in graphed:
            section = bench.section_for("moe-1b", 4096, matrix[name], model_overrides=overrides)
            assert section["megatron_cfg"]["model_overrides"]["moe_grouped_gemm"] is True
            errors = bench.check_section(section)
            assert bool(errors) is refused, (name, errors)


@pytest.mark.parametrize(
    ("lines", "parsed"),
    [
        (["moe_expert_capacity_factor=1.25"], {"moe_expert_capacity_factor": 1.25}),
        (["moe_pad_expert_input_to_capacity=true"], {"moe_pad_expert_input_to_capacity": True}),
        ([" a = x ", "b=2"], {"a": "x", "b": 2}),
    ],
)
def test_model_override_values_are_read_as_recipe_override_values(lines, parsed):
    assert bench.parse_model_overrides(SimpleNamespace(model_override=lines)) == parsed


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("moe_expert_capacity_factor", "write KEY=VALUE"),
        ("=1.0", "write KEY=VALUE"),
        ("moe_layer_freq=[1, 0", "value '[1, 0'"),
    ],
)
def test_a_malformed_model_override_is_refused_in_one_line(line, says, capsys):
    assert bench.main(["--model-override", line, "--cases", "no_offload"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_a_recipe_case_runs_with_the_recipes_worker_environment(monkeypatch):
    """The child process takes the recipe's megatron_cfg.env_vars (e.g. the CUDA allocator's
    configuration) before it builds the worker, as the recipe's Ray workers get them."""
    import argparse

    seen: dict[str, str | None] = {}

    class Built(Exception):
        pass

    def build_worker(section, on_gpu):
        seen["alloc"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        raise Built

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(bench, "build_worker", build_worker)
    args = argparse.Namespace(
        recipe=str(
            Path(__file__).resolve().parents[2] / "examples/configs/grpo_math_1B_megatron.yaml"
        ),
        recipe_override=['policy.megatron_cfg.env_vars={PYTORCH_CUDA_ALLOC_CONF: "x:y"}'],
        model="llama-1b",
        seq=256,
    )
    with pytest.raises(Built):
        bench.run_case("no_offload", {}, args, [], on_gpu=False)
    assert seen["alloc"] == "x:y"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


@pytest.mark.parametrize("tokens", [8192, 16384, 32768, 4096])
def test_the_long_context_matrix_default_cases_are_accepted_by_the_rules(tokens):
    """Every default case of benchmarks/long_context_matrix.sh at each length resolves to
    settings that the offload rules accept on the matrix's recipe (the 3B shape on the 1B
    Megatron recipe), so that a GPU run of the defaults measures every case it names."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "long_context_matrix.sh"
    shown = subprocess.run(
        [
            "bash",
            "-c",
            f'source <(sed -n "/^default_cases()/,/^}}/p" {script}); default_cases {tokens}',
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    names = shown.split(",")
    assert len(names) >= 4 and "recompute_full" in names
    shape = {
        "num_layers": 28,
        "hidden_size": 3072,
        "ffn_hidden_size": 8192,
        "num_attention_heads": 24,
        "num_query_groups": 8,
    }
    overrides = [f"++policy.megatron_cfg.model_overrides.{k}={v}" for k, v in shape.items()]
    recipe = str(root / "examples" / "configs" / "grpo_math_1B_megatron.yaml")
    for name, settings in bench.resolve_cases("llama-1b", names).items():
        section = bench.recipe_section(recipe, overrides, "llama-1b", tokens, settings)
        assert bench.check_section(section) == [], name


@pytest.mark.skipif(not Path("/proc/thread-self/status").exists(), reason="Linux /proc only")
def test_a_step_records_its_host_threads_cpu_seconds_and_switches():
    before = bench._main_thread_counters()
    sum(range(200_000))  # some CPU work on this thread
    share = bench._host_share(before, bench._main_thread_counters())
    assert share["host_thread_cpu_s"] > 0
    assert share["host_involuntary_switches"] >= 0 and share["host_voluntary_switches"] >= 0
    assert share["host_cpu"] >= 0
    assert bench._host_share(None, before) == {}  # off Linux: nothing, not zeros


@pytest.mark.parametrize("standing_start", [False, True])
def test_a_standing_start_waits_for_the_gpu_before_each_step(monkeypatch, standing_start):
    """--standing-start synchronises before every step (and says so in the record); by
    default the steps follow each other without waiting. The child process gets the flag."""
    import argparse

    import torch

    waits: list[int] = []
    trained: list[int] = []

    class Worker:
        def train(self, step, loss):
            trained.append(len(waits))
            return {"fwd_bwd_time_s": 1.0, "loss": 2.0, "num_tokens": 1.0}

        def close(self):
            pass

    monkeypatch.setattr(bench, "build_worker", lambda section, on_gpu: Worker())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: waits.append(1))
    args = argparse.Namespace(
        recipe=None,
        recipe_override=[],
        model="tiny-dense",
        seq=32,
        precision="float32",
        model_override=[],
        standing_start=standing_start,
    )
    record = bench.run_case("fgo_norms", {}, args, [[], [], []], on_gpu=True)
    assert record["standing_start"] is standing_start
    assert trained == ([1, 2, 3] if standing_start else [0, 0, 0])
    captured: list[list[str]] = []
    monkeypatch.setattr(bench, "run_child", lambda command, *rest: captured.append(command))
    args.rows, args.steps, args.microbatches = 1, 3, 2
    bench.run_case_in_subprocess("fgo_norms", args, Path("/tmp"))
    assert ("--standing-start" in captured[0]) is standing_start
