"""Fixtures shared by test directories (each defined in tests/support)."""

from support.megatron_gpu import megatron_gpu  # noqa: F401 (a fixture, registered by name)
