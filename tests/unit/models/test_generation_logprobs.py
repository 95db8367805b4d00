"""The sampler returns each sampled token's log-probability, and it is the one the training
forward computes for the same token (GRPO's importance weights and sequence log-probability
error compare the two), whatever the sampling settings."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.models.chunked_logprobs import install
from nemo_rl_offload.policy.generation import Generated, SamplingSettings, sample

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
    if not settings.greedy:  # the policy workers' GRPO forward: logits / sampling temperature
        install(model, None, settings.temperature)
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


def test_a_sampling_temperature_changes_the_training_log_probabilities(build_tiny):
    """The temperature the workers take (GRPO's) is the one the logits are divided by: the
    log-probabilities of logits / T, not the raw ones."""
    model, _ = build_tiny("tiny-dense")
    prompt, response = PROMPTS[0], [4, 11, 6]
    raw = _training_logprobs(model, prompt, response)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[0].float()
    start = len(prompt) - 1
    wanted = torch.log_softmax(logits / 0.5, dim=-1)[start : start + len(response)]
    expected = wanted.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)
    install(model, None, 0.5)
    tempered = _training_logprobs(model, prompt, response)
    torch.testing.assert_close(tempered, expected, atol=1e-4, rtol=0)
    assert (tempered - raw).abs().max() > 1e-2


def test_a_long_call_says_how_many_rows_are_done(build_tiny, monkeypatch, capsys):
    """The sampler's progress lines (rows finished, new tokens per second) reach stderr when a
    call runs past the interval; with the default interval a short call prints nothing."""
    model, _ = build_tiny("tiny-dense")
    settings = SamplingSettings(max_new_tokens=6, stop_token_ids=(), vocab_limit=300)
    kwargs = {"pad_id": 0, "vocab_size": model.vocab_size, "seed": 3, "device": torch.device("cpu")}
    sample(model, PROMPTS, settings, **kwargs)
    assert "[sampler]" not in capsys.readouterr().err
    monkeypatch.setenv("NEMO_RL_OFFLOAD_PROGRESS_INTERVAL_S", "1e-9")
    sample(model, PROMPTS, settings, **kwargs)
    lines = [line for line in capsys.readouterr().err.splitlines() if "[sampler]" in line]
    assert lines and all("generation:" in line for line in lines)
    assert any("rows done" in line and "new tokens/s" in line for line in lines), lines
    assert "finished, 3/3 rows done" in lines[-1]
