"""The sampler returns each sampled token's log-probability, and it is the one the training
forward computes for the same token (GRPO's importance weights and sequence log-probability
error compare the two), whatever the sampling settings."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.models.generation import Generated, SamplingSettings, sample

PROMPTS = [[5, 17, 3, 9], [8, 2], [30, 31, 32]]


def _training_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response token | prefix) from one forward over prompt + response, as the policy
    workers' token_logprobs computes it (minus the per-token loss of the labels)."""
    ids = torch.tensor([prompt + response])
    labels = torch.roll(ids, -1, dims=1)
    position = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logprobs = -model(ids, position, None, labels=labels)[0]
    return logprobs[len(prompt) - 1 : len(prompt) - 1 + len(response)]


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(max_new_tokens=6),
        SamplingSettings(max_new_tokens=6, temperature=0.7, top_k=20, top_p=0.9, vocab_limit=300),
        SamplingSettings(max_new_tokens=6, greedy=True),
    ],
    ids=["plain", "tempered-filtered", "greedy"],
)
def test_generation_logprobs_equal_the_training_forward(build_tiny, settings):
    model, _ = build_tiny("tiny-dense")
    generated = sample(
        model,
        PROMPTS,
        settings,
        pad_id=0,
        vocab_size=model.vocab_size,
        seed=3,
        device=torch.device("cpu"),
    )
    assert all(isinstance(g, Generated) for g in generated)
    for prompt, g in zip(PROMPTS, generated, strict=True):
        assert len(g.logprobs) == len(g.ids) > 0
        assert all(lp < 0 for lp in g.logprobs)
        expected = _training_logprobs(model, prompt, g.ids)
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=1e-4, rtol=0)
