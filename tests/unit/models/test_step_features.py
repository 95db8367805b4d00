"""The seam features enter the training step through (policy.step_features): a registered
feature's inputs reach its forward, its keyword arguments and context wrap the model's call, and
its after-pass runs even when the pass raises; the step itself names no feature."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl_offload.models.step_feature import FeatureInput
from nemo_rl_offload.policy import step_features, train_step
from nemo_rl_offload.policy.train_step import run_microbatches

SEQ = 16


class Recording:
    """A feature that records what the step hands it."""

    forward_keys = ("marks",)

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.inside = False
        self.calls_inside: list[bool] = []
        self.after: list[int] = []

    def start_step(self, model: Any, device: Any) -> None:
        return None

    def inputs(self, model: Any, batch: Any) -> dict[str, FeatureInput]:
        marks = batch.get("marks")
        return {} if marks is None else {"marks": FeatureInput(marks, -7)}

    def forward(self, model: Any, inputs: Any, *, training: bool):
        if "marks" in inputs:
            self.seen.append(inputs["marks"])

        @contextlib.contextmanager
        def around():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

        return {}, around()

    def after_pass(self, model: Any, microbatches: list[Any]) -> None:
        self.after.append(len(microbatches))

    def step_metrics(self, model: Any, device: Any, microbatches: int) -> dict[str, float]:
        return {"recorded": float(len(self.seen))}


def _loss(batch, output):
    return output.sum(), batch["input_ids"].numel(), {}


@pytest.fixture
def recording(monkeypatch):
    feature = Recording()
    monkeypatch.setattr(train_step, "STEP_FEATURES", (*step_features.STEP_FEATURES, feature))
    return feature


def _batch(vocab: int, length: int = SEQ) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0))
    marks = torch.arange(2 * length).reshape(2, length)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1), "marks": marks}


def test_a_registered_feature_sees_its_inputs_inside_its_context(build_tiny, recording):
    model, _ = build_tiny("tiny-dense")
    original_call = type(model).__call__

    def watched(self, *args, **kwargs):
        recording.calls_inside.append(recording.inside)
        return original_call(self, *args, **kwargs)

    batch = _batch(model.vocab_size)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(model), "__call__", watched)
        run_microbatches(model, [batch, batch], _loss, forward_only=False)
    assert recording.calls_inside == [True, True]
    assert [torch.equal(seen, batch["marks"]) for seen in recording.seen] == [True, True]
    assert recording.after == [2]


def test_padding_fills_a_features_input_with_its_own_value(build_tiny, recording):
    model, _ = build_tiny("tiny-dense")
    batch = _batch(model.vocab_size, length=SEQ - 3)
    padded = train_step._pad_to(batch, 3, SEQ, model)
    assert padded["marks"].shape == (3, SEQ)
    assert torch.equal(padded["marks"][:2, : SEQ - 3], batch["marks"])
    assert (padded["marks"][:, SEQ - 3 :] == -7).all() and (padded["marks"][2] == -7).all()
    assert (padded["input_ids"][:, SEQ - 3 :] == 0).all()


def test_after_pass_runs_when_the_pass_raises(build_tiny, recording):
    model, _ = build_tiny("tiny-dense")

    def failing(batch, output):
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        run_microbatches(model, [_batch(model.vocab_size)], failing, forward_only=True)
    assert recording.after == [1]


def test_forward_only_passes_send_what_the_features_read() -> None:
    assert "marks" not in train_step.FORWARD_INPUTS  # only registered features count
    assert set(step_features.forward_keys()) <= set(train_step.FORWARD_INPUTS)


def test_the_step_and_the_worker_name_no_feature() -> None:
    """Features enter through the registry: the step's modules import none of them."""
    policy = Path(train_step.__file__).parent
    for name in ("train_step.py", "policy_worker.py"):
        source = (policy / name).read_text()
        for feature in ("models import mtp", "models.mtp", "models import router_replay"):
            assert feature not in source, f"{name} names {feature}"
