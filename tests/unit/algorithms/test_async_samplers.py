"""The single controller's samplers as this backend runs them (config/grpo_options.async_lead):
a small model of NeMo-RL's selection rules, driven as generation on the training GPUs drives
them (every dispatched batch ready when a step selects, dispatch admitted as each sampler
admits it), selects at every step exactly the groups that ``RolloutPipeline`` with
``async_lead``'s lead hands to that step, sampled by the same weights; any other lead does not.

The model's trainer version is the loop's step less one (a step's weights have seen that many
updates) and its dispatch index is the target step less one (NeMo-RL's batch of that index is
the synchronous loop's prompts of that step)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from nemo_rl_offload.algorithms.async_rollouts import RolloutPipeline
from nemo_rl_offload.config.grpo_options import async_lead

GROUPS_PER_STEP = 3


@dataclass(frozen=True)
class Entry:
    """A prompt group in NeMo-RL's replay buffer: the weights that started it, its batch (the
    dispatch index, which is also the batch's data) and its place in the batch."""

    start_weight: int
    dispatch: int
    group: int


Buffer = list[Entry]
Select = Callable[[Buffer, int, int, int], Buffer]


def _in_window(entry: Entry, version: int, window: int) -> bool:
    return max(0, version - window) <= entry.start_weight <= version


def select_in_order(buffer: Buffer, version: int, window: int, wanted: int) -> Buffer:
    """The batch stamped with the trainer version (its dispatch index)."""
    return [e for e in buffer if e.dispatch == version][:wanted]


def select_ready_first(buffer: Buffer, version: int, window: int, wanted: int) -> Buffer:
    """Ready groups of weights no newer than the trainer's, in buffer order."""
    return [e for e in buffer if e.start_weight <= version][:wanted]


def select_weight_fifo(buffer: Buffer, version: int, window: int, wanted: int) -> Buffer:
    """The ready groups of the oldest start weight within the window."""
    weights = [e.start_weight for e in buffer if _in_window(e, version, window)]
    if not weights:
        return []
    return [e for e in buffer if e.start_weight == min(weights)][:wanted]


def select_windowed(buffer: Buffer, version: int, window: int, wanted: int) -> Buffer:
    """Ready groups within the window, oldest first (buffer order)."""
    return [e for e in buffer if _in_window(e, version, window)][:wanted]


def select_windowed_freshest(buffer: Buffer, version: int, window: int, wanted: int) -> Buffer:
    """Ready groups within the window, the smallest lag first (buffer order among equals)."""
    valid = [e for e in buffer if _in_window(e, version, window)]
    return sorted(valid, key=lambda e: version - e.start_weight)[:wanted]


def evict_out_of_window(buffer: Buffer, version: int, window: int) -> Buffer:
    """Weight FIFO's and the windowed sampler's eviction (ready first never evicts)."""
    return [e for e in buffer if e.start_weight >= max(0, version - window)]


@dataclass(frozen=True)
class Rule:
    """One sampler: its selection, whether it evicts, whether the trainer version gates its
    dispatch (else the buffer's capacity bounds it), and its recipe section."""

    name: str
    select: Select
    evicts: bool
    gated: bool
    freshest_first: bool = False

    def sampler(self, window: int | None) -> dict:
        section: dict = {"name": self.name}
        if window is not None:
            key = "max_lookahead_versions" if self.name == "in_order" else "max_staleness_versions"
            section[key] = window
        if self.freshest_first:
            section["sample_freshest_first"] = True
        return section


RULES = [
    Rule("in_order", select_in_order, evicts=False, gated=True),
    Rule("ready_first", select_ready_first, evicts=False, gated=True),
    Rule("weight_fifo", select_weight_fifo, evicts=True, gated=True),
    Rule("windowed", select_windowed, evicts=True, gated=False),
]
FRESHEST = Rule("windowed", select_windowed_freshest, evicts=True, gated=False, freshest_first=True)


def _admits(rule: Rule, window: int, next_dispatch: int, version: int, buffered: int) -> bool:
    """Whether the next batch may dispatch: gated, at most ``window`` batches ahead of the
    trainer version; ungated, while the buffer has room for a batch (it holds the step's own
    batch and ``window`` more)."""
    if rule.gated:
        return next_dispatch <= version + window
    return buffered + GROUPS_PER_STEP <= (window + 1) * GROUPS_PER_STEP


def nemo_rl_schedule(rule: Rule, window: int, steps: int) -> list[Buffer]:
    """Each step's groups under NeMo-RL's rules, generation between steps with the weights of
    the trainer version: every admitted batch is ready when the step selects."""
    buffer: Buffer = []
    next_dispatch = 0
    chosen: list[Buffer] = []
    for version in range(steps):
        while _admits(rule, window, next_dispatch, version, len(buffer)):
            buffer += [Entry(version, next_dispatch, g) for g in range(GROUPS_PER_STEP)]
            next_dispatch += 1
        if rule.evicts:
            buffer = evict_out_of_window(buffer, version, window)
        picked = rule.select(buffer, version, window, GROUPS_PER_STEP)
        buffer = [e for e in buffer if e not in picked]
        chosen.append(picked)
    return chosen


def pipeline_schedule(lead: int, steps: int) -> list[Buffer]:
    """Each step's groups as this backend's GRPO loop gets them: ``RolloutPipeline`` at the
    lead (the synchronous loop at zero), ``collect`` sampling with the weights of now."""
    now = 1

    def collect(target: int) -> tuple[list[Entry], dict[str, float]]:
        return [Entry(now - 1, target - 1, g) for g in range(GROUPS_PER_STEP)], {}

    if lead == 0:
        taken = []
        for now in range(1, steps + 1):
            taken.append(collect(now)[0])
        return taken
    pipeline = RolloutPipeline(lead, collect, exhausted=lambda: False, last_step=steps)
    taken = []
    for now in range(1, steps + 1):
        taken.append(pipeline.take(now).groups)
    return taken


def _recipe(rule: Rule, window: int | None) -> dict:
    return {"grpo": {}, "async_rl": {"sampler": rule.sampler(window)}}


@pytest.mark.parametrize("steps", [4, 9])
@pytest.mark.parametrize("window", [None, 0, 1, 2, 3])
@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_each_sampler_selects_what_the_pipeline_at_async_leads_lead_hands_over(rule, window, steps):
    lead = async_lead(_recipe(rule, window))
    expected = nemo_rl_schedule(rule, 1 if window is None else window, steps)
    assert all(len(groups) == GROUPS_PER_STEP for groups in expected)
    assert pipeline_schedule(lead, steps) == expected


@pytest.mark.parametrize("window", [0, 1, 2, 3])
@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_another_lead_hands_over_other_weights(rule, window):
    """The comparison above tells leads apart: a lead one more or one less than async_lead's
    gives some step rollouts of other weights."""
    steps = window + 4
    expected = nemo_rl_schedule(rule, window, steps)
    lead = async_lead(_recipe(rule, window))
    for other in (lead - 1, lead + 1):
        if other >= 0:
            assert pipeline_schedule(other, steps) != expected


@pytest.mark.parametrize("window", [None, 0, 1, 3])
def test_windowed_freshest_first_trains_on_the_current_weights_rollouts(window):
    """Every step takes groups its own weights sampled, as the synchronous loop does (lead 0);
    which prompts those are differs, as NeMo-RL's over-sampling makes them differ."""
    steps = 8
    chosen = nemo_rl_schedule(FRESHEST, 1 if window is None else window, steps)
    assert async_lead(_recipe(FRESHEST, window)) == 0
    synchronous = pipeline_schedule(0, steps)
    assert [[e.start_weight for e in groups] for groups in chosen] == [
        [e.start_weight for e in groups] for groups in synchronous
    ]
