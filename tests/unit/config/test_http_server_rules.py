"""``expose_http_server``, ``parsers`` and the port range: every rule both ways, and what
``validate`` says of a recipe that exposes the policy."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from nemo_rl_offload.cli import main
from nemo_rl_offload.config import http_server

REPO = Path(__file__).resolve().parents[3]
TINY_GRPO = REPO / "examples" / "configs" / "tiny" / "grpo.yaml"
KEY = "policy.generation.mcore_generation_config"


def _section(mcore=None, **generation):
    return {"generation": {"mcore_generation_config": mcore or {}, **generation}}


def test_an_exposed_grpo_policy_is_served_with_its_parsers_and_port_range():
    section = _section(
        {"expose_http_server": True, "parsers": ["deepseek-r1-reasoning", "qwen3-coder-tool"]},
        port_range_low=5000,
        port_range_high=5999,
    )
    assert http_server.problems(section, "policy", "grpo") == ([], [])
    settings = http_server.serving_settings(section)
    assert settings.expose and settings.port_range == (5000, 5999)
    assert settings.parsers == ("deepseek-r1-reasoning", "qwen3-coder-tool")
    assert not http_server.serving_settings(_section()).expose


def test_megatron_cores_parsers_are_the_ones_offered():
    assert {"deepseek-r1-reasoning", "qwen3-coder-tool", "nemotron-v3-reasoning"} <= set(
        http_server.parser_names()
    )


@pytest.mark.parametrize(
    ("mcore", "generation", "expected"),
    [
        ({"expose_http_server": "yes"}, {}, "expose_http_server: 'yes' must be true or false"),
        ({"parsers": ["hermes"]}, {}, "parsers: 'hermes' is not one of the response parsers"),
        ({"parsers": "deepseek-r1-reasoning"}, {}, "must be a list of parser names"),
        (
            {"parsers": ["deepseek-r1-reasoning", "deepseek-r1-reasoning"]},
            {},
            "names a parser twice",
        ),
        ({}, {"port_range_low": 5000}, "give both ends of the port range or neither"),
        ({}, {"port_range_low": 6000, "port_range_high": 5000}, "is not a range of ports"),
        ({}, {"port_range_low": "a", "port_range_high": 5000}, "is not a range of ports"),
    ],
)
def test_a_bad_serving_setting_is_one_line_naming_it(mcore, generation, expected):
    errors, _ = http_server.problems(_section(mcore, **generation), "policy", "grpo")
    assert len(errors) == 1 and expected in errors[0]


def test_exposing_an_algorithm_that_never_samples_is_a_warning_not_silence():
    section = _section({"expose_http_server": True})
    errors, warnings = http_server.problems(section, "policy", "sft")
    assert errors == []
    assert len(warnings) == 1 and "sft never samples" in warnings[0]
    assert http_server.problems(section, "policy", "distillation") == ([], [])


def _validate(*overrides: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["validate", "--no-estimate", "--config", str(TINY_GRPO), *overrides], out, err)
    return code, out.getvalue(), err.getvalue()


def test_validate_takes_an_exposed_recipe_without_calling_the_keys_ignored():
    code, _, err = _validate(
        f"++{KEY}.expose_http_server=true",
        f"++{KEY}.parsers=[deepseek-r1-reasoning]",
        "++policy.generation.port_range_low=5000",
        "++policy.generation.port_range_high=5999",
    )
    assert code == 0, err
    assert "expose_http_server" not in err and "port_range" not in err and "parsers" not in err
    code, _, err = _validate(f"++{KEY}.parsers=[hermes]")
    assert code == 2 and f"{KEY}.parsers: 'hermes'" in err


def _vllm(chat=None, backend="vllm", **vllm_cfg):
    return {
        "generation": {
            "backend": backend,
            "vllm_cfg": {
                "expose_http_server": True,
                "http_server_serving_chat_kwargs": chat,
                **vllm_cfg,
            },
        }
    }


def test_a_vllm_recipes_server_settings_are_served_with_their_equivalents():
    chat = {
        "enable_auto_tools": True,
        "tool_parser": "hermes",
        "reasoning_parser": "deepseek_r1",
        "chat_template": "{{ messages }}",
        "default_chat_template_kwargs": {"enable_thinking": True},
    }
    section = _vllm(chat)
    assert http_server.problems(section, "policy", "grpo") == ([], [])
    settings = http_server.serving_settings(section)
    assert settings.expose and settings.source == "policy.generation.vllm_cfg"
    assert settings.parsers == ("deepseek-r1-reasoning", "hermes-tool")
    assert settings.chat_template == "{{ messages }}"
    assert settings.template_defaults == {"enable_thinking": True}
    # Dynamo reads vllm_cfg too; the Megatron backend reads mcore_generation_config only
    assert http_server.serving_settings(_vllm(None, backend="dynamo")).expose
    assert not http_server.serving_settings(_vllm(None, backend="megatron")).expose


@pytest.mark.parametrize(
    ("chat", "expected"),
    [
        ({"reasoning_parser": "granite"}, "reasoning_parser: 'granite' is not served"),
        ({"tool_parser": "llama3_json"}, "tool_parser: 'llama3_json' is not served"),
        ({"chat_template_content_format": "openai"}, "not implemented by this backend's HTTP"),
        ({"enable_auto_tools": "yes"}, "enable_auto_tools: 'yes' must be true or false"),
        ({"default_chat_template_kwargs": [1]}, "must be a mapping"),
    ],
)
def test_a_vllm_server_setting_not_served_is_one_line_naming_it(chat, expected):
    errors, _ = http_server.problems(_vllm(chat), "policy", "grpo")
    assert len(errors) == 1 and expected in errors[0]
    assert errors[0].startswith("policy.generation.vllm_cfg.http_server_serving_chat_kwargs.")
