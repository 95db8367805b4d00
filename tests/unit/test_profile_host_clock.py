"""The host clock of benchmarks/profile_offload_step.py (``--host``): it times Megatron's real
offload hook entry points, including the autograd Functions' static backward methods, and puts
every one back as it was."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_offload_step as profile  # noqa: E402


def _entries(fgo):
    return {
        (where, attribute): profile.entry_owner(where).__dict__[attribute]
        for where, attribute, _ in profile.HOOK_ENTRIES + profile.INNER_ENTRIES
    }


def test_clocks_a_static_backward_and_restores_every_entry():
    import megatron.core.pipeline_parallel as pipeline
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    before, schedule = _entries(fgo), pipeline.get_forward_backward_func
    calls = []
    handler = SimpleNamespace(on_group_start_backward=lambda: calls.append("reload"))
    with profile.host_clock() as totals:
        grads = fgo.FineGrainedOffloadingGroupStartFunction.backward(
            SimpleNamespace(cpu_offload_handler=handler), "grad"
        )
    assert grads == ("grad", None, None, None)
    assert calls == ["reload"]
    assert totals["hook reload"] > 0
    assert set(totals) == {"hook reload"}
    assert _entries(fgo) == before
    assert pipeline.get_forward_backward_func is schedule


def test_every_clocked_entry_exists_in_megatron_and_torch():
    import torch

    for where, attribute, _ in profile.HOOK_ENTRIES + profile.INNER_ENTRIES:
        assert callable(getattr(profile.entry_owner(where), attribute))
    for path, attribute, _ in profile.SYNC_ENTRIES:
        owner = torch
        for part in path.split("."):
            owner = getattr(owner, part)
        assert callable(getattr(owner, attribute)), (path, attribute)


def test_host_detail_without_host_is_one_line(capsys):
    assert profile.main(["--host-detail"]) == 2
    assert capsys.readouterr().err.strip() == "--host-detail: clocks --host steps; add --host"


def test_a_model_override_without_a_value_is_one_line(capsys):
    assert profile.main(["--model-override", "moe_pad_expert_input_to_capacity"]) == 2
    assert "write KEY=VALUE" in capsys.readouterr().err


def test_detail_clocks_inherited_sync_calls_and_removes_them_after():
    import torch
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    assert "item" not in torch.Tensor.__dict__
    event_synchronize = torch.cuda.Event.__dict__["synchronize"]
    before = _entries(fgo)
    with profile.host_clock(detail=True) as totals:
        assert torch.tensor(3).item() == 3
    assert totals["sync item"] > 0
    assert "item" not in torch.Tensor.__dict__
    assert torch.tensor(4).item() == 4
    assert torch.cuda.Event.__dict__["synchronize"] is event_synchronize
    assert _entries(fgo) == before  # the inner entries too


def test_phase_clock_wraps_the_schedule_steps_and_restores_them():
    from megatron.core.pipeline_parallel import schedules

    before = (schedules.forward_step, schedules.backward_step)
    with profile.phase_clock() as clock:
        assert schedules.forward_step is not before[0]
        assert schedules.backward_step is not before[1]
        assert clock.steps == []
    assert (schedules.forward_step, schedules.backward_step) == before


def test_phases_without_host_is_one_line(capsys):
    assert profile.main(["--phases"]) == 2
    assert capsys.readouterr().err.strip() == "--phases: clocks --host steps; add --host"


def test_phase_clock_puts_host_and_gpu_on_one_time_line(monkeypatch):
    """A phase's host and GPU times from its marks: the GPU's from events measured against the
    origin event, the lead as the GPU's entry after the host's, both from the step's first host
    entry."""
    import torch

    class Event:  # a CUDA event at a GPU time (ms) from the origin
        def __init__(self, at_ms: float) -> None:
            self.at_ms = at_ms

        def elapsed_time(self, other: Event) -> float:
            return other.at_ms - self.at_ms

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    clock = profile.PhaseClock()
    clock.origin = (10.0, Event(0.0))  # host seconds, GPU origin
    clock.steps = [
        [
            ("forward", 10.001, 10.003, Event(5.0), Event(9.0)),
            ("backward", 10.004, 10.005, Event(9.0), Event(20.0)),
        ]
    ]
    forward, backward = clock.phases()[0]
    assert forward == {
        "phase": "forward",
        "host_entry_ms": 0.0,
        "host_ms": 2.0,
        "gpu_entry_ms": 4.0,
        "gpu_ms": 4.0,
        "lead_ms": 4.0,
    }
    assert backward["host_entry_ms"] == 3.0
    assert backward["gpu_ms"] == 11.0
    assert backward["lead_ms"] == 5.0
