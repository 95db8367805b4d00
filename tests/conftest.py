"""Fixtures shared by test directories (each defined in tests/support), and which tests share a
process when pytest-xdist runs them in several (scripts/test)."""

import pytest
from support.megatron_gpu import megatron_gpu  # noqa: F401 (a fixture, registered by name)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's default distribution (``-n N`` without ``--dist``), keeping the tests of a module
    that defines a module-scoped fixture in one process: tests/support/xdist_scheduling.py."""
    if config.getvalue("dist") != "load":
        return None
    from support.xdist_scheduling import SharedFixtureScheduling

    return SharedFixtureScheduling(config, log)
