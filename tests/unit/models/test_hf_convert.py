"""Hugging Face <-> Megatron weight conversion (models.hf_convert).

For each family a tiny random HF model (saved with ``save_pretrained``) gives the same logits as
our GPTModel built from its directory with the converted weights; export is the exact inverse at
tensor-parallel sizes 1 and 2, and transformers loads it back; the TP=2 shards equal the
parameters of real TP=2 Megatron models (built in a subprocess on a fake process group, whose
CPU initialisation draws every weight whole and slices it per rank, so the TP=1 and TP=2 models
hold the same numbers); the Transformer Engine names round-trip; the errors are one line each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
# transformers (a dependency) is imported where it is used: the subprocess that builds the
# real TP=2 models runs this file and need not pay for it.

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import Tensor  # noqa: E402

from nemo_rl_offload.config.model_presets import Architecture, architecture_for  # noqa: E402
from nemo_rl_offload.errors import UserInputError  # noqa: E402
from nemo_rl_offload.models.hf_checkpoint import load_into_model  # noqa: E402
from nemo_rl_offload.models.hf_convert import (  # noqa: E402
    hf_config_for,
    hf_to_megatron,
    megatron_to_hf,
)

REPO = Path(__file__).resolve().parents[3]
SIZES: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "attn_implementation": "eager",
}
MOE_SIZES: dict[str, Any] = {"num_experts_per_tok": 2}


@dataclass(frozen=True)
class Family:
    model_type: str
    config_class: str
    model_class: str
    kwargs: dict[str, Any]

    @property
    def moe(self) -> bool:
        return self.model_type in ("qwen3_moe", "mixtral")


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0}),
    "llama_tied": Family("llama", "LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    # head_dim 32 is not hidden_size / heads (16): Megatron's kv_channels.
    "qwen3": Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_moe": Family(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **MOE_SIZES,
            "num_experts": 4,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,  # as in the released Qwen3-MoE checkpoints
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    # transformers' default: the top-k probabilities are not renormalised, which Megatron does
    # with moe_router_pre_softmax (model_presets sets it from norm_topk_prob).
    "qwen3_moe_unnormalised": Family(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **MOE_SIZES,
            "num_experts": 4,
            "moe_intermediate_size": 48,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    "mixtral": Family(
        "mixtral", "MixtralConfig", "MixtralForCausalLM", {**MOE_SIZES, "num_local_experts": 4}
    ),
}
MOE_FAMILIES = [name for name, family in FAMILIES.items() if family.moe]


@dataclass
class Checkpoint:
    family: Family
    directory: Path
    model: Any  # the HF model, in eval mode
    state: dict[str, Tensor]  # what save_pretrained wrote

    @property
    def architecture(self) -> Architecture:
        """The architecture our builder reads from the directory."""
        return architecture_for(str(self.directory))


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (HF initialises biases to 0 and norms to 1, which would hide a
    misplaced bias or norm)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def _make_checkpoint(name: str, directory: Path) -> Checkpoint:
    import transformers

    family = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, family.config_class)(**SIZES, **family.kwargs)
    model = getattr(transformers, family.model_class)(config)
    _randomise(model, seed=len(name))
    model.eval()
    model.save_pretrained(directory)
    return Checkpoint(family, directory, model, load_file(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    """checkpoint(family name) -> its tiny HF checkpoint, made once per module."""
    made: dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in made:
            made[name] = _make_checkpoint(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


def _assert_same(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
    """Same names, and bitwise the same tensors (dtype and shape included)."""
    assert sorted(actual) == sorted(expected)
    different = [
        name
        for name, tensor in expected.items()
        if actual[name].dtype != tensor.dtype or not torch.equal(actual[name], tensor)
    ]
    assert different == []


def _tokens() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 16), generator=g)
    return ids, torch.arange(ids.shape[1]).expand_as(ids)


def _cases() -> Iterator[Any]:
    for name, family in FAMILIES.items():
        yield pytest.param(name, False, id=name)
        if family.moe:
            yield pytest.param(name, True, id=f"{name}-grouped")


# --------------------------------------------------------------------------------------------
# Numerics: our model with converted weights computes HF's logits.


@pytest.mark.parametrize(("name", "grouped"), list(_cases()))
def test_logits_match_hf(build_tiny, checkpoint, moe_globals_restored, name, grouped):
    ckpt = checkpoint(name)
    overrides = {"moe_grouped_gemm": True} if grouped else {}
    model, warnings = build_tiny(str(ckpt.directory), model_overrides=overrides)
    assert warnings == []
    # The policy worker's own path: the directory's safetensors, read and converted for this
    # rank (grouped or sequential experts as the built model has them), loaded strictly.
    load_into_model(model, ckpt.architecture)

    ids, positions = _tokens()
    model.eval()
    with torch.no_grad():
        ours = model(ids, positions, None)
        theirs = ckpt.model(input_ids=ids).logits
    assert ours.shape == theirs.shape == (*ids.shape, SIZES["vocab_size"])
    assert theirs.abs().max() > 0.1  # not a vacuous comparison
    # float32 on CPU: 1.2e-6 to 1.8e-6 measured over the families.
    assert (ours - theirs).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------------------------
# Export: the exact inverse, at TP 1 and 2, loadable by transformers.


@pytest.mark.parametrize(("name", "grouped"), list(_cases()))
@pytest.mark.parametrize("tp", [1, 2])
def test_export_round_trip_is_bitwise(checkpoint, name, grouped, tp):
    ckpt = checkpoint(name)
    architecture = ckpt.architecture
    shards = [
        hf_to_megatron(ckpt.state, architecture, tp_rank=r, tp_size=tp, grouped_experts=grouped)
        for r in range(tp)
    ]
    exported = megatron_to_hf(
        shards, architecture, grouped_experts=grouped, model_type=ckpt.family.model_type
    )
    _assert_same(exported, ckpt.state)  # a tied model gets no lm_head.weight, as saved


@pytest.mark.parametrize("tp", [1, 2])
def test_tied_models_last_stage_head_copy_is_dropped_when_it_equals_the_embedding(checkpoint, tp):
    """With pipeline parallelism a tied model's last stage keeps its own output_layer.weight;
    the merged stages bring it along, and export must neither refuse nor write it."""
    ckpt = checkpoint("llama_tied")
    shards = [
        hf_to_megatron(ckpt.state, ckpt.architecture, tp_rank=r, tp_size=tp) for r in range(tp)
    ]
    with_head = [
        {**shard, "output_layer.weight": shard["embedding.word_embeddings.weight"].clone()}
        for shard in shards
    ]
    exported = megatron_to_hf(with_head, ckpt.architecture, model_type="llama")
    _assert_same(exported, ckpt.state)
    differs = [dict(shard) for shard in with_head]
    differs[-1]["output_layer.weight"] = differs[-1]["output_layer.weight"] + 1
    with pytest.raises(UserInputError, match="output_layer.weight differs"):
        megatron_to_hf(differs, ckpt.architecture, model_type="llama")


def test_tied_state_dict_with_lm_head_imports_and_exports_without_it(checkpoint):
    ckpt = checkpoint("llama_tied")
    with_head = ckpt.model.state_dict()  # the module's state dict repeats the tied lm_head
    assert torch.equal(with_head["lm_head.weight"], with_head["model.embed_tokens.weight"])
    converted = hf_to_megatron(with_head, ckpt.architecture)
    assert "output_layer.weight" not in converted
    _assert_same(converted, hf_to_megatron(ckpt.state, ckpt.architecture))


@pytest.mark.parametrize("name", ["llama_tied", "qwen3_moe"])
def test_meta_tensors_check_names_and_shapes_only(checkpoint, name):
    ckpt = checkpoint(name)
    # The tied model's module state dict repeats lm_head.weight, which cannot be compared here.
    source = ckpt.model.state_dict() if name == "llama_tied" else ckpt.state
    meta = {k: torch.empty(v.shape, device="meta") for k, v in source.items()}
    converted = hf_to_megatron(meta, ckpt.architecture, tp_rank=1, tp_size=2)
    real = hf_to_megatron(ckpt.state, ckpt.architecture, tp_rank=1, tp_size=2)
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in real.items()}
    assert all(v.is_meta for v in converted.values())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_loads_the_export(checkpoint, tmp_path, name):
    import transformers

    ckpt = checkpoint(name)
    architecture = ckpt.architecture
    model_type = ckpt.family.model_type
    exported = megatron_to_hf(
        [hf_to_megatron(ckpt.state, architecture)], architecture, model_type=model_type
    )
    config = hf_config_for(architecture, model_type, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(exported, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert type(loaded) is type(ckpt.model)
    assert getattr(loaded.config, "norm_topk_prob", None) == getattr(
        ckpt.model.config, "norm_topk_prob", None
    )
    ids, _ = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, ckpt.model(input_ids=ids).logits, rtol=0, atol=1e-6
        )
    # ... and our config reader sees the architecture it came from.
    again = architecture_for(str(tmp_path))
    original = architecture_for(str(ckpt.directory))
    assert _with_kv_channels(again.transformer) == _with_kv_channels(original.transformer)
    assert (again.vocab_size, again.rotary_base, again.share_embeddings_and_output_weights) == (
        original.vocab_size,
        original.rotary_base,
        original.share_embeddings_and_output_weights,
    )


def _with_kv_channels(transformer: dict[str, Any]) -> dict[str, Any]:
    """``transformer`` with Megatron's default kv_channels spelled out (the export always writes
    head_dim; Qwen2's own config.json leaves it out)."""
    default = transformer["hidden_size"] // transformer["num_attention_heads"]
    return {**transformer, "kv_channels": transformer.get("kv_channels", default)}


# --------------------------------------------------------------------------------------------
# TP=2 shards against real TP=2 Megatron models.

# (family, model_overrides): attention bias, qk norm + head_dim, tied embeddings, both experts.
REAL_TP_CASES = [
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama_tied", {}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"moe_grouped_gemm": True}),
]


def _build_real_states(spec_path: str) -> None:
    """Subprocess entry: for each spec build its GPTModel at TP 1 and at TP 2 (rank 0, then
    rank 1) on a one-process fake process group and save the weights. Building needs no
    collective, so the fake group is enough; the CPU initialisation draws each weight whole
    and keeps this rank's slice, so every build holds slices of the same numbers."""
    import torch.distributed as dist
    from support.policies import make_policy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nemo_rl_offload.config import megatron_settings
    from nemo_rl_offload.models.builder import build_gpt_model
    from nemo_rl_offload.models.parallel import (
        destroy_megatron_parallel,
        initialize_megatron_parallel,
    )

    for spec in json.loads(Path(spec_path).read_text()):
        architecture = architecture_for(spec["directory"])
        for tp, rank in ((1, 0), (2, 0), (2, 1)):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
            try:
                initialize_megatron_parallel(
                    {"tensor_model_parallel_size": tp}, seed=0, on_gpu=False
                )
                policy = make_policy(
                    spec["directory"],
                    tensor_model_parallel_size=tp,
                    model_overrides=spec["overrides"],
                )
                policy["precision"] = "float32"
                effective = megatron_settings.effective_settings(
                    policy, architecture, te_installed=False
                )
                model, _ = build_gpt_model(effective, architecture, on_gpu=False)
                weights = {k: v for k, v in model.state_dict().items() if isinstance(v, Tensor)}
                torch.save(weights, Path(spec["out"]) / f"tp{tp}_rank{rank}.pt")
            finally:
                destroy_megatron_parallel()
                dist.destroy_process_group()


@pytest.fixture(scope="module")
def real_states(checkpoint, tmp_path_factory) -> list[tuple[Checkpoint, dict, list[dict]]]:
    """(checkpoint, overrides, [TP=1 state, TP=2 rank 0 state, TP=2 rank 1 state]) per case."""
    root = tmp_path_factory.mktemp("real_tp")
    specs = []
    for i, (name, overrides) in enumerate(REAL_TP_CASES):
        out = root / str(i)
        out.mkdir()
        specs.append(
            {"directory": str(checkpoint(name).directory), "overrides": overrides, "out": str(out)}
        )
    (root / "specs.json").write_text(json.dumps(specs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run(
        [sys.executable, __file__, str(root / "specs.json")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [
        (
            checkpoint(name),
            overrides,
            [torch.load(Path(spec["out"]) / f, weights_only=True) for f in _STATE_FILES],
        )
        for (name, overrides), spec in zip(REAL_TP_CASES, specs, strict=True)
    ]


_STATE_FILES = ("tp1_rank0.pt", "tp2_rank0.pt", "tp2_rank1.pt")


@pytest.mark.parametrize("case", range(len(REAL_TP_CASES)))
def test_tp2_shards_equal_real_tp2_models(real_states, case):
    ckpt, overrides, (tp1, *tp2) = real_states[case]
    grouped = bool(overrides.get("moe_grouped_gemm"))
    architecture = ckpt.architecture
    model_type = ckpt.family.model_type
    # The real TP=1 model's weights as HF tensors, split by us...
    as_hf = megatron_to_hf([tp1], architecture, grouped_experts=grouped, model_type=model_type)
    for rank, real in enumerate(tp2):
        ours = hf_to_megatron(as_hf, architecture, tp_rank=rank, tp_size=2, grouped_experts=grouped)
        # ... are Megatron's own TP=2 shards: same names, shapes and numbers.
        _assert_same(ours, real)
    # and merging the real shards gives the same HF tensors.
    _assert_same(
        megatron_to_hf(tp2, architecture, grouped_experts=grouped, model_type=model_type), as_hf
    )


# --------------------------------------------------------------------------------------------
# Transformer Engine names.


def _te_names(state: Mapping[str, Tensor], moe: bool) -> dict[str, Tensor]:
    """Local-spec names -> TE-spec names, by Megatron's own map in the local layer spec; TE's
    MoE layers keep their pre-MLP norm (a TENorm: the router reads its output)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    renames = dict(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map)
    assert renames == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    if moe:
        del renames["pre_mlp_layernorm."]
    renamed = {}
    for key, tensor in state.items():
        for old, new in renames.items():
            key = key.replace(f".{old}", f".{new}")
        renamed[key] = tensor
    return renamed


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_fused_layernorm_names_round_trip(checkpoint, name):
    ckpt = checkpoint(name)
    architecture, moe = ckpt.architecture, ckpt.family.moe
    fused = hf_to_megatron(
        ckpt.state, architecture, fused_layernorm=True, grouped_experts=moe, tp_size=2, tp_rank=1
    )
    local = hf_to_megatron(ckpt.state, architecture, grouped_experts=moe, tp_size=2, tp_rank=1)
    _assert_same(fused, _te_names(local, moe))
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in fused
    shards = [hf_to_megatron(ckpt.state, architecture, fused_layernorm=True, grouped_experts=moe)]
    exported = megatron_to_hf(
        shards,
        architecture,
        fused_layernorm=True,
        grouped_experts=moe,
        model_type=ckpt.family.model_type,
    )
    _assert_same(exported, ckpt.state)


# --------------------------------------------------------------------------------------------
# Errors: one line each, naming the tensor.


def _one_line(excinfo: pytest.ExceptionInfo[UserInputError]) -> str:
    assert len(excinfo.value.problems) == 1
    return excinfo.value.problems[0]


_Q = "model.layers.1.self_attn.q_proj.weight"
_K_NORM = "model.layers.0.self_attn.k_norm.weight"
_W2 = "model.layers.1.block_sparse_moe.experts.3.w2.weight"


@pytest.mark.parametrize(
    ("family", "edit", "line"),
    [
        (
            "llama",
            lambda state: {k: v for k, v in state.items() if k != _Q},
            f"{_Q}: missing, expected shape [64, 64] from config.json",
        ),
        (
            "qwen3",
            lambda state: {**state, _K_NORM: torch.ones(16)},
            f"{_K_NORM}: shape [16], expected [32] from config.json",
        ),
        (
            "mixtral",
            lambda state: {**state, _W2: state[_W2].t()},
            f"{_W2}: shape [96, 64], expected [64, 96] from config.json",
        ),
    ],
    ids=["missing_tensor", "wrong_shape", "wrong_expert_shape"],
)
def test_a_bad_tensor_is_one_line_naming_it(checkpoint, family, edit, line):
    ckpt = checkpoint(family)
    with pytest.raises(UserInputError) as excinfo:
        hf_to_megatron(edit(ckpt.state), ckpt.architecture)
    assert _one_line(excinfo) == line


def test_unexpected_tensors_listed_up_to_five(checkpoint):
    ckpt = checkpoint("llama")
    extra = {f"model.layers.{i}.self_attn.o_proj.bias": torch.zeros(64) for i in range(2)}
    extra.update({f"visual.block{i}.weight": torch.zeros(1) for i in range(5)})
    harmless = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}
    with pytest.raises(UserInputError) as excinfo:
        hf_to_megatron({**ckpt.state, **extra, **harmless}, ckpt.architecture)
    assert _one_line(excinfo) == (
        "unexpected tensors for this config.json: model.layers.0.self_attn.o_proj.bias, "
        "model.layers.1.self_attn.o_proj.bias, visual.block0.weight, visual.block1.weight, "
        "visual.block2.weight (and 2 more)"
    )
    hf_to_megatron({**ckpt.state, **harmless}, ckpt.architecture)  # inv_freq alone is fine


def test_tied_lm_head_that_differs_is_refused(checkpoint):
    ckpt = checkpoint("llama_tied")
    state = {**ckpt.state, "lm_head.weight": torch.zeros(128, 64)}
    with pytest.raises(UserInputError) as excinfo:
        hf_to_megatron(state, ckpt.architecture)
    assert _one_line(excinfo).startswith("lm_head.weight: differs from model.embed_tokens.weight")


def test_export_refuses_wrong_expert_layout_and_missing_tensors(checkpoint):
    ckpt = checkpoint("qwen3_moe")
    sequential = hf_to_megatron(ckpt.state, ckpt.architecture)
    with pytest.raises(UserInputError) as excinfo:
        megatron_to_hf(
            [sequential], ckpt.architecture, grouped_experts=True, model_type="qwen3_moe"
        )
    line = _one_line(excinfo)
    assert line.startswith("tensor-parallel rank 0: unexpected tensors decoder.layers.0.mlp")
    assert line.endswith("(check grouped_experts and fused_layernorm)")

    shards = [hf_to_megatron(ckpt.state, ckpt.architecture, tp_rank=r, tp_size=2) for r in range(2)]
    del shards[1]["decoder.final_layernorm.weight"]
    shards[0]["output_layer._extra_state"] = None  # not a weight: ignored
    with pytest.raises(UserInputError) as excinfo:
        megatron_to_hf(shards, ckpt.architecture, model_type="qwen3_moe")
    assert _one_line(excinfo) == (
        "decoder.final_layernorm.weight: missing from the state dict of tensor-parallel rank 1"
    )


def test_model_type_must_fit_the_architecture(checkpoint):
    qwen2 = checkpoint("qwen2").architecture
    with pytest.raises(UserInputError, match="only qwen2 has q/k/v biases"):
        hf_config_for(qwen2, "llama")
    mixtral = checkpoint("mixtral").architecture
    with pytest.raises(UserInputError, match="qwen3 and qwen3_moe have q/k norms"):
        megatron_to_hf(
            [hf_to_megatron(checkpoint("mixtral").state, mixtral)], mixtral, model_type="qwen3_moe"
        )
    with pytest.raises(UserInputError, match="tensor_model_parallel_size 3: does not divide"):
        hf_to_megatron(checkpoint("llama").state, checkpoint("llama").architecture, tp_size=3)


# --------------------------------------------------------------------------------------------
# What model_presets reads from config.json for these checkpoints.


@pytest.mark.parametrize("layout", ["top_level", "rope_parameters"])
def test_architecture_reads_rope_theta_both_ways(checkpoint, tmp_path, layout):
    """transformers < 5 wrote rope_theta at the top level (most released checkpoints); 5.x
    writes it only inside rope_parameters."""
    ckpt = checkpoint("mixtral")
    config = json.loads((ckpt.directory / "config.json").read_text())
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    config.pop("rope_theta", None)
    if layout == "top_level":
        config.pop("rope_parameters", None)
        config["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert architecture_for(str(tmp_path)).rotary_base == 1000000


def test_rope_scaling_is_refused(checkpoint, tmp_path):
    config = json.loads((checkpoint("llama").directory / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserInputError, match="RoPE scaling 'llama3' is not supported"):
        architecture_for(str(tmp_path))


def test_moe_routing_from_config(checkpoint):
    architecture = architecture_for(str(checkpoint("qwen3_moe_unnormalised").directory))
    assert architecture.transformer.get("moe_router_pre_softmax") is True


if __name__ == "__main__":
    _build_real_states(sys.argv[1])
