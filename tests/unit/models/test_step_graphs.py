"""StepGraphs: per-key warm-up, capture, replay with fresh inputs, release.

The warm-up bookkeeping runs anywhere; capturing and replaying need a CUDA GPU (marker gpu).
"""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.policy.step_graphs import StepGraphs, input_signature


def _double_plus_one(inputs: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{"y": mb["x"] * 2 + 1} for mb in inputs]


def test_warmup_steps_run_eagerly_per_key():
    graphs = StepGraphs(warmup_steps=2)
    calls = []

    def step(inputs):
        calls.append(inputs[0]["x"].clone())
        return _double_plus_one(inputs)

    for key, value in (("a", 1.0), ("b", 2.0), ("a", 3.0), ("b", 4.0)):
        outputs, mode = graphs.run(key, [{"x": torch.tensor([value])}], step)
        assert mode == "eager"
        assert float(outputs[0]["y"]) == 2 * value + 1
    assert len(calls) == 4 and graphs.kept() == 0
    assert graphs.metrics("eager") == {
        "cuda_graph_replayed": 0.0,
        "cuda_graph_captured": 0.0,
        "cuda_graphs_kept": 0.0,
        "cuda_graphs_released": 0.0,
    }


def test_release_forgets_the_warmup_of_matching_keys():
    graphs = StepGraphs(warmup_steps=1)
    graphs.run(("shape", 1), [{"x": torch.zeros(1)}], _double_plus_one)
    graphs.run(("shape", 2), [{"x": torch.zeros(1)}], _double_plus_one)
    assert graphs.release(lambda key: key[1] == 1) == 0  # nothing captured yet
    assert set(graphs._keys) == {("shape", 2)}


def test_warmup_must_be_positive():
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        StepGraphs(warmup_steps=0)


def test_signature_names_every_tensor_shape_and_dtype():
    a = [{"input_ids": torch.zeros(2, 8, dtype=torch.long), "mask": torch.zeros(2, 8)}]
    b = [{"mask": torch.zeros(2, 8), "input_ids": torch.zeros(2, 8, dtype=torch.long)}]
    assert input_signature(a) == input_signature(b)
    assert input_signature(a) != input_signature([{**a[0], "mask": torch.zeros(2, 16)}])
    assert input_signature(a) != input_signature(a + a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_then_replay_with_new_inputs():
    graphs = StepGraphs(warmup_steps=1)
    device = torch.device("cuda")

    def run(key, value, length=4):
        inputs = [{"x": torch.full((length,), value, device=device)}]
        outputs, mode = graphs.run(key, inputs, _double_plus_one)
        return outputs[0]["y"].tolist(), mode

    assert run("k", 1.0) == ([3.0] * 4, "eager")
    assert run("k", 2.0) == ([5.0] * 4, "captured")
    assert run("k", 5.0) == ([11.0] * 4, "replayed")  # the new input went into the graph
    assert run("other", 1.0, length=8) == ([3.0] * 8, "eager")
    assert run("other", 7.0, length=8) == ([15.0] * 8, "captured")
    assert run("k", 0.0) == ([1.0] * 4, "replayed")
    assert graphs.kept() == 2
    assert graphs.release(lambda key: key == "k") == 1
    assert graphs.kept() == 1 and graphs.released == 1
    assert run("k", 1.0) == ([3.0] * 4, "eager")  # a released key warms up again
