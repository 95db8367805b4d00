"""Which tests share a process when scripts/test spreads them over several
(tests/support/xdist_scheduling.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.xdist_scheduling import SharedFixtureScheduling, defines_a_shared_fixture


@pytest.mark.parametrize(
    ("source", "shared"),
    [
        ("import pytest\n@pytest.fixture(scope='module')\ndef f():\n    return 1\n", True),
        ("from pytest import fixture\n@fixture(scope='session')\ndef f():\n    return 1\n", True),
        ("import pytest\n@pytest.fixture(scope='function')\ndef f():\n    return 1\n", False),
        ("import pytest\n@pytest.fixture\ndef f():\n    return 1\n", False),
        ("def test_plain():\n    pass\n", False),
        ("def broken(:\n", False),  # not Python: no grouping, pytest reports it
    ],
)
def test_a_module_is_kept_together_only_when_it_defines_a_wider_fixture(tmp_path, source, shared):
    path = tmp_path / f"test_{abs(hash(source))}.py"
    path.write_text(source)
    assert defines_a_shared_fixture(path) is shared


def test_tests_of_a_shared_module_go_together_and_others_one_by_one(tmp_path):
    (tmp_path / "test_shared.py").write_text(
        "import pytest\n@pytest.fixture(scope='module')\ndef f():\n    return 1\n"
    )
    (tmp_path / "test_alone.py").write_text("def test_a():\n    pass\n")
    scheduling = object.__new__(SharedFixtureScheduling)
    scheduling._root = Path(tmp_path)
    assert scheduling._split_scope("test_shared.py::test_x[1]") == "test_shared.py"
    assert scheduling._split_scope("test_alone.py::test_a") == "test_alone.py::test_a"
