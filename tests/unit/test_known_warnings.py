"""The known-harmless warnings filter: each listed message is hidden, everything else still
shows, both as Python warnings and as log records, and in a fresh process that imports
megatron-core as a worker does."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest

from nemo_rl_offload import known_warnings
from nemo_rl_offload.known_warnings import KNOWN

PYTHON_WARNINGS = [k for k in KNOWN if k.category is not None and k.source is None]
LOG_RECORDS = [k for k in KNOWN if k.logger is not None]


def _shown(message: str, category: type[Warning]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # as under -W always: only the filter can hide it
        known_warnings.install()
        warnings.warn(message, category, stacklevel=1)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("known", PYTHON_WARNINGS, ids=lambda k: k.text[:40])
def test_a_listed_warning_is_hidden(known):
    text = known.text + (" and the rest of it" if known.prefix else "")
    assert _shown(text, known.category) == []


def test_an_unlisted_warning_still_shows():
    listed = PYTHON_WARNINGS[0]
    for message, category in [
        ("Transformer Engine is broken on this GPU", UserWarning),
        (listed.text + " (changed)" if not listed.prefix else "x" + listed.text, UserWarning),
        (listed.text, RuntimeWarning),  # the same text in another category
    ]:
        assert _shown(message, category) == [message]


def test_a_listed_syntax_warning_is_hidden_only_from_its_file():
    (known,) = [k for k in KNOWN if k.category is SyntaxWarning]
    source = "x = '\\-'\n"
    assert known.source is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        known_warnings.install()
        compile(source, "/site-packages/" + known.source, "exec")
        compile(source, "/home/me/my_module.py", "exec")
    assert [(str(w.message), w.filename) for w in caught] == [(known.text, "/home/me/my_module.py")]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("known", LOG_RECORDS, ids=lambda k: f"{k.logger}:{k.text[:30]}")
def test_a_listed_log_record_is_hidden_and_others_of_its_logger_show(known):
    known_warnings.install()
    logger = logging.getLogger(known.logger)
    handler = _Records()
    logger.addHandler(handler)
    try:
        logger.warning(known.text + (" more" if known.prefix else ""))
        logger.warning("the checkpoint directory is not writable")
        logging.getLogger("some.other.logger").addHandler(handler)
        logging.getLogger("some.other.logger").warning(known.text)  # not from its logger
    finally:
        logger.removeHandler(handler)
        logging.getLogger("some.other.logger").removeHandler(handler)
    assert handler.messages == ["the checkpoint directory is not writable", known.text]


def test_installing_twice_adds_nothing():
    with warnings.catch_warnings():
        known_warnings.install()
        count = len(warnings.filters)
        known_warnings.install()
        assert len(warnings.filters) == count
    logger = logging.getLogger(LOG_RECORDS[0].logger)
    assert logger.filters.count(known_warnings._RECORDS) == 1


def test_importing_megatron_core_after_install_prints_none_of_them():
    """What a worker process does: install, then import megatron-core; only the unlisted
    warning reaches stderr. (Its SyntaxWarning is said only when a file is compiled afresh,
    which takes a minute here: the test above covers it.)"""
    script = (
        "import logging, warnings\n"
        "from nemo_rl_offload import known_warnings\n"
        "known_warnings.install()\n"
        "import megatron.core.optimizer, megatron.core.distributed\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "import megatron.core.inference.contexts.kv_block_allocator\n"
        "import megatron.core.models.mimo\n"
        "warnings.warn('an unlisted warning')\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "UserWarning: an unlisted warning" in result.stderr
    for known in KNOWN:
        assert known.text not in result.stderr, known.text
