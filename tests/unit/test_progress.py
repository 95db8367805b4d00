"""The progress reporter's rate limit, driven by a fake clock: a line when a phase starts, then
at most one per interval, and a last line only for a phase that ran an interval or longer."""

from __future__ import annotations

from io import StringIO

import pytest

from nemo_rl_offload import progress as progress_module
from nemo_rl_offload.progress import Progress, interval_from_env


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _reporter(**kwargs) -> tuple[Progress, Clock, StringIO]:
    clock, out = Clock(), StringIO()
    return Progress("grpo step 3", interval_s=10, clock=clock, stream=out, **kwargs), clock, out


def test_a_line_at_start_then_one_per_interval_then_a_final_line():
    progress, clock, out = _reporter()
    progress.start("generation", 128, unit="rows")
    assert out.getvalue().splitlines() == ["[grpo step 3] generation: 128 rows ..."]
    for second in range(1, 26):  # an update every second: lines at 10 s and 20 s only
        clock.now += 1
        progress.update(second * 4, new_tokens_per_s=1840.4)
    clock.now += 0.5
    progress.finish()
    assert out.getvalue().splitlines() == [
        "[grpo step 3] generation: 128 rows ...",
        "[grpo step 3] generation: 40/128 rows done, 1,840 new tokens/s (10 s)",
        "[grpo step 3] generation: 80/128 rows done, 1,840 new tokens/s (20 s)",
        "[grpo step 3] generation: finished, 100/128 rows done, 1,840 new tokens/s (26 s)",
    ]


def test_a_fast_phase_says_only_that_it_started():
    progress, clock, out = _reporter()
    progress.start("training")
    clock.now += 9.9
    progress.update(3)
    progress.start("checkpoint save")  # ends training: it was never slow
    clock.now += 1
    progress.finish()
    assert out.getvalue().splitlines() == [
        "[grpo step 3] training ...",
        "[grpo step 3] checkpoint save ...",
    ]


def test_the_heartbeat_repeats_the_state_while_the_caller_is_blocked():
    progress, clock, out = _reporter()
    progress.start("log-probabilities")
    clock.now += 5
    progress.tick()  # not due yet
    clock.now += 5
    progress.tick()
    clock.now += 61
    progress.tick()
    progress.finish()
    assert out.getvalue().splitlines()[1:] == [
        "[grpo step 3] log-probabilities: running (10 s)",
        "[grpo step 3] log-probabilities: running (1 min 11 s)",
        "[grpo step 3] log-probabilities: finished (1 min 11 s)",
    ]


def test_an_unannounced_phase_speaks_only_when_slow():
    progress, clock, out = _reporter()
    progress.start("training", 16, unit="micro-batches", announce=False)
    clock.now += 3
    progress.update(4)
    assert out.getvalue() == ""
    clock.now += 8
    progress.update(12)
    assert out.getvalue().splitlines() == [
        "[grpo step 3] training: 12/16 micro-batches done (11 s)"
    ]


def test_a_disabled_reporter_and_updates_outside_a_phase_print_nothing():
    progress, clock, out = _reporter(enabled=False)
    progress.start("generation", 8)
    clock.now += 100
    progress.update(4)
    progress.finish()
    idle, clock, idle_out = _reporter()
    clock.now += 100
    idle.update(4)
    idle.tick()
    idle.finish()
    assert out.getvalue() == idle_out.getvalue() == ""


def test_the_heartbeat_thread_prints_while_nothing_updates():
    out = StringIO()
    progress = Progress("plan", interval_s=0.05, stream=out, heartbeat=True)
    progress.start("trial 1/3: core_attn")
    try:
        import time

        deadline = time.monotonic() + 5
        while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[plan] trial 1/3: core_attn ..."
    assert len(lines) >= 3 and lines[1].startswith("[plan] trial 1/3: core_attn: running (")


@pytest.mark.parametrize(
    "value,expected",
    [("", 10.0), ("2.5", 2.5), ("0", None), ("off", None), ("-1", None)],
)
def test_the_interval_comes_from_the_environment(value, expected):
    assert interval_from_env({progress_module.INTERVAL_ENV: value}) == expected


def test_a_bad_interval_is_one_line_and_the_default(capsys):
    assert interval_from_env({progress_module.INTERVAL_ENV: "ten"}) == 10.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NEMO_RL_OFFLOAD_PROGRESS_INTERVAL_S='ten'" in err
