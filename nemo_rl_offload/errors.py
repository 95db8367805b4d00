"""The exception types a command reports in one line: mistakes in what a user gave us, and a
service the run depends on failing.

Every problem in a recipe, an override, a data file or a command-line argument is reported as a
line that starts with where it is (a dotted YAML path, a file name, an argument) and says what to
do. Collecting several lines in one exception lets us report every mistake at once instead of
making the user fix them one run at a time. The CLI prints these lines and exits 2; it never shows
a traceback for them.
"""

from __future__ import annotations

from collections.abc import Iterable


class UserInputError(Exception):
    """One or more problems in user input, each a complete line such as
    ``policy.megatron_cfg.offload_modules: 'attn_proj' needs 'core_attn'; add 'core_attn'``."""

    def __init__(self, problems: str | Iterable[str]) -> None:
        lines = [problems] if isinstance(problems, str) else list(problems)
        if not lines:
            raise ValueError("UserInputError needs at least one problem line")
        self.problems: list[str] = lines
        super().__init__("\n".join(lines))


class ServiceError(RuntimeError):
    """A service the run started and depends on (NeMo-Gym's servers) failed: the CLI prints the
    message, which names the service and where its log is, and exits 1."""
