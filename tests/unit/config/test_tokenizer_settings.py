"""policy.tokenizer's chat_template and chat_template_kwargs resolved once, with NeMo-RL's
meanings (absent or 'default': the tokenizer's own; null: passthrough; *.jinja: a file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rl_offload.config.tokenizer_settings import (
    PASSTHROUGH_CHAT_TEMPLATE,
    TokenizerSettings,
    tokenizer_settings,
)
from nemo_rl_offload.errors import UserInputError


def _one_line(section: dict, **kwargs) -> str:
    with pytest.raises(UserInputError) as info:
        tokenizer_settings(section, **kwargs)
    (line,) = info.value.problems
    return line


def test_defaults_keep_the_tokenizers_own_template() -> None:
    assert tokenizer_settings({}) == TokenizerSettings(None, None, {})
    assert tokenizer_settings({"tokenizer": None}) == TokenizerSettings()
    settings = tokenizer_settings({"tokenizer": {"name": "byte", "chat_template_kwargs": None}})
    assert settings == TokenizerSettings("byte", None, {})


@pytest.mark.parametrize("value", ["default", "DEFAULT", "Default"])
def test_default_is_the_tokenizers_own(value: str) -> None:
    assert tokenizer_settings({"tokenizer": {"chat_template": value}}).chat_template is None


def test_null_is_nemo_rls_passthrough_template() -> None:
    settings = tokenizer_settings({"tokenizer": {"chat_template": None}})
    assert settings.chat_template == PASSTHROUGH_CHAT_TEMPLATE
    assert PASSTHROUGH_CHAT_TEMPLATE == (
        "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    )


def test_a_string_is_the_template_itself() -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tokenizer_settings({"tokenizer": {"chat_template": template}}).chat_template == template


def test_a_jinja_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    cfg = {"tokenizer": {"chat_template": "t.jinja"}}
    assert tokenizer_settings(cfg, base_dir=tmp_path).chat_template == (
        "{{ messages[0]['content'] }}"
    )
    absolute = {"tokenizer": {"chat_template": str(tmp_path / "t.jinja")}}
    assert tokenizer_settings(absolute).chat_template == "{{ messages[0]['content'] }}"
    line = _one_line({"tokenizer": {"chat_template": "missing.jinja"}}, base_dir=tmp_path)
    assert line.startswith(
        f"policy.tokenizer.chat_template: cannot read the template file {tmp_path}/missing.jinja"
    )


def test_a_template_that_does_not_parse_is_refused(tmp_path: Path) -> None:
    line = _one_line({"tokenizer": {"chat_template": "{% for m in messages %}{{ m }}"}})
    assert line.startswith("policy.tokenizer.chat_template: not a valid Jinja template (line 1:")
    (tmp_path / "bad.jinja").write_text("\n{{ }", encoding="utf-8")
    line = _one_line({"tokenizer": {"chat_template": "bad.jinja"}}, base_dir=tmp_path)
    assert f"({tmp_path}/bad.jinja): not a valid Jinja template (line 2:" in line
    # transformers' {% generation %} tag is a template's own, not an error
    tagged = "{% for m in messages %}{% generation %}{{ m }}{% endgeneration %}{% endfor %}"
    assert tokenizer_settings({"tokenizer": {"chat_template": tagged}}).chat_template == tagged


def test_template_kwargs_are_a_mapping() -> None:
    cfg = {"tokenizer": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert tokenizer_settings(cfg).chat_template_kwargs == {"enable_thinking": False}
    line = _one_line({"tokenizer": {"chat_template_kwargs": ["enable_thinking"]}})
    assert line.startswith("policy.tokenizer.chat_template_kwargs: must be a mapping")
    line = _one_line({"tokenizer": {"chat_template_kwargs": {1: True}}})
    assert line.startswith("policy.tokenizer.chat_template_kwargs: variable names must be strings")


@pytest.mark.parametrize(
    ("tokenizer", "starts"),
    [
        ({"chat_template": 3}, "teacher.tokenizer.chat_template: must be a Jinja template"),
        ({"name": 3}, "teacher.tokenizer.name: must be a string or null"),
        ("byte", "teacher.tokenizer: must be a mapping"),
    ],
)
def test_bad_values_name_their_key(tokenizer, starts: str) -> None:
    assert _one_line({"tokenizer": tokenizer}, where="teacher").startswith(starts)


def test_resolving_imports_no_torch() -> None:
    code = (
        "import sys, nemo_rl_offload.config.tokenizer_settings as t;"
        "t.tokenizer_settings({'tokenizer': {'chat_template': '{{ x }}'}});"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
