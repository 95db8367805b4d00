"""``megatron_cfg.fp8_cfg`` (config.fp8): what runs, what is refused (one line naming the key
and the fix), and the settings the layers get, each rule both ways."""

from __future__ import annotations

import pytest

from nemo_rl_offload.config import fp8

RUNS = {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": False}


def _policy(fp8_cfg: dict | None = None, **megatron_cfg) -> dict:
    return {"megatron_cfg": {"fp8_cfg": {**RUNS, **(fp8_cfg or {})}, **megatron_cfg}}


def _problems(policy: dict, transformer_impl: str = "local") -> tuple[list[str], list[str]]:
    return fp8.problems(policy, "policy", transformer_impl=transformer_impl)


@pytest.mark.parametrize(
    "fp8_cfg",
    [{}, {"fp8_recipe": "tensorwise"}, {"fp8_recipe": "tensorwise", "fp8": "hybrid"}],
    ids=["blockwise", "tensorwise", "tensorwise-hybrid"],
)
def test_what_runs_passes_silently(fp8_cfg):
    assert _problems(_policy(fp8_cfg)) == ([], [])


def test_off_is_silent_whatever_its_other_keys_say():
    off = {"megatron_cfg": {"fp8_cfg": {"enabled": False, "fp8_recipe": "mxfp8"}}}
    assert _problems(off) == ([], [])
    assert fp8.fp8_settings(off) is None


@pytest.mark.parametrize(
    ("fp8_cfg", "key", "fix", "names_a_recipe"),
    [
        ({"fp8_recipe": "delayed"}, "fp8_recipe", "use tensorwise", False),
        ({"fp8_recipe": "mxfp8"}, "fp8_recipe", "Blackwell", False),
        ({"fp8_recipe": "blockwize"}, "fp8_recipe", "did you mean 'blockwise'", False),
        ({"fp8": "e5m2"}, "fp8", "not one of e4m3, hybrid", False),
        ({"fp8": None}, "fp8", "missing", False),
        ({"fp8": "hybrid"}, "fp8", "set fp8 to e4m3, or fp8_recipe to tensorwise", True),
        ({"fp8_param": True}, "fp8_param", "set it to false", True),
    ],
)
def test_what_does_not_run_is_refused_naming_the_key_and_the_fix(fp8_cfg, key, fix, names_a_recipe):
    """Refused by the rules, one line each. Settings exist only where the keys name a format
    and a recipe (a worker refuses through the same rules before it would build them)."""
    errors, _ = _problems(_policy(fp8_cfg))
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"policy.megatron_cfg.fp8_cfg.{key}: ") and fix in errors[0]
    assert (fp8.fp8_settings(_policy(fp8_cfg)) is not None) == names_a_recipe


@pytest.mark.parametrize(
    ("beside", "names"),
    [
        (lambda p: p["megatron_cfg"].update(peft={"enabled": True}), "peft.enabled"),
        (lambda p: p.update(quant_cfg="NVFP4_DEFAULT_CFG"), "quant_cfg"),
    ],
    ids=["lora", "modelopt"],
)
def test_combinations_not_implemented_are_refused(beside, names):
    policy = _policy()
    assert _problems(policy) == ([], [])
    beside(policy)
    errors, _ = _problems(policy)
    assert len(errors) == 1 and names in errors[0]


def test_transformer_engine_runs_its_own_fp8_with_a_warning():
    errors, warnings = _problems(_policy(), "transformer_engine")
    assert errors == [] and len(warnings) == 1 and "Transformer Engine" in warnings[0]


@pytest.mark.parametrize(("env", "power_of_2"), [({}, True), ({fp8.FP32_SCALES_ENV: "1"}, False)])
def test_block_scales_are_powers_of_two_unless_the_workers_environment_says_fp32(
    env, power_of_2, monkeypatch
):
    monkeypatch.delenv(fp8.FP32_SCALES_ENV, raising=False)
    settings = fp8.fp8_settings(_policy(env_vars=env))
    assert settings == fp8.Fp8Settings("blockwise", hybrid=False, power_of_2_scales=power_of_2)


def test_hybrid_sets_e5m2_gradients():
    settings = fp8.fp8_settings(_policy({"fp8": "hybrid", "fp8_recipe": "tensorwise"}))
    assert settings is not None and settings.hybrid and settings.recipe == "tensorwise"
