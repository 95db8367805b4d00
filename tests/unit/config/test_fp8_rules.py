"""``megatron_cfg.fp8_cfg`` (config.fp8): what runs, what is refused (one line naming the key
and the fix), and the settings the layers get, each rule both ways."""

from __future__ import annotations

import pytest

from nemo_rl_offload.config import fp8

RUNS = {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": False}


def _policy(fp8_cfg: dict | None = None, **extra) -> dict:
    return {"megatron_cfg": {"fp8_cfg": {**RUNS, **(fp8_cfg or {})}, **extra}}


def _problems(policy: dict, **kwargs) -> tuple[list[str], list[str]]:
    args = {"transformer_impl": "local", "peft_enabled": False, "quantized": False, **kwargs}
    return fp8.problems(policy, "policy", **args)


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
    ("fp8_cfg", "key", "fix"),
    [
        ({"fp8_recipe": "delayed"}, "fp8_recipe", "use tensorwise"),
        ({"fp8_recipe": "mxfp8"}, "fp8_recipe", "Blackwell"),
        ({"fp8_recipe": "blockwize"}, "fp8_recipe", "did you mean 'blockwise'"),
        ({"fp8": "e5m2"}, "fp8", "not one of e4m3, hybrid"),
        ({"fp8": "hybrid"}, "fp8", "set fp8 to e4m3, or fp8_recipe to tensorwise"),
        ({"fp8_param": True}, "fp8_param", "set it to false"),
        ({"fp8": None}, "fp8", "missing"),
    ],
)
def test_what_does_not_run_is_refused_naming_the_key_and_the_fix(fp8_cfg, key, fix):
    errors, _ = _problems(_policy(fp8_cfg))
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"policy.megatron_cfg.fp8_cfg.{key}: ") and fix in errors[0]
    assert (
        fp8.fp8_settings(_policy(fp8_cfg)) is None or key == "fp8_param" or "hybrid" in str(fp8_cfg)
    )


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [({"peft_enabled": True}, "peft.enabled"), ({"quantized": True}, "quant_cfg")],
)
def test_combinations_not_implemented_are_refused(kwargs, names):
    errors, _ = _problems(_policy(), **kwargs)
    assert len(errors) == 1 and names in errors[0]


def test_transformer_engine_runs_its_own_fp8_with_a_warning():
    errors, warnings = _problems(_policy(), transformer_impl="transformer_engine")
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
