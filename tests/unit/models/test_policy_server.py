"""The policy served over HTTP: megatron-core's OpenAI endpoints in front of the KV-cached
sampler of a real tiny model, asked as OpenAI clients and NeMo-Gym's model server ask."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch

from nemo_rl_offload.data.tokenizer import ByteTokenizer
from nemo_rl_offload.policy.generation import Generated, SamplingSettings, sample
from nemo_rl_offload.serving.http_server import PolicyServer
from nemo_rl_offload.serving.sampler_client import SamplerClient

CPU = torch.device("cpu")
MAX_LEN = 96


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _client(model, tokenizer, before_call, **options) -> SamplerClient:
    """The client over the real KV-cached sampler of ``model``; ``before_call(prompts,
    settings)`` sees each sampler call first."""

    def generate(
        prompts: list[list[int]], settings: SamplingSettings, seed: int
    ) -> list[Generated]:
        before_call(prompts, settings)
        return sample(
            model,
            prompts,
            settings,
            pad_id=tokenizer.pad_id,
            vocab_size=model.vocab_size,
            seed=seed,
            device=CPU,
        )

    return SamplerClient(
        generate,
        decode=tokenizer.decode,
        max_len=MAX_LEN,
        eos_id=tokenizer.eos_id,
        vocab_limit=tokenizer.vocab_size,
        max_batch=8,
        **options,
    )


@pytest.fixture
def served(build_tiny):
    """A tiny dense model behind the server; yields (server, calls: the sampler's batches)."""
    model, _ = build_tiny("tiny-dense")
    tokenizer = ByteTokenizer()
    calls: list[tuple[int, SamplingSettings]] = []
    client = _client(
        model,
        tokenizer,
        lambda prompts, settings: calls.append((len(prompts), settings)),
        policy_epoch=lambda: 3,
    )
    with PolicyServer(client, tokenizer, model_name="tiny-dense") as server:
        yield server, calls, model, tokenizer


def test_chat_completion_returns_the_tokens_and_logprobs_of_its_sample(served):
    server, calls, model, tokenizer = served
    messages = [{"role": "user", "content": "1+2="}]
    status, body = _post(
        f"{server.base_url}/chat/completions",
        {
            "model": "tiny-dense",
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 0,
        },
    )
    assert status == 200, body
    message = body["choices"][0]["message"]
    prompt = tokenizer.apply_chat_template(messages)
    assert message["prompt_token_ids"] == prompt
    generated = message["generation_token_ids"]
    assert 1 <= len(generated) <= 6
    # the sampler's greedy tokens and log-probabilities, as a direct call gives them
    direct = sample(
        model,
        [prompt],
        SamplingSettings(
            max_new_tokens=6,
            greedy=True,
            stop_token_ids=(tokenizer.eos_id,),
            vocab_limit=tokenizer.vocab_size,
        ),
        pad_id=tokenizer.pad_id,
        vocab_size=model.vocab_size,
        seed=0,
        device=CPU,
    )[0]
    assert generated == direct.ids
    assert message["generation_log_probs"] == pytest.approx(direct.logprobs, abs=1e-6)
    assert [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]] == pytest.approx(
        direct.logprobs, abs=1e-6
    )
    assert message["policy_epoch"] == 3
    assert body["usage"]["prompt_tokens"] == len(prompt)
    finish = body["choices"][0]["finish_reason"]
    assert finish == ("stop" if generated[-1] == tokenizer.eos_id else "length")


def test_requests_arriving_during_a_call_share_the_next_call_each_cut_at_its_own_limit(
    build_tiny,
):
    model, _ = build_tiny("tiny-dense")
    tokenizer = ByteTokenizer()
    calls: list[tuple[int, int]] = []
    first_call_running, release = threading.Event(), threading.Event()

    def before_call(prompts, settings):
        calls.append((len(prompts), settings.max_new_tokens))
        if len(calls) == 1:
            first_call_running.set()
            release.wait(60)

    client = _client(model, tokenizer, before_call)
    results: dict[int, Any] = {}
    with PolicyServer(client, tokenizer, model_name="tiny-dense") as server:

        def ask(index: int, max_tokens: int) -> None:
            results[index] = _post(
                f"{server.base_url}/completions",
                {"prompt": f"{index}+{index}=", "max_tokens": max_tokens, "temperature": 0},
            )

        first = threading.Thread(target=ask, args=(0, 4))
        first.start()
        assert first_call_running.wait(60)
        others = [threading.Thread(target=ask, args=(i, 2 + i)) for i in range(1, 5)]
        for thread in others:
            thread.start()
        deadline = time.monotonic() + 60
        while client.waiting < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        for thread in [first, *others]:
            thread.join(120)
    # one call for the first request, one for the four that queued behind it, at their
    # longest limit
    assert calls == [(1, 4), (4, 6)]
    for index in range(1, 5):
        status, body = results[index]
        assert status == 200, body
        choice = body["choices"][0]
        assert len(choice["generation_token_ids"]) <= 2 + index
        assert len(choice["generation_log_probs"]) == len(choice["generation_token_ids"])


def test_a_second_turn_starts_with_the_first_turns_sampled_tokens(served):
    """NeMo-RL trains a multi-turn rollout from its turns' tokens and asserts each prompt
    begins with everything sampled before: megatron-core's splice keeps that."""
    server, _, _, _ = served
    messages = [{"role": "user", "content": "3+4="}]
    status, first = _post(
        f"{server.base_url}/chat/completions",
        {"messages": messages, "max_tokens": 5, "temperature": 1.0, "seed": 1},
    )
    assert status == 200, first
    turn = first["choices"][0]["message"]
    seen = turn["prompt_token_ids"] + turn["generation_token_ids"]
    messages += [
        {
            "role": "assistant",
            "content": turn["content"],
            "prompt_token_ids": turn["prompt_token_ids"],
            "generation_token_ids": turn["generation_token_ids"],
        },
        {"role": "user", "content": "and 5+6="},
    ]
    status, second = _post(
        f"{server.base_url}/chat/completions", {"messages": messages, "max_tokens": 5}
    )
    assert status == 200, second
    prompt = second["choices"][0]["message"]["prompt_token_ids"]
    assert prompt[: len(seen)] == seen
    assert len(prompt) > len(seen)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": MAX_LEN}, "maximum context length"),
        ({"max_tokens": 4, "logprobs": True, "top_logprobs": 2}, "top_logprobs: 2"),
        ({"max_tokens": 0}, "max_tokens: 0"),
    ],
)
def test_what_the_sampler_cannot_serve_is_a_400_naming_it(served, body, expected):
    server, calls, _, _ = served
    status, text = _post(
        f"{server.base_url}/chat/completions",
        {"messages": [{"role": "user", "content": "9+9="}], **body},
    )
    assert status == 400
    assert expected in text
    assert calls == []  # refused before any sampling


def test_stop_strings_are_refused_and_different_settings_sample_apart(served):
    server, calls, _, _ = served
    status, text = _post(
        f"{server.base_url}/completions", {"prompt": "1+1=", "max_tokens": 3, "stop": ["\n"]}
    )
    assert status == 400 and "stop" in text
    for temperature in (0.5, 1.0):
        status, body = _post(
            f"{server.base_url}/completions",
            {"prompt": "1+1=", "max_tokens": 3, "temperature": temperature, "top_k": 5},
        )
        assert status == 200, body
    assert [(rows, s.temperature, s.top_k) for rows, s in calls] == [(1, 0.5, 5), (1, 1.0, 5)]


def test_models_and_health_are_listed(served):
    server, _, _, _ = served
    with urllib.request.urlopen(f"{server.base_url}/models", timeout=30) as response:
        listing = json.loads(response.read())
    assert listing["data"][0]["id"] == "tiny-dense"
    assert listing["data"][0]["max_model_len"] == MAX_LEN
    root = server.base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/health", timeout=30) as response:
        assert json.loads(response.read())["ready"] is True


@pytest.mark.parametrize(
    ("change", "param"),
    [({"temperature": float("nan")}, "temperature"), ({"top_k": 100000}, "top_k")],
)
def test_the_issue_s_probes_are_refused_and_the_real_sampler_serves_on(served, change, param):
    """The requests that once failed in the sampler and broke the server for good (NaN, a
    top_k past the vocabulary) are 400s naming the field; the next request samples."""
    server, calls, _, _ = served
    chat = {"messages": [{"role": "user", "content": "2+2="}], "max_tokens": 3}
    status, text = _post(f"{server.base_url}/chat/completions", {**chat, **change})
    assert status == 400
    assert json.loads(text)["error"]["param"] == param
    assert calls == []
    status, body = _post(f"{server.base_url}/chat/completions", {**chat, "temperature": 0})
    assert status == 200, body
    assert 1 <= len(body["choices"][0]["message"]["generation_token_ids"]) <= 3
