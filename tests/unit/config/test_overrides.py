"""Parsing of command-line overrides (Hydra grammar)."""

from __future__ import annotations

import math

import pytest

from nemo_rl_offload.config.overrides import UNSET, Override, parse_override, parse_value
from nemo_rl_offload.errors import UserInputError


@pytest.mark.parametrize(
    ("text", "op", "path"),
    [
        ("a.b.c=1", "set", ("a", "b", "c")),
        ("+a.b.c=1", "add", ("a", "b", "c")),
        ("++a.b.c=1", "force", ("a", "b", "c")),
        ("~a.b.c", "delete", ("a", "b", "c")),
        (
            "policy.scheduler.0.kwargs.factor=2",
            "set",
            ("policy", "scheduler", "0", "kwargs", "factor"),
        ),
        ("top=1", "set", ("top",)),
        ("a-b.c_d/e@f=1", "set", ("a-b", "c_d/e@f")),
    ],
)
def test_ops_and_paths(text: str, op: str, path: tuple[str, ...]) -> None:
    override = parse_override(text)
    assert override.op == op
    assert override.path == path
    assert override.text == text
    assert override.key == ".".join(path)


def test_override_is_the_dataclass() -> None:
    assert parse_override("+x.y=3") == Override(op="add", path=("x", "y"), value=3, text="+x.y=3")


def test_delete_without_value_is_unset() -> None:
    assert parse_override("~a.b").value is UNSET
    assert parse_override("~a.b=").value is UNSET


def test_delete_with_value() -> None:
    override = parse_override("~a.b=5")
    assert override.op == "delete"
    assert override.value == 5


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("null", None),
        ("NULL", None),
        ("true", True),
        ("True", True),
        ("false", False),
        ("FALSE", False),
        ("0", 0),
        ("42", 42),
        ("-7", -7),
        ("+3", 3),
        ("1_000", 1000),
        ("1.5", 1.5),
        ("1e-5", 1e-5),
        ("5.0e-6", 5.0e-6),
        ("-2.5E3", -2500.0),
        (".5", 0.5),
        ("5.", 5.0),
        ("[a,b]", ["a", "b"]),
        ("[1, 2]", [1, 2]),
        ("[]", []),
        ("[[1, 2], [3, [x]], []]", [[1, 2], [3, ["x"]], []]),
        ("{a: 1, b: x}", {"a": 1, "b": "x"}),
        ("{}", {}),
        ("{a: [1, {b: null}]}", {"a": [1, {"b": None}]}),
        ("[{x: 1}, {y: true}]", [{"x": 1}, {"y": True}]),
        ("'123'", "123"),
        ('"x y"', "x y"),
        ("'true'", "true"),
        ("'null'", "null"),
        ('"a,b"', "a,b"),
        ("['1', \"b c\"]", ["1", "b c"]),
        ("", ""),
        ("   ", ""),
        ("hello", "hello"),
        ("  hello world  ", "hello world"),
        ("007", "007"),
        ("1.2.3", "1.2.3"),
        ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B"),
        ("x=y", "x=y"),
        ("${policy.precision}", "${policy.precision}"),
        ("${mul:${a},${b}}", "${mul:${a},${b}}"),
        ("lr_${a.b}_x", "lr_${a.b}_x"),
        ("[${a}, ${mul:1,2}]", ["${a}", "${mul:1,2}"]),
        ("{k: ${add:1,2}}", {"k": "${add:1,2}"}),
        ("${oc.env:HOME,'a,b'}", "${oc.env:HOME,'a,b'}"),
        ("'it\\'s'", "it's"),
        ('"it\'s"', "it's"),
        ("'C:\\path\\x'", "C:\\path\\x"),
        ("http://host:80/a", "http://host:80/a"),
    ],
)
def test_value_types(raw: str, expected: object) -> None:
    value = parse_override(f"k={raw}").value
    assert value == expected
    assert type(value) is type(expected)
    assert parse_value(raw) == expected


def test_special_floats() -> None:
    assert parse_override("k=inf").value == math.inf
    assert parse_override("k=-inf").value == -math.inf
    assert math.isnan(parse_override("k=nan").value)


def test_nested_types_are_exact() -> None:
    value = parse_override("k=[1, '1', 1.0, true, null]").value
    assert [type(v) for v in value] == [int, str, float, bool, type(None)]


def test_value_splits_on_first_equals_only() -> None:
    override = parse_override("a.b=c=d==e")
    assert override.path == ("a", "b")
    assert override.value == "c=d==e"


def test_whitespace_around_override_is_ignored() -> None:
    override = parse_override("  a.b=1  ")
    assert override.path == ("a", "b")
    assert override.value == 1


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("=1", "empty key"),
        ("+=1", "empty key"),
        ("", "empty override"),
        ("~", "empty key"),
        ("a..b=1", "empty part between dots"),
        (".a=1", "empty part between dots"),
        ("a.=1", "empty part between dots"),
        ("a b=1", "not allowed in a key"),
        ("a[0]=1", "not allowed in a key"),
        ("a.b", "missing '='"),
        ("+a.b", "missing '='"),
        ("+++a=1", "bad prefix"),
        ("+~a=1", "bad prefix"),
        ("a=[1,2", "unclosed '['"),
        ("a=[1,", "unclosed '['"),
        ("a=[[1,2]", "unclosed '['"),
        ("a={x: 1", "unclosed '{'"),
        ("a=1]", "unmatched ']'"),
        ("a=x}", "unmatched '}'"),
        ("a=[1,2]]", "unexpected ']'"),
        ("a=[1,2}", "unexpected '}'"),
        ("a='abc", "unclosed quote"),
        ('a="abc', "unclosed quote"),
        ("a='abc'def", "text after the closing quote"),
        ("a=x'y", "stray quote"),
        ("a=a,b", "comma outside brackets"),
        ("a=[1,,2]", "empty element"),
        ("a=[1,]", "empty element"),
        ("a={x 1}", "expected ':'"),
        ("a={x: 1, x: 2}", "appears twice"),
        ("a={: 1}", "empty key"),
        ("a=${x", "unclosed '${'"),
        ("a=f[0]", "unexpected '['"),
    ],
)
def test_malformed_overrides(text: str, fragment: str) -> None:
    with pytest.raises(UserInputError) as info:
        parse_override(text)
    assert len(info.value.problems) == 1
    line = info.value.problems[0]
    assert line.startswith(f"override '{text}': ")
    assert fragment in line


def test_parse_value_error_names_the_value() -> None:
    with pytest.raises(UserInputError) as info:
        parse_value("[1,2")
    assert info.value.problems == ["value '[1,2': unclosed '['"]


def test_config_package_does_not_import_heavy_modules() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    import nemo_rl_offload

    root = str(Path(nemo_rl_offload.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    code = (
        "import sys, nemo_rl_offload.config.loader, nemo_rl_offload.config.overrides\n"
        "heavy = [m for m in ('torch', 'ray', 'megatron') if m in sys.modules]\n"
        "print('heavy:' + ','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "heavy:"
