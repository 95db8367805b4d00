"""Which tests share a process when pytest-xdist spreads them over several (scripts/test).

Each test goes to whichever process is free, as with xdist's ``--dist load``, except the tests
of a module that defines a fixture of wider than function scope: those go to one process
together and run there in their order, as they do without xdist, so that the fixture is built
once instead of once per process (test_training_cpu.py's SFT run, which its GRPO, DPO and
distillation tests start from, takes minutes; test_parallel_layouts.py's one-rank references
are built on spawned ranks). xdist's ``--dist loadgroup`` with ``xdist_group`` marks would say
the same, but on pytest 9.2 it silently stops grouping (pytest-dev/pytest-xdist#1386).

Modules are handed out first, the most tests first (xdist's LoadScopeScheduling), then the
single tests in collection order.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling


class SharedFixtureScheduling(LoadScopeScheduling):
    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._root = Path(config.rootpath)

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if defines_a_shared_fixture(self._root / module) else nodeid


@functools.cache
def defines_a_shared_fixture(path: Path) -> bool:
    """Whether the test module at ``path`` defines a fixture whose scope is not a test's
    (``@pytest.fixture(scope="module")``, or class, package, session)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    for node in ast.walk(tree):
        for decorator in getattr(node, "decorator_list", ()):
            if not (isinstance(decorator, ast.Call) and _is_fixture(decorator.func)):
                continue
            for keyword in decorator.keywords:
                scope = keyword.value
                if keyword.arg == "scope" and not (
                    isinstance(scope, ast.Constant) and scope.value == "function"
                ):
                    return True
    return False


def _is_fixture(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "fixture") or (
        isinstance(func, ast.Name) and func.id == "fixture"
    )
