"""The activation ledger (nemo_rl_offload/planning/ledger.py): measured per layer on the CPU,
it must add up to what a whole model's forward saves, and name the offload module or
recompute option that removes each entry."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from support.policies import make_policy  # noqa: E402

from nemo_rl_offload import cli
from nemo_rl_offload.config import megatron_settings, model_shape
from nemo_rl_offload.config.model_presets import architecture_for  # noqa: E402
from nemo_rl_offload.config.module_names import MLP_OFFLOAD_MODULES
from nemo_rl_offload.models.parallel import single_rank_megatron
from nemo_rl_offload.planning import ledger, ledger_run, planner

REPO = Path(__file__).resolve().parents[3]


def _section(model: str, precision: str = "float32", **cfg) -> dict:
    section = make_policy(model, **cfg)
    section.update(precision=precision, max_total_sequence_length=64, train_micro_batch_size=2)
    return section


@pytest.fixture(scope="module")
def dense() -> ledger.Ledger:
    return ledger_run.build_ledger(_section("tiny-dense"))


def test_a_layer_ledger_adds_up_to_a_whole_model_forward(dense):
    """Four layers at 96 tokens (neither measured length) against the ledger's total there."""
    section = _section("tiny-dense")
    architecture = architecture_for("tiny-dense")
    effective = megatron_settings.effective_settings(section, architecture, te_installed=False)
    whole = ledger.one_layer_settings(effective, {"num_layers": 4})
    with single_rank_megatron():
        model = ledger_run.build_model(whole, architecture, section)
        measured = ledger_run.measure(model, 96, architecture.vocab_size).total_bytes
    assert [(k.kind, k.layers) for k in dense.kinds] == [(model_shape.DENSE, 4), (ledger.MODEL, 1)]
    assert dense.total_bytes(96) == pytest.approx(measured, rel=0.05)
    assert dense.tokens_per_microbatch == 2 * 64


def test_every_dense_offload_module_covers_a_measured_entry(dense):
    (layer,) = [k for k in dense.kinds if k.kind == model_shape.DENSE]
    by_offload = {e.offload: e for e in layer.entries if e.offload}
    # linear_proj saves the attention's output, which the core attention saved first.
    shared = {
        ledger.removal(o, model_shape.DENSE, True)[0] for e in layer.entries for o in e.shared_with
    }
    assert set(by_offload) | shared == set(planner.DENSE_MODULES) | MLP_OFFLOAD_MODULES
    assert "attn_proj" in shared
    # The dense MLP's saved tensors: this package's modules (models/mlp_offload.py).
    assert {by_offload[m].owner for m in MLP_OFFLOAD_MODULES} == {
        "mlp.linear_fc1",
        "mlp",
        "mlp.linear_fc2",
    }
    assert 0 < dense.offloadable_bytes() < dense.total_bytes()
    # The fused attention saves q, k, v and its output, which its selective recompute keeps
    # (the checkpoint's inputs; attn_proj's input): only full recompute frees them; its
    # softmax statistics go with core_attn recompute (an entry of their own where their dtype
    # differs from the activations', as in bf16).
    attention = [e for e in layer.entries if e.owner == "self_attention.core_attention"]
    kept = [e for e in attention if max(len(s) for s in e.shapes) >= 4]
    stats = [e for e in attention if max(len(s) for s in e.shapes) == 3]
    assert kept and all(e.recompute == "full" and e.offload == "core_attn" for e in kept)
    assert all(e.note == ledger.FUSED_ATTENTION_NOTE for e in kept)
    # The output (the projection's input too) is an entry of its own: it leaves the GPU only
    # when attn_proj is offloaded beside core_attn.
    (output,) = [e for e in attention if e.shared_with]
    assert output.shared_with == ["self_attention.linear_proj"] and output.tensors == 1
    assert not any(e.shared_with for e in layer.entries if e is not output)
    assert all(e.recompute == "core_attn" and e.recompute_flops_per_token > 0 for e in stats)
    assert all(e.bytes_per_token >= 0 for e in layer.entries)


def test_an_unfused_attentions_probabilities_go_with_core_attn_recompute():
    """Megatron's unfused attention saves its [batch, heads, s, s] probabilities: those are
    what core_attn recompute frees; a fused kernel's 4-D tensors (q, k, v, output) are kept."""
    from types import SimpleNamespace

    def kept(short, long):
        return ledger._kept_by_attention_checkpoint(
            [SimpleNamespace(shape=x) for x in short],
            [SimpleNamespace(shape=x) for x in long],
            (32, 64),
        )

    assert kept([(1, 24, 32, 128), (1, 8, 32, 128)], [(1, 24, 64, 128), (1, 8, 64, 128)])
    # 32 heads and a head dimension of 64 match the lengths: still q, k, v, not probabilities.
    assert kept([(1, 32, 32, 64)], [(1, 32, 64, 64)])
    assert not kept([(1, 24, 32, 128), (1, 24, 32, 32)], [(1, 24, 64, 128), (1, 24, 64, 64)])
    assert not kept([(1, 24, 32)], [(1, 24, 64)])  # only the softmax statistics
    assert kept([(1, 24, 32, 128)], [(1, 24, 64, 128), (1, 24, 64, 128)])  # unpaired: kept


@pytest.mark.parametrize(
    ("owner", "kind", "wanted"),
    [
        # A norm's own saved tensors (its input) stay under selective recompute; its output,
        # saved by the next linear, goes with layernorm recompute; fc2's input with mlp_act.
        ("input_layernorm", model_shape.DENSE, ("attn_norm", "full")),
        ("self_attention.linear_qkv", model_shape.DENSE, ("qkv_linear", "layernorm")),
        ("self_attention.core_attention", model_shape.DENSE, ("core_attn", "core_attn")),
        ("self_attention.linear_proj", model_shape.DENSE, ("attn_proj", "full")),
        ("pre_mlp_layernorm", model_shape.DENSE, ("mlp_norm", "full")),
        ("mlp.linear_fc1", model_shape.DENSE, ("mlp_fc1", "layernorm")),
        ("mlp", model_shape.DENSE, ("mlp_act", "mlp")),
        ("mlp.linear_fc2", model_shape.DENSE, ("mlp_fc2", "mlp_act")),
        ("self_attention", model_shape.DENSE, (None, "full")),
        ("mlp.experts.linear_fc1", model_shape.MOE, ("expert_fc1", "moe")),
        ("mlp.experts", model_shape.MOE, ("moe_act", "moe_act")),
        ("mlp.experts.linear_fc2", model_shape.MOE, (None, "moe_act")),
        ("mlp.router", model_shape.MOE, (None, "moe")),
        ("output_layer", ledger.MODEL, (None, None)),
    ],
)
def test_each_owner_maps_to_what_removes_it(owner, kind, wanted):
    offload, recompute, note = ledger.removal(owner, kind, chunked=True)
    assert (offload, recompute) == wanted
    assert note == ""  # every option named runs without Transformer Engine


def test_the_cheap_recompute_options_cost_elementwise_flops():
    """layernorm and mlp_act re-run elementwise passes: far cheaper than the whole MLP."""
    from support.policies import make_policy

    from nemo_rl_offload.config import megatron_settings
    from nemo_rl_offload.config.model_presets import architecture_for

    effective = megatron_settings.effective_settings(
        make_policy("llama-1b"), architecture_for("llama-1b"), te_installed=False
    )
    cost = {
        option: ledger.recompute_flops_per_token(option, effective, 4096)
        for option in ("layernorm", "mlp_act", "mlp")
    }
    hidden = effective.value("hidden_size")
    ffn = effective.value("ffn_hidden_size")
    assert cost["layernorm"] == 8 * hidden  # two norms
    assert cost["mlp_act"] == 8 * ffn  # the gated unit over fc1's 2 x ffn outputs
    assert 0 < cost["mlp_act"] < cost["mlp"] / 100


def test_the_unchunked_loss_names_logprob_chunk_size():
    assert "logprob_chunk_size" in ledger.removal("<model>", ledger.MODEL, chunked=False)[2]
    assert ledger.removal("<model>", ledger.MODEL, chunked=True)[2] == ""


def test_moe_layers_reach_the_expert_offload_modules():
    section = _section("tiny-moe", model_overrides={"moe_grouped_gemm": True})
    moe = ledger_run.build_ledger(section)
    (layer,) = [k for k in moe.kinds if k.kind == model_shape.MOE]
    assert {"expert_fc1", "moe_act"} <= {e.offload for e in layer.entries}


def test_bf16_recipes_report_bf16_sizes():
    bf16 = ledger_run.build_ledger(_section("tiny-dense", precision="bfloat16"))
    (layer,) = [k for k in bf16.kinds if k.kind == model_shape.DENSE]
    qkv = next(e for e in layer.entries if e.offload == "qkv_linear")
    assert qkv.dtype == "bfloat16"
    hidden = architecture_for("tiny-dense").transformer["hidden_size"]
    assert qkv.bytes_per_token == 2 * hidden  # the linear's saved input
    # The norms keep what CUDA's fused kernel keeps: the bf16 input and a float32 rstd per
    # token, not the CPU composite's float32 copies.
    norm = [e for e in layer.entries if e.owner == "input_layernorm"]
    assert {(e.dtype, e.bytes_per_token) for e in norm} == {
        ("bfloat16", 2 * hidden),
        ("float32", 4),
    }


def test_cli_prints_the_ledger_of_a_recipe(tmp_path):
    out, err = StringIO(), StringIO()
    target = tmp_path / "ledger.json"
    config = str(REPO / "examples" / "configs" / "tiny" / "sft.yaml")
    argv = ["plan", "--ledger", "--config", config, "--json", str(target)]
    assert cli.main(argv, out, err) == 0, err.getvalue()
    text = out.getvalue()
    assert "tiny-dense (float32), 512 tokens per micro-batch" in text
    assert "dense layer x 4" in text and "attn_norm" in text
    assert "today's offload modules reach" in text
    data = json.loads(target.read_text())
    assert data["tokens_per_microbatch"] == 512 and data["total_bytes_per_microbatch"] > 0


def test_cli_ledger_of_a_bad_recipe_is_one_line():
    out, err = StringIO(), StringIO()
    config = str(REPO / "examples" / "configs" / "tiny" / "sft.yaml")
    argv = ["plan", "--ledger", "--config", config, "policy.model_name=no-such-model"]
    assert cli.main(argv, out, err) == cli.EXIT_USER_ERROR
    assert "policy.model_name" in err.getvalue() and "Traceback" not in err.getvalue()


def test_parallel_sizes_are_named_not_measured():
    section = _section(
        "tiny-dense", tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2
    )
    effective = megatron_settings.effective_settings(
        section, architecture_for("tiny-dense"), te_installed=False
    )
    (note,) = ledger.parallel_notes(effective)
    assert note.startswith("tensor_model_parallel_size 2: each rank holds about 1/2")
    assert "sequence_parallel" in note
    tokens, source = ledger.tokens_per_microbatch(section)
    assert tokens == 2 * 64 // 2 and source.endswith("context_parallel_size 2")
    assert (
        ledger.parallel_notes(
            megatron_settings.effective_settings(
                _section("tiny-dense"), architecture_for("tiny-dense"), te_installed=False
            )
        )
        == []
    )


def test_json_gives_each_entry_its_lifetime(dense):
    data = dense.as_json()
    entry = data["kinds"][0]["entries"][0]
    assert entry["lifetime"] == f"forward of {entry['owner']} -> backward of {entry['owner']}"
