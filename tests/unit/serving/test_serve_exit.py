"""``nemo-rl-offload serve`` exits 1 once the policy's workers stop under it (a supervisor
restarts it), rather than serving on with nothing behind it. The tiny GRPO recipe, checked
and served as ``serve`` does, over a stand-in for the worker group (no Ray)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from nemo_rl_offload.policy.generation import Generated
from nemo_rl_offload.serving import serve as serve_module

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny" / "grpo.yaml"


class _Group:
    """The policy group as ``serve`` uses it; ``stopped`` set by the test."""

    made: list[_Group] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stopped: str | None = None
        self.shut = False
        self.warnings: list[str] = []
        _Group.made.append(self)

    def check_alive(self) -> str | None:
        return self.stopped

    def generate(self, prompts, settings, *, seed, pad_id, record_routes=False):
        return [Generated([1], [-0.5]) for _ in prompts]

    def shutdown(self) -> None:
        self.shut = True


def test_serve_exits_1_once_the_workers_stop(monkeypatch, capsys):
    monkeypatch.setattr(serve_module, "PolicyGroup", _Group)
    monkeypatch.setattr(serve_module.cluster, "start_or_join", lambda *a, **k: None)
    monkeypatch.setattr(serve_module.cluster, "shutdown", lambda info: None)
    result: dict[str, int] = {}
    thread = threading.Thread(
        target=lambda: result.update(
            rc=serve_module.serve(str(RECIPE), ["policy.init_checkpoint=null"])
        ),
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 120
    while not _Group.made and time.monotonic() < deadline:
        time.sleep(0.05)
    group = _Group.made[-1]
    time.sleep(0.5)
    assert thread.is_alive()  # serving
    group.stopped = "policy worker 1 died"
    thread.join(30)
    assert result == {"rc": 1}
    assert group.shut
    assert "the policy's workers stopped (policy worker 1 died)" in capsys.readouterr().err
