"""``policy.quant_cfg`` and its keys through validate (config/quantization.py, the
registry's calibration-data entry), each both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nemo_rl_offload.preflight import load_and_check

REPO = Path(__file__).resolve().parents[3]
TINY_GRPO = REPO / "examples" / "configs" / "tiny" / "grpo.yaml"
WEIGHTS_ONLY = {
    "quantize": {
        "algorithm": "max",
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*mlp*weight_quantizer", "enable": True, "cfg": {"num_bits": 8}},
        ],
    }
}
KV_CACHE = {
    "quantize": {
        "quant_cfg": [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": "e4m3"}}]
    }
}


@pytest.fixture
def nemo_rl_tree(tmp_path: Path) -> Path:
    """A recipe two directories below a tree that holds quantization recipes, as NeMo-RL's
    recipes/llm/*.yaml sit below its examples/modelopt/quant_configs/."""
    (tmp_path / "quant_configs").mkdir()
    (tmp_path / "quant_configs" / "weights.yaml").write_text(yaml.safe_dump(WEIGHTS_ONLY))
    (tmp_path / "quant_configs" / "kv.yaml").write_text(yaml.safe_dump(KV_CACHE))
    (tmp_path / "quant_configs" / "empty.yaml").write_text("metadata: {}\n")
    recipes = tmp_path / "configs" / "recipes"
    recipes.mkdir(parents=True)
    (recipes / "grpo.yaml").write_text(f"defaults: {TINY_GRPO}\n")
    return recipes / "grpo.yaml"


def _check(recipe: Path, *overrides: str, starting: bool = False):
    return load_and_check(
        str(recipe),
        ["++policy.init_checkpoint=null", *overrides],
        megatron_crosscheck=False,
        starting=starting,
    )


def _lines(report, key: str) -> list[str]:
    def key_of(line: str) -> str:
        return line.removeprefix("warning: ").split(": ")[0]

    return [line for line in report.errors + report.warnings if key in key_of(line)]


def test_a_modelopt_name_and_a_recipe_file_found_above_the_recipe_validate(nemo_rl_tree):
    named = _check(nemo_rl_tree, "++policy.quant_cfg=NVFP4_DEFAULT_CFG")
    assert named.errors == []
    filed = _check(
        nemo_rl_tree,
        "++policy.quant_cfg=quant_configs/weights.yaml",
        "++policy.generation.quant_cfg=quant_configs/weights.yaml",
    )
    assert filed.errors == []
    absolute = str(nemo_rl_tree.parents[2] / "quant_configs" / "weights.yaml")
    assert filed.recipe["policy"]["quant_cfg"] == absolute  # what the workers read
    assert filed.recipe["policy"]["generation"]["quant_cfg"] == absolute


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("quant_configs/missing.yaml", "is neither a ModelOpt config name"),
        ("quant_configs/empty.yaml", "holds no quant_cfg"),
        ("quant_configs/kv.yaml", "quantizes the KV cache"),
        ("FP8_KV_CFG", "quantizes the KV cache"),
        ("NVFP4_DEFALT_CFG", "did you mean NVFP4_DEFAULT_CFG?"),
    ],
)
def test_a_config_this_backend_cannot_apply_is_one_line(nemo_rl_tree, value, says):
    (line,) = _check(nemo_rl_tree, f"++policy.quant_cfg={value}").errors
    assert line.startswith("policy.quant_cfg: ") and says in line


def test_rollouts_are_quantized_with_the_policys_config_or_not_at_all(nemo_rl_tree):
    same = "++policy.generation.quant_cfg=NVFP4_DEFAULT_CFG"
    policy = "++policy.quant_cfg=NVFP4_DEFAULT_CFG"
    assert _check(nemo_rl_tree, policy, same).errors == []
    assert _check(nemo_rl_tree, policy).errors == []  # rollouts unquantized
    (other,) = _check(nemo_rl_tree, policy, "++policy.generation.quant_cfg=FP8_DEFAULT_CFG").errors
    assert other.startswith("policy.generation.quant_cfg: 'FP8_DEFAULT_CFG' differs")
    (alone,) = _check(nemo_rl_tree, same).errors
    assert "quantizes rollouts of a policy that trains unquantized" in alone


def test_real_quant_warns_that_rollouts_run_the_fake_quantized_weights(nemo_rl_tree):
    policy = (
        "++policy.quant_cfg=NVFP4_DEFAULT_CFG",
        "++policy.generation.quant_cfg=NVFP4_DEFAULT_CFG",
    )
    report = _check(nemo_rl_tree, *policy, "++policy.generation.real_quant=true")
    assert report.errors == []
    (line,) = _lines(report, "real_quant")
    assert line.startswith("warning: policy.generation.real_quant: rollouts run the fake-quant")
    assert _lines(_check(nemo_rl_tree, *policy), "real_quant") == []
    (alone,) = _check(nemo_rl_tree, policy[0], "++policy.generation.real_quant=true").errors
    assert alone.startswith("policy.generation.real_quant: true quantizes rollouts")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("++policy.megatron_cfg.peft.enabled=true", "++policy.megatron_cfg.peft.dim=8"), "LoRA"),
        (("++policy.megatron_cfg.cuda_graph_impl=full_iteration",), "CUDA graphs"),
    ],
)
def test_what_quantization_is_not_implemented_beside_is_refused(nemo_rl_tree, extra, says):
    quantized = _check(nemo_rl_tree, "++policy.quant_cfg=NVFP4_DEFAULT_CFG", *extra)
    assert any(e.startswith("policy.quant_cfg: ") and says in e for e in quantized.errors)
    plain = _check(nemo_rl_tree, *extra)
    assert not any(e.startswith("policy.quant_cfg") for e in plain.errors)


def test_named_calibration_data_warns_in_validate_and_stops_a_run(nemo_rl_tree):
    data = ("++policy.quant_cfg=FP8_DEFAULT_CFG", "++policy.quant_calib_data=cnn_dailymail")
    checked = _check(nemo_rl_tree, *data)
    assert checked.errors == []
    (line,) = _lines(checked, "quant_calib_data")
    assert line.startswith("warning: policy.quant_calib_data: NeMo-RL's calibration datasets")
    (refused,) = [e for e in _check(nemo_rl_tree, *data, starting=True).errors if "calib" in e]
    assert "set it to null" in refused
    assert _lines(_check(nemo_rl_tree, "++policy.quant_cfg=FP8_DEFAULT_CFG"), "calib") == []


def test_a_relative_file_is_found_above_the_recipe_and_above_what_it_inherits(tmp_path: Path):
    from nemo_rl_offload.config.quantization import locate, search_dirs

    repo = tmp_path / "repo"
    (repo / "configs" / "recipes").mkdir(parents=True)
    (repo / "quant").mkdir()
    (repo / "quant" / "q.yaml").write_text("quant_cfg: []\n")
    recipe = repo / "configs" / "recipes" / "r.yaml"
    recipe.write_text("grpo: {}\n")
    mine = tmp_path / "mine" / "over.yaml"
    mine.parent.mkdir()
    mine.write_text(f"defaults: {recipe}\n")
    elsewhere = tmp_path / "elsewhere"
    for top in (recipe, mine):
        assert locate("quant/q.yaml", search_dirs(elsewhere, top)) == repo / "quant" / "q.yaml"
        assert locate("quant/other.yaml", search_dirs(elsewhere, top)) is None
    assert locate("quant/q.yaml", search_dirs(elsewhere, None)) is None
