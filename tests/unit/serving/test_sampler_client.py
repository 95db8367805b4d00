"""megatron-core's sampling parameters as this sampler's settings, and what is refused."""

from __future__ import annotations

import pytest
from megatron.core.inference.sampling_params import SamplingParams

from nemo_rl_offload.policy.generation import SamplingSettings
from nemo_rl_offload.serving.sampler_client import SamplerClient

EOS = 9


def _client(**kwargs) -> SamplerClient:
    return SamplerClient(
        lambda prompts, settings, seed: [],
        decode=str,
        max_len=32,
        eos_id=EOS,
        stop_token_ids=(7,),
        vocab_limit=100,
        **kwargs,
    )


def test_sampling_parameters_map_to_the_samplers_settings():
    client = _client()
    prompt = [1, 2, 3]
    settings = client.settings_for(
        prompt, SamplingParams(temperature=0.7, top_p=0.9, top_k=20, num_tokens_to_generate=5)
    )
    assert settings == SamplingSettings(
        max_new_tokens=5,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        stop_token_ids=(7, EOS),
        vocab_limit=100,
    )
    # megatron-core's defaults: top_p 0 and top_k 0 are "off"; no limit is the rest of the
    # context
    settings = client.settings_for(prompt, SamplingParams(temperature=1.0))
    assert (settings.top_p, settings.top_k, settings.max_new_tokens) == (1.0, None, 29)
    # temperature 0 (the endpoints turn it into top_k 1) is greedy
    greedy = client.settings_for(prompt, SamplingParams(temperature=0.0, top_k=1))
    assert greedy.greedy and greedy.top_k is None and greedy.temperature == 1.0
    # ignore_eos: no stop token; a termination id of the request's own: that one only
    assert client.settings_for(prompt, SamplingParams(termination_id=-1)).stop_token_ids == ()
    assert client.settings_for(prompt, SamplingParams(termination_id=4)).stop_token_ids == (4,)
    total = client.settings_for(prompt, SamplingParams(num_tokens_total=10))
    assert total.max_new_tokens == 7


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(num_tokens_to_generate=30), "MaxSequenceLengthOverflowError"),
        (SamplingParams(num_tokens_to_generate=0), "max_tokens: 0 must be at least 1"),
        (SamplingParams(return_log_probs=True, top_n_logprobs=3), "top_logprobs: 3"),
        (
            SamplingParams(return_log_probs=True, skip_prompt_log_probs=False),
            "prompt log-probabilities",
        ),
        (SamplingParams(stop_words=["</s>"]), "stop: ['</s>'] is not served"),
    ],
)
def test_what_cannot_be_served_is_named(params, expected):
    message = _client().settings_for([1, 2, 3], params)
    assert isinstance(message, str) and expected in message


def test_the_prompt_fills_the_context():
    assert "context length" in _client().settings_for(list(range(32)), SamplingParams())
    assert _client().settings_for([], SamplingParams()) == (
        "the prompt is empty: it needs at least one token"
    )


def test_a_burst_is_gathered_into_one_call_until_it_goes_quiet():
    """Requests 20 ms apart (under the 50 ms window) share one sampler call; a request after a
    pause longer than the window goes into the next."""
    import asyncio

    from nemo_rl_offload.policy.generation import Generated

    calls: list[int] = []

    def generate(prompts, settings, seed):
        calls.append(len(prompts))
        return [Generated([EOS], [-0.5]) for _ in prompts]

    client = SamplerClient(
        generate, decode=str, max_len=32, eos_id=EOS, gather_quiet_s=0.05, gather_max_s=1.0
    )

    async def burst() -> list[dict]:
        async def ask(delay: float) -> dict:
            await asyncio.sleep(delay)
            return await client.add_request([1, 2], SamplingParams(num_tokens_to_generate=2))

        return await asyncio.gather(*(ask(d) for d in (0.0, 0.02, 0.04, 0.06, 0.8)))

    records = asyncio.run(burst())
    client.stop()
    assert calls == [4, 1]
    assert all(r["status"] == "COMPLETED" and r["generated_tokens"] == [EOS] for r in records)


def test_a_completion_carries_its_routes_for_router_replay():
    """With routes recorded (policy.router_replay), the record's routing_indices are the
    experts of the prompt's and the kept tokens' positions (megatron-core's endpoints return
    them as each choice's moe_topk_indices)."""
    import asyncio

    import numpy as np

    from nemo_rl_offload.policy.generation import Generated

    routes = np.arange(6 * 2 * 1).reshape(6, 2, 1)  # prompt 2 + 4 sampled, 2 layers, top-1

    def generate(prompts, settings, seed):
        return [Generated([3, 4, 5, EOS], [-0.1] * 4, routes) for _ in prompts]

    client = SamplerClient(generate, decode=str, max_len=32, eos_id=EOS, gather_quiet_s=0.0)
    record = asyncio.run(client.add_request([1, 2], SamplingParams(num_tokens_to_generate=3)))
    client.stop()
    assert record["generated_tokens"] == [3, 4, 5]  # cut at its own max_tokens
    assert record["routing_indices"] == routes[:5].tolist()


def test_a_failing_call_is_retried_request_by_request_so_only_its_culprit_fails(caplog):
    """A sampler call that raises (a worker's error) is logged; its requests are sampled again
    one by one, so the request the policy cannot take fails alone, with a generic message."""
    import asyncio

    from nemo_rl_offload.policy.generation import Generated

    calls: list[int] = []

    def generate(prompts, settings, seed):
        calls.append(len(prompts))
        if any(13 in p for p in prompts):
            raise RuntimeError("index out of range in the embedding (at model.py:3 in forward)")
        return [Generated([EOS], [-0.5]) for _ in prompts]

    client = SamplerClient(generate, decode=str, max_len=32, eos_id=EOS, gather_quiet_s=0.05)

    async def burst() -> list[dict]:
        params = SamplingParams(num_tokens_to_generate=2)
        return await asyncio.gather(
            *(client.add_request(p, params) for p in ([1, 2], [13, 2], [3]))
        )

    with caplog.at_level("ERROR", logger="nemo_rl_offload.serving"):
        records = asyncio.run(burst())
    client.stop()
    assert calls == [3, 1, 1, 1]
    assert [r["status"] for r in records] == ["COMPLETED", "FAILED", "COMPLETED"]
    failed = records[1]["events"][0]
    assert failed == {"type": "ERROR_TRANSIENT", "payload": "the policy's sampler failed"}
    assert "index out of range" in caplog.text  # the details go to the log


def test_a_token_id_outside_the_vocabulary_is_refused():
    message = _client().settings_for([1, 100], SamplingParams())
    assert message.startswith("prompt: token id 100 is outside the vocabulary [0, 100)")
