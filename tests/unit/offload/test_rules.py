"""Every offload rule, tested both ways: a recipe it must reject (with the path and the fix in
the message) and the nearest recipe it must accept."""

from __future__ import annotations

import pytest
from support.offload_cases import ACCEPTED, FGO, MOE_TE, REJECTED
from support.policies import NO_TE, TE_2_9, TE_2_10, P, check, make_policy

from nemo_rl_offload.config.model_presets import architecture_for
from nemo_rl_offload.models.transformer_config import (
    build_transformer_config,
    transformer_config_kwargs,
)


@pytest.mark.parametrize(
    "model,caps,settings,path,fragments",
    [case[1:] for case in REJECTED],
    ids=[case[0] for case in REJECTED],
)
def test_rejected_with_path_and_fix(model, caps, settings, path, fragments):
    findings = check(model, caps, **settings)
    matching = [line for line in findings.errors if line.startswith(f"{path}: ")]
    assert matching, f"no error at {path}; errors were: {findings.errors}"
    for fragment in fragments:
        assert any(fragment in line for line in matching), (fragment, matching)


@pytest.mark.parametrize(
    "model,caps,settings", [case[1:] for case in ACCEPTED], ids=[case[0] for case in ACCEPTED]
)
def test_accepted(model, caps, settings):
    findings = check(model, caps, **settings)
    assert findings.errors == []


def test_all_violations_reported_together():
    findings = check(
        "tiny-dense",
        NO_TE,
        **FGO,
        offload_modules=["attn_proj", "expert_fc1", "bogus"],
        activation_offload_fraction=2.0,
        cuda_graph_impl="full_iteration",
    )
    text = "\n".join(findings.errors)
    for fragment in (
        "'attn_proj' needs",
        "no experts",
        "unknown module 'bogus'",
        "between 0 and 1",
        "full_iteration CUDA graphs",
    ):
        assert fragment in text
    assert len(findings.errors) >= 5


@pytest.mark.parametrize(
    "settings,path,fragment",
    [
        ({"offload_modules": ["core_attn"]}, f"{P}.offload_modules", "ignored because"),
        (
            {"fine_grained_activation_offloading": False, "offload_modules": ["core_attn"]},
            f"{P}.offload_modules",
            "ignored because",
        ),
        (
            {**FGO, "offload_modules": ["core_attn"], "activation_offload_fraction": 0.0},
            f"{P}.activation_offload_fraction",
            "nothing will be offloaded",
        ),
        (
            {**FGO, "offload_modules": ["core_attn", "core_attn"]},
            f"{P}.offload_modules",
            "listed more than once",
        ),
        (
            {**FGO, "offload_modules": ["core_attn"], "delay_offload_until_cuda_graph": True},
            f"{P}.delay_offload_until_cuda_graph",
            "no effect without Transformer Engine layer graphs (cuda_graph_impl is none",
        ),
        (
            {
                **FGO,
                "offload_modules": ["core_attn"],
                "delay_offload_until_cuda_graph": True,
                "cuda_graph_impl": "full_iteration",
                "fine_grained_offloading_max_inflight_offloads": 1,
            },
            f"{P}.delay_offload_until_cuda_graph",
            "(cuda_graph_impl is full_iteration",
        ),
        (
            {**FGO, "offload_modules": ["core_attn"], "delta_offload_bytes_across_pp_ranks": 1024},
            f"{P}.delta_offload_bytes_across_pp_ranks",
            "pipeline_model_parallel_size 1",
        ),
        (
            {"recompute_modules": ["core_attn"]},
            f"{P}.recompute_modules",
            "activation_checkpointing is false",
        ),
        (
            {
                **FGO,
                "offload_modules": ["core_attn"],
                "activation_offload_fraction_placement": "earliest",
            },
            f"{P}.activation_offload_fraction_placement",
            "no effect while activation_offload_fraction is 1",
        ),
    ],
    ids=[
        "modules_while_off",
        "modules_while_explicitly_off",
        "fraction_zero",
        "duplicates",
        "delay_without_graphs",
        "delay_with_full_iteration",
        "delta_without_pp",
        "recompute_while_off",
        "placement_without_fraction",
    ],
)
def test_warnings_not_errors(settings, path, fragment):
    findings = check("tiny-dense", NO_TE, **settings)
    assert findings.errors == []
    assert any(
        line.startswith(f"warning: {path}: ") and fragment in line for line in findings.warnings
    ), findings.warnings


@pytest.mark.parametrize(
    "settings",
    [
        {"fine_grained_activation_offloading": False, "offload_modules": None},
        {**FGO, "offload_modules": ["core_attn"], "activation_offload_fraction": 0.5},
        {
            **FGO,
            "offload_modules": ["core_attn"],
            "activation_offload_fraction": 0.5,
            "activation_offload_fraction_placement": "earliest",
        },
        {
            **FGO,
            "offload_modules": ["core_attn"],
            "cuda_graph_impl": "full_iteration",
            "fine_grained_offloading_max_inflight_offloads": 1,
        },
        {"recompute_granularity": "full", "recompute_modules": None},
    ],
    ids=[
        "off_and_null",
        "fraction_half",
        "fraction_half_earliest",
        "full_iteration_graphs",
        "nemo_rl_default_recompute",
    ],
)
def test_no_warning_for_sensible_settings(settings):
    # A big model at a long sequence: no size warning either.
    findings = check("llama-1b", NO_TE, **settings)
    assert findings.errors == [] and findings.warnings == []


def test_expert_inputs_under_min_size_warn():
    # tiny-moe: 4096 tokens x top-2 x hidden 64 = 524,288 elements < 1,048,576.
    findings = check("tiny-moe", TE_2_10, **FGO, **MOE_TE, offload_modules=["expert_fc1"])
    assert findings.errors == []
    (line,) = [w for w in findings.warnings if "min_offloaded_tensor_size" in w]
    assert "expert_fc1 ~524,288" in line and "lower min_offloaded_tensor_size" in line
    lowered = check(
        "tiny-moe",
        TE_2_10,
        **FGO,
        **MOE_TE,
        offload_modules=["expert_fc1"],
        min_offloaded_tensor_size=524288,
    )
    assert not [w for w in lowered.warnings if "min_offloaded_tensor_size" in w]


def test_min_size_warning_counts_only_small_modules():
    # llama-1b at 4096 tokens, TP 2 without sequence parallel: attn_norm inputs stay whole
    # (8,388,608 elements) while core_attn's are split (4,194,304).
    findings = check(
        "llama-1b",
        NO_TE,
        **FGO,
        offload_modules=["core_attn", "attn_norm"],
        min_offloaded_tensor_size=6_000_000,
        tensor_model_parallel_size=2,
    )
    (line,) = [w for w in findings.warnings if "min_offloaded_tensor_size" in w]
    assert "core_attn ~4,194,304" in line and "attn_norm" not in line


def test_mlp_inputs_under_min_size_warn_by_their_own_sizes():
    # tiny-dense at 4096 tokens: fc1's input is 4096 x hidden 128 = 524,288 elements, under the
    # default minimum; the gated activation's (2 x ffn 352) and fc2's (ffn) are over it.
    findings = check("tiny-dense", NO_TE, **FGO, offload_modules=["mlp_fc1", "mlp_act", "mlp_fc2"])
    assert findings.errors == []
    (line,) = [w for w in findings.warnings if "min_offloaded_tensor_size" in w]
    assert "mlp_fc1 ~524,288" in line and "mlp_act" not in line and "mlp_fc2" not in line
    lowered = check(
        "tiny-dense",
        NO_TE,
        **FGO,
        offload_modules=["mlp_fc1"],
        min_offloaded_tensor_size=524288,
    )
    assert not [w for w in lowered.warnings if "min_offloaded_tensor_size" in w]


def test_fgo_on_cpu_is_reported_not_dropped():
    findings = check("tiny-dense", NO_TE, gpus=0, **FGO, offload_modules=["core_attn"])
    assert any("GPU-only" in w and "CPU workers" in w for w in findings.warnings)
    on_gpu = check("tiny-dense", NO_TE, gpus=1, **FGO, offload_modules=["core_attn"])
    assert not any("GPU-only" in w for w in on_gpu.warnings)


@pytest.mark.parametrize(
    "caps,expected",
    [(TE_2_10, {"NVTE_CPU_OFFLOAD_V1": "1"}), (TE_2_9, {}), (NO_TE, {})],
    ids=["te_2_10", "te_2_9", "no_te"],
)
def test_worker_env_set_for_new_te(caps, expected):
    findings = check("tiny-dense", caps, **FGO, offload_modules=["core_attn"])
    assert findings.worker_env == expected
    assert bool(findings.notes) == bool(expected)
    off = check("tiny-dense", caps, fine_grained_activation_offloading=False)
    assert off.worker_env == {}


def test_wrongly_typed_values_are_left_to_the_schema():
    findings = check(
        "tiny-dense", NO_TE, **FGO, offload_modules="core_attn", activation_offload_fraction="half"
    )
    # The schema reports the types; the rules must not crash nor split the string.
    assert not any("unknown module 'c'" in line for line in findings.errors)
    assert not any("activation_offload_fraction" in line for line in findings.errors)


def _bucket_findings(buckets, divisible_by, fgo=True):
    from nemo_rl_offload.preflight import check_policy

    policy = make_policy(
        "tiny-dense",
        fine_grained_activation_offloading=fgo,
        offload_modules=["core_attn"] if fgo else None,
        offload_sequence_length_buckets=buckets,
    )
    policy["make_sequence_length_divisible_by"] = divisible_by
    return check_policy(
        policy, where="policy", architecture=architecture_for("tiny-dense"), caps=NO_TE
    )


def test_buckets_keep_the_padding_multiple():
    bad = _bucket_findings([1001, 4096], divisible_by=8)
    (line,) = [e for e in bad.errors if "offload_sequence_length_buckets" in e]
    assert "[1001] not divisible by policy.make_sequence_length_divisible_by=8" in line
    assert not _bucket_findings([1024, 4096], divisible_by=8).errors


def test_buckets_without_offloading_are_reported_unused():
    findings = _bucket_findings([1024, 4096], divisible_by=1, fgo=False)
    assert not findings.errors
    assert any("nothing is padded" in w for w in findings.warnings)


def test_cuda_graphs_on_cpu_workers_warn_and_on_gpu_do_not():
    settings = {"cuda_graph_impl": "full_iteration"}
    on_cpu = check("tiny-dense", NO_TE, gpus=0, **settings)
    assert on_cpu.errors == []
    assert any(
        line.startswith(f"warning: {P}.cuda_graph_impl: ") and "not be applied on CPU" in line
        for line in on_cpu.warnings
    ), on_cpu.warnings
    on_gpu = check("tiny-dense", NO_TE, gpus=1, **settings)
    assert on_gpu.errors == [] and on_gpu.warnings == []


def test_buckets_count_with_full_iteration_graphs_alone():
    """Graphed steps are padded to the buckets even without offloading: no warning then."""
    buckets = {"offload_sequence_length_buckets": [1024, 4096]}
    alone = check("tiny-dense", NO_TE, **buckets)
    assert any("nothing is padded" in line for line in alone.warnings)
    graphed = check("tiny-dense", NO_TE, cuda_graph_impl="full_iteration", **buckets)
    assert not any("nothing is padded" in line for line in graphed.warnings), graphed.warnings


def test_plan_budget_must_be_positive_and_needs_gpu_workers():
    bad = check("tiny-dense", NO_TE, offload_plan_budget_gib=0)
    assert any(e.startswith(f"{P}.offload_plan_budget_gib: must be > 0 GiB") for e in bad.errors), (
        bad.errors
    )
    on_cpu = check("tiny-dense", NO_TE, gpus=0, offload_plan_budget_gib=20)
    assert any("cluster.gpus_per_node is 0" in e for e in on_cpu.errors), on_cpu.errors
    fine = check("tiny-dense", NO_TE, gpus=1, offload_plan_budget_gib=20)
    assert fine.errors == [] and fine.warnings == []


def test_plan_budget_warns_that_it_replaces_the_recipes_own_settings():
    findings = check(
        "tiny-dense", NO_TE, **FGO, offload_modules=["core_attn"], offload_plan_budget_gib=20
    )
    assert findings.errors == []
    assert any("replaces this recipe's offload" in w for w in findings.warnings), findings.warnings


PIPELINE_2 = {"pipeline_model_parallel_size": 2, "pipeline_dtype": "float32"}


@pytest.mark.parametrize(
    "model,workers,settings,path,fragment",
    [
        (
            "tiny-dense",
            2,
            {"context_parallel_size": 2, "cuda_graph_impl": "full_iteration"},
            "context_parallel_size",
            "cannot run with full_iteration CUDA graphs",
        ),
        (
            "tiny-dense",
            3,
            {"context_parallel_size": 2},
            "",
            "(1 x 1 x 2 = 2) do not divide the 3 worker(s) of cluster.gpus_per_node",
        ),
        (
            "tiny-dense",
            2,
            {**PIPELINE_2, "model_overrides": {"virtual_pipeline_model_parallel_size": 2}},
            "model_overrides.virtual_pipeline_model_parallel_size",
            "one model chunk per stage",
        ),
        (
            "tiny-dense",
            3,
            {"pipeline_model_parallel_size": 3, "pipeline_dtype": "float32"},
            "pipeline_model_parallel_size",
            "4 layers do not split evenly over 3 pipeline stages",
        ),
        (
            "tiny-dense",
            3,
            {
                "pipeline_model_parallel_size": 3,
                "pipeline_dtype": "float32",
                "num_layers_in_first_pipeline_stage": 1,
            },
            "pipeline_model_parallel_size",
            "after 1 in the first/last stage",
        ),
        (
            "tiny-dense",
            4,
            {"tensor_model_parallel_size": 4},
            "tensor_model_parallel_size",
            "does not divide the model's num_query_groups (2)",
        ),
        (
            "tiny-dense",
            3,
            {"tensor_model_parallel_size": 2},
            "",
            "(2 x 1 x 1 = 2) do not divide the 3 worker(s) of cluster.gpus_per_node",
        ),
        (
            "tiny-moe",
            2,
            {"expert_model_parallel_size": 4},
            "expert_model_parallel_size",
            "(4 x 1 x 1) do not divide the 2 worker(s)",
        ),
    ],
    ids=[
        "cp2_graphs",
        "cp2_workers",
        "virtual_pp",
        "pp3_uneven",
        "pp3_uneven_after_first",
        "tp4_groups",
        "workers",
        "ep4",
    ],  # fmt: skip
)
def test_parallel_layouts_the_passes_cannot_run_are_refused(
    model, workers, settings, path, fragment
):
    findings = check(model, NO_TE, workers=workers, **settings)
    where = f"{P}.{path}" if path else P
    matching = [line for line in findings.errors if line.startswith(f"{where}: ")]
    assert any(fragment in line for line in matching), findings.errors


@pytest.mark.parametrize(
    "model,workers,settings",
    [
        ("tiny-dense", 2, PIPELINE_2),
        ("tiny-dense", 4, {**PIPELINE_2, "tensor_model_parallel_size": 2}),
        ("tiny-dense", 2, {"tensor_model_parallel_size": 2}),
        (
            "tiny-dense",
            3,
            {
                "pipeline_model_parallel_size": 3,
                "pipeline_dtype": "float32",
                "num_layers_in_first_pipeline_stage": 2,
            },
        ),
        ("tiny-moe", 2, {"expert_model_parallel_size": 2}),
        ("tiny-dense", None, {"tensor_model_parallel_size": 2}),
        ("tiny-dense", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
        ("tiny-moe", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
        ("tiny-dense", 2, {"context_parallel_size": 2}),
        ("tiny-dense", 2, {"context_parallel_size": 2, "cuda_graph_impl": "none"}),
        (
            "tiny-dense",
            8,
            {
                "context_parallel_size": 2,
                "tensor_model_parallel_size": 2,
                "sequence_parallel": True,
            },
        ),
    ],
    ids=[
        "pp2",
        "pp2_tp2",
        "tp2",
        "pp3_uneven_given",
        "ep2",
        "workers_unknown",
        "tp2_sp_local",
        "moe_tp2_sp_local",
        "cp2",
        "cp2_no_graphs",
        "cp2_tp2_sp_dp2",
    ],  # fmt: skip
)
def test_parallel_layouts_every_pass_runs_are_accepted(model, workers, settings):
    findings = check(model, NO_TE, workers=workers, **settings)
    assert findings.errors == []
    assert not [line for line in findings.warnings if "sequence_parallel" in line]


def test_sequence_parallel_without_tensor_parallelism_is_a_one_line_warning():
    from nemo_rl_offload.config import megatron_settings

    findings = check("tiny-dense", NO_TE, workers=1, sequence_parallel=True)
    assert findings.errors == []
    assert [line for line in findings.warnings if "sequence_parallel" in line] == [
        f"warning: {P}.sequence_parallel: ignored at tensor_model_parallel_size 1 (there is "
        "nothing to split the sequence over); set it to false"
    ]
    # ... and Megatron, which refuses it without tensor parallelism, gets it off.
    effective = megatron_settings.effective_settings(
        make_policy("tiny-dense", sequence_parallel=True),
        architecture_for("tiny-dense"),
        te_installed=False,
    )
    assert transformer_config_kwargs(effective)["sequence_parallel"] is False
    assert build_transformer_config(effective).sequence_parallel is False


DRIFT = (
    "megatron-core's ChunkOffloadHandler.tensor_pop changed since this backend was checked "
    "(installed megatron-core 0.19.3, checked 0.19.2); pin megatron-core==0.19.2 or update "
    "nemo_rl_offload/offload/owned.py"
)


@pytest.mark.parametrize("gpus", [1, 0])
def test_offload_code_that_changed_upstream_is_refused_where_offloading_runs(gpus):
    import dataclasses

    caps = dataclasses.replace(NO_TE, offload_code_drift=DRIFT)
    findings = check("tiny-dense", caps, gpus=gpus, **FGO)
    refused = [line for line in findings.errors if DRIFT in line]
    if gpus:
        assert refused == [f"{P}.fine_grained_activation_offloading: {DRIFT}"]
    else:  # CPU workers do not offload (a warning says so)
        assert refused == []
    assert check("tiny-dense", caps, gpus=gpus).errors == []  # offloading off: nothing to refuse


@pytest.mark.parametrize(
    "settings,path,fragment",
    [
        ({"mtp_num_layers": -1}, "mtp_num_layers", "must be an integer >= 0"),
        (
            {"mtp_num_layers": 1, "mtp_loss_scaling_factor": -0.1},
            "mtp_loss_scaling_factor",
            "must be a number >= 0",
        ),
        (
            {"mtp_num_layers": 1, **PIPELINE_2},
            "mtp_num_layers",
            "not implemented with pipeline parallelism",
        ),
        (
            {"model_overrides": {"mtp_num_layers": 2}, **PIPELINE_2},
            "model_overrides.mtp_num_layers",
            "not implemented with pipeline parallelism",
        ),
        (
            {"mtp_num_layers": 1, "cuda_graph_impl": "full_iteration"},
            "mtp_num_layers",
            "full_iteration CUDA graphs",
        ),
    ],
    ids=["negative", "negative_scale", "pp2", "pp2_override", "graphs"],
)
def test_multi_token_prediction_settings_that_cannot_run_are_refused(settings, path, fragment):
    findings = check("tiny-dense", NO_TE, workers=2, **settings)
    assert any(line.startswith(f"{P}.{path}: ") and fragment in line for line in findings.errors), (
        findings.errors
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.0, **PIPELINE_2},  # NeMo-RL's off
        {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3, "mtp_detach_heads": True},
        {"mtp_num_layers": 5, "mtp_use_repeated_layer": True, "tensor_model_parallel_size": 2},
        {"mtp_num_layers": 1, "context_parallel_size": 2},
    ],
    ids=["off_with_pp2", "two_depths", "repeated_tp2", "cp2"],
)
def test_multi_token_prediction_settings_that_run_are_accepted(settings):
    findings = check("tiny-dense", NO_TE, workers=2, **settings)
    assert findings.errors == []


@pytest.mark.parametrize(
    "model,caps,settings,warned",
    [
        ("tiny-dense", NO_TE, {"apply_rope_fusion": True}, ["apply_rope_fusion"]),
        ("tiny-dense", TE_2_10, {"apply_rope_fusion": True}, []),
        (
            "tiny-dense",
            NO_TE,
            {"model_overrides": {"apply_rope_fusion": True}},
            ["apply_rope_fusion"],
        ),
        ("tiny-moe", NO_TE, {"moe_permute_fusion": True}, ["moe_permute_fusion"]),
        ("tiny-dense", NO_TE, {"moe_permute_fusion": True}, []),  # nothing to permute
        ("tiny-dense", NO_TE, {"apply_rope_fusion": False}, []),
    ],
    ids=["rope_no_te", "rope_te", "rope_override", "permute_moe", "permute_dense", "off"],
)
def test_fusions_whose_kernels_need_transformer_engine_run_unfused_without_it(
    model, caps, settings, warned
):
    from nemo_rl_offload.config import megatron_settings

    findings = check(model, caps, **settings)
    assert findings.errors == []
    said = [w for w in findings.warnings if "fused kernel comes from Transformer Engine" in w]
    assert [w.split(": ")[1].rsplit(".", 1)[-1] for w in said] == warned
    effective = megatron_settings.effective_settings(
        make_policy(model, **settings),
        architecture_for(model),
        te_installed=caps.has_transformer_engine,
    )
    for name in ("apply_rope_fusion", "moe_permute_fusion"):
        asked = settings.get(name, (settings.get("model_overrides") or {}).get(name))
        if asked is not None:
            assert effective.value(name) is (asked and caps.has_transformer_engine)


# activation_offload_fraction_by_module: each listed module's own share of its groups.
BY_MODULE = f"{P}.activation_offload_fraction_by_module"


@pytest.mark.parametrize(
    ("by_module", "extra", "path", "fragment"),
    [
        ([0.5], {}, BY_MODULE, "must map offload modules"),
        ({}, {}, BY_MODULE, "must map offload modules"),
        (
            {"mlp_act": 0.5},
            {},
            f"{BY_MODULE}.mlp_act",
            "not in policy.megatron_cfg.offload_modules",
        ),
        ({"attn_proj": 1.5}, {}, f"{BY_MODULE}.attn_proj", "between 0 and 1"),
        ({"attn_proj": "half"}, {}, f"{BY_MODULE}.attn_proj", "between 0 and 1"),
        (
            {"attn_proj": 0.5},
            {"activation_offload_fraction_placement": "earliest"},
            BY_MODULE,
            "needs policy.megatron_cfg.activation_offload_fraction_placement spread",
        ),
        (
            {"attn_proj": 0.5},
            {"offload_modules": ["core_attn", "attn_proj"]},
            f"{BY_MODULE}.attn_proj",
            "not beside core_attn",
        ),
    ],
    ids=["list", "empty", "not_offloaded", "above_one", "not_a_number", "earliest", "shared"],
)
def test_fraction_by_module_is_refused_with_the_fix(by_module, extra, path, fragment):
    settings = {
        **FGO,
        "offload_modules": ["qkv_linear", "attn_proj"],
        "activation_offload_fraction_by_module": by_module,
        **extra,
    }
    findings = check("tiny-dense", NO_TE, **settings)
    matching = [line for line in findings.errors if line.startswith(f"{path}: ")]
    assert matching and fragment in matching[0], findings.errors


def test_fraction_by_module_is_accepted_and_reaches_the_runtime_and_the_estimate():
    from support.policies import make_policy

    from nemo_rl_offload.config import megatron_settings
    from nemo_rl_offload.planning.activation_bytes import ActivationSettings

    settings = {
        **FGO,
        "offload_modules": ["core_attn", "mlp_norm"],
        "activation_offload_fraction_by_module": {"mlp_norm": 0.5},
        "activation_offload_fraction_placement": "spread",
    }
    findings = check("llama-1b", NO_TE, **settings)
    assert findings.errors == [] and findings.warnings == []
    policy = make_policy(**settings)
    effective = megatron_settings.effective_settings(policy, None, te_installed=False)
    assert effective.fraction_by_module == (("mlp_norm", 0.5),)
    choices = megatron_settings.runtime_choices(effective, policy["megatron_cfg"], graphed=False)
    assert choices.fraction_by_module == (("mlp_norm", 0.5),)
    plan = ActivationSettings.of(effective)
    assert (plan.fraction_of("mlp_norm"), plan.fraction_of("core_attn")) == (0.5, 1.0)


def test_fraction_by_module_without_offloading_warns():
    findings = check("tiny-dense", NO_TE, activation_offload_fraction_by_module={"attn_proj": 0.5})
    assert findings.errors == []
    assert any(w.startswith(f"warning: {BY_MODULE}: has no effect") for w in findings.warnings)
