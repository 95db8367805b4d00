"""The policy's HTTP server survives its clients: every bad field is a 400 naming it (before any
sampling), a failing sampler call fails its own request only, a server whose workers stopped
says so on /health, errors are OpenAI's JSON without exception text, the key is asked when set,
and the server listens on 127.0.0.1 unless told otherwise. One server over a stub sampler (it
starts in well under a second) serves the module; requests go over loopback."""

from __future__ import annotations

import json
import math
import random
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from support.policies import make_policy

from nemo_rl_offload.config import http_server
from nemo_rl_offload.config.generation_settings import SamplingSettings
from nemo_rl_offload.data.tokenizer import ByteTokenizer
from nemo_rl_offload.policy.generation import Generated
from nemo_rl_offload.preflight import resolve_policy
from nemo_rl_offload.serving.http_server import PolicyServer
from nemo_rl_offload.serving.policy_endpoint import serve_policy
from nemo_rl_offload.serving.request_guard import SERVER_ERROR_MESSAGE
from nemo_rl_offload.serving.sampler_client import SamplerClient

MAX_LEN = 64
TOKENIZER = ByteTokenizer()
VOCAB = TOKENIZER.vocab_size
# A prompt holding this token makes the stub sampler raise, as a worker's error would.
POISON = 200
CHAT = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 3}
COMPLETION = {"prompt": "1+2=", "max_tokens": 3}
# Words of a worker's error that must never reach a client.
LEAKS = ("Traceback", ".py", "RuntimeError", "ValueError", "poisoned", "Exception")


class Sampler:
    """The stub policy: one end-of-sequence token per prompt; raises for a poisoned prompt or
    while ``fail`` is set; records each call's prompts."""

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []
        self.fail = False
        self.stopped: str | None = None

    def __call__(self, prompts: list[list[int]], settings: SamplingSettings, seed: int) -> list:
        self.calls.append(prompts)
        if self.fail or any(POISON in p for p in prompts):
            raise RuntimeError("poisoned batch (at model.py:12 in forward)")
        return [Generated([TOKENIZER.eos_id], [-0.5]) for _ in prompts]


def _client(sampler: Sampler) -> SamplerClient:
    return SamplerClient(
        sampler,
        decode=TOKENIZER.decode,
        max_len=MAX_LEN,
        eos_id=TOKENIZER.eos_id,
        vocab_limit=VOCAB,
        max_batch=8,
    )


@pytest.fixture(scope="module")
def served():
    sampler = Sampler()
    server = PolicyServer(
        _client(sampler), TOKENIZER, model_name="stub", health=lambda: sampler.stopped
    )
    with server:
        yield server, sampler


@pytest.fixture
def fresh(served):
    server, sampler = served
    sampler.calls.clear()
    sampler.fail, sampler.stopped = False, None
    return server, sampler


def _send(
    url: str,
    data: bytes | None = None,
    *,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
    timeout: float = 10,
) -> tuple[int, str, Any]:
    """(status, content type, body: parsed JSON or text)."""
    sent = dict(headers or {})
    if data is not None:
        sent["Content-Type"] = content_type
    request = urllib.request.Request(url, data, sent)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, kind, raw = (
                response.status,
                response.headers.get_content_type(),
                response.read(),
            )
    except urllib.error.HTTPError as error:
        status, kind, raw = error.code, error.headers.get_content_type(), error.read()
    text = raw.decode(errors="replace")
    return status, kind, json.loads(text) if kind == "application/json" else text


def _post(server: PolicyServer, path: str, body: Any, **kwargs: Any) -> tuple[int, str, Any]:
    return _send(f"{server.base_url}{path}", json.dumps(body).encode(), **kwargs)


def _assert_json_error(status: int, kind: str, body: Any, expected_status: int) -> dict:
    assert status == expected_status, body
    assert kind == "application/json", body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert not any(leak in error["message"] for leak in LEAKS), error
    return error


def _serves(server: PolicyServer) -> None:
    status, _, body = _post(server, "/chat/completions", CHAT)
    assert status == 200, body
    assert body["choices"][0]["message"]["generation_token_ids"] == [TOKENIZER.eos_id]


BAD_FIELDS = [
    ("/chat/completions", {"temperature": math.nan}, "temperature"),
    ("/chat/completions", {"temperature": math.inf}, "temperature"),
    ("/chat/completions", {"temperature": -1}, "temperature"),
    ("/chat/completions", {"temperature": 1e-30}, "temperature"),
    ("/chat/completions", {"temperature": "hot"}, "temperature"),
    ("/chat/completions", {"top_p": 5}, "top_p"),
    ("/chat/completions", {"top_p": 0}, "top_p"),
    ("/chat/completions", {"top_p": -math.inf}, "top_p"),
    ("/chat/completions", {"top_k": 100000}, "top_k"),
    ("/chat/completions", {"top_k": -2}, "top_k"),
    ("/chat/completions", {"top_k": 2.5}, "top_k"),
    ("/chat/completions", {"top_k": True}, "top_k"),
    ("/chat/completions", {"n": -3}, "n"),
    ("/chat/completions", {"n": 0}, "n"),
    ("/chat/completions", {"n": 10**6}, "n"),
    ("/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/chat/completions", {"max_tokens": 10**30}, "max_tokens"),
    ("/chat/completions", {"max_tokens": "many"}, "max_tokens"),
    ("/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens"),
    ("/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/chat/completions", {"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": -1}, "top_logprobs"),
    ("/chat/completions", {"seed": 1.5}, "seed"),
    ("/chat/completions", {"seed": 2**70}, "seed"),
    ("/chat/completions", {"stop": ["\n"]}, "stop"),
    ("/chat/completions", {"stop": "x"}, "stop"),
    ("/chat/completions", {"stop": [1]}, "stop"),
    ("/chat/completions", {"stream": True}, "stream"),
    ("/chat/completions", {"ignore_eos": "no"}, "ignore_eos"),
    ("/chat/completions", {"messages": []}, "messages"),
    ("/chat/completions", {"messages": "hi"}, "messages"),
    ("/chat/completions", {"messages": [1]}, "messages"),
    ("/chat/completions", {"messages": [{"role": "king", "content": "x"}]}, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (
        "/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "content": "b",
                    "prompt_token_ids": [1, 10**9],
                    "generation_token_ids": [2],
                },
                {"role": "user", "content": "c"},
            ]
        },
        "messages",
    ),
    ("/chat/completions", {"tools": "all"}, "tools"),
    ("/chat/completions", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/chat/completions", {"model": 7}, "model"),
    ("/completions", {"prompt": ""}, "prompt"),
    ("/completions", {"prompt": [VOCAB]}, "prompt"),
    ("/completions", {"prompt": [[1, -1]]}, "prompt"),
    ("/completions", {"prompt": [[]]}, "prompt"),
    ("/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/completions", {"prompt": None}, "prompt"),
    ("/completions", {"prompt": ["a"] * 2000}, "prompt"),
    ("/completions", {"n": 2}, "n"),
    ("/completions", {"logprobs": 3}, "logprobs"),
    ("/completions", {"echo": 1}, "echo"),
    ("/completions", {"echo": True, "logprobs": 0}, "echo"),
    ("/completions", {"temperature": math.nan}, "temperature"),
    ("/completions", {"stop": ["\n"]}, "stop"),
]


@pytest.mark.parametrize(("path", "change", "param"), BAD_FIELDS)
def test_each_bad_field_is_a_400_naming_it_and_the_next_request_is_served(
    fresh, path, change, param
):
    server, sampler = fresh
    base = CHAT if path == "/chat/completions" else COMPLETION
    error = _assert_json_error(*_post(server, path, {**base, **change}), 400)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert sampler.calls == []  # refused before any sampling
    _serves(server)


def test_an_over_long_prompt_is_megatron_core_s_context_length_error(fresh):
    """What only the sampler client knows (the prompt's length after the chat template) is
    refused there, in the wording NeMo-Gym's model server reads as a finish by length."""
    server, sampler = fresh
    error = _assert_json_error(*_post(server, "/chat/completions", {**CHAT, "max_tokens": 60}), 400)
    assert "maximum context length" in error["message"]
    assert error["code"] == "context_length_exceeded"
    assert sampler.calls == []


def test_a_body_that_is_not_a_json_object_is_refused(fresh):
    server, sampler = fresh
    for path in ("/chat/completions", "/completions"):
        url = f"{server.base_url}{path}"
        _assert_json_error(*_send(url, b"[1, 2]"), 400)
        _assert_json_error(*_send(url, b'"text"'), 400)
        _assert_json_error(*_send(url, b"{not json"), 400)
        _assert_json_error(*_send(url, b"[" * 100_000), 400)
        error = _assert_json_error(*_send(url, b'{"prompt": "x"}', content_type="text/plain"), 415)
        assert "application/json" in error["message"]
    assert sampler.calls == []
    _assert_json_error(*_send(f"{server.base_url}/nothing"), 404)
    _serves(server)


def test_a_failing_sampler_call_fails_its_request_only(fresh):
    server, sampler = fresh
    sampler.fail = True
    error = _assert_json_error(*_post(server, "/chat/completions", CHAT), 500)
    assert error == {
        "message": SERVER_ERROR_MESSAGE,
        "type": "server_error",
        "param": None,
        "code": None,
    }
    sampler.fail = False
    _serves(server)


def test_a_poisoned_request_batched_with_others_fails_alone(fresh):
    """Requests of one burst share a sampler call: when it raises, each is sampled alone, so
    only the request the sampler cannot take fails."""
    server, sampler = fresh
    results: dict[int, tuple] = {}
    prompts = {0: [5, 6, 7], 1: [5, POISON, 7], 2: [8, 9]}

    def ask(index: int) -> None:
        body = {"prompt": prompts[index], "max_tokens": 2}
        results[index] = _post(server, "/completions", body)

    threads = [threading.Thread(target=ask, args=(i,)) for i in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results[0][0] == 200 and results[2][0] == 200, results
    _assert_json_error(*results[1], 500)
    _serves(server)


def test_stopped_workers_make_health_503_and_generation_refused(fresh):
    server, sampler = fresh
    root = server.base_url.removesuffix("/v1")
    status, _, body = _send(f"{root}/health")
    assert status == 200 and body["ready"] is True
    sampler.stopped = "policy worker 1 failed: the worker process died"
    status, _, body = _send(f"{root}/health")
    assert status == 503 and body["ready"] is False and body["status"] == "error"
    assert "died" not in json.dumps(body)  # why is in the server's log
    error = _assert_json_error(*_post(server, "/chat/completions", CHAT), 503)
    assert error["type"] == "server_error"
    assert sampler.calls == []


def test_the_api_key_is_asked_when_set():
    sampler = Sampler()
    with PolicyServer(_client(sampler), TOKENIZER, model_name="stub", api_key="s3cret") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            error = _assert_json_error(
                *_post(server, "/chat/completions", CHAT, headers=headers), 401
            )
            assert error["code"] == "invalid_api_key"
            _assert_json_error(*_send(f"{server.base_url}/models", headers=headers), 401)
        assert sampler.calls == []
        good = {"Authorization": "Bearer s3cret"}
        status, _, body = _post(server, "/chat/completions", CHAT, headers=good)
        assert status == 200, body
        status, _, _ = _send(f"{server.base_url}/models", headers=good)
        assert status == 200
        status, _, _ = _send(f"{server.base_url.removesuffix('/v1')}/health")  # open
        assert status == 200


class _Policy:
    """A policy group's face to serve_policy: generate, and why its workers stopped."""

    stopped: str | None = None

    def generate(self, prompts, settings, *, seed, pad_id, record_routes=False):
        return [Generated([TOKENIZER.eos_id], [-0.5]) for _ in prompts]


POLICY_CFG = {**make_policy("tiny-dense"), "max_total_sequence_length": MAX_LEN}


def test_a_recipe_s_server_listens_on_loopback_with_the_key_of_its_environment(monkeypatch):
    settings = resolve_policy(POLICY_CFG)
    assert settings.serving.host == "127.0.0.1"
    monkeypatch.setenv(http_server.API_KEY_ENV, "from-env")
    policy = _Policy()
    server = serve_policy(settings, policy, TOKENIZER, seed=0, force=True)
    try:
        assert server.base_url.startswith("http://127.0.0.1:")
        assert server.api_key == "from-env"
        _assert_json_error(*_post(server, "/chat/completions", CHAT), 401)
        auth = {"Authorization": "Bearer from-env"}
        assert _post(server, "/chat/completions", CHAT, headers=auth)[0] == 200
        policy.stopped = "shut down"
        assert _send(f"{server.base_url.removesuffix('/v1')}/health")[0] == 503
    finally:
        server.stop()


def test_the_listener_settings_are_checked():
    section = {
        "generation": {"mcore_generation_config": {"host": "0.0.0.0", "api_key_env_var": "MY_KEY"}}
    }
    settings = http_server.serving_settings(section)
    assert (settings.host, settings.api_key_env_var) == ("0.0.0.0", "MY_KEY")
    with pytest.raises(ValueError, match="MY_KEY is not set"):
        http_server.api_key(settings, {})
    assert http_server.api_key(settings, {"MY_KEY": "k"}) == "k"
    assert "anyone who reaches" in http_server.open_to_the_network(settings, None)
    assert http_server.open_to_the_network(settings, "k") is None
    bad = {"generation": {"mcore_generation_config": {"host": 5, "api_key_env_var": "no-dash"}}}
    errors, _ = http_server.problems(bad, "policy", "grpo")
    assert [line.split(":")[0] for line in errors] == [
        "policy.generation.mcore_generation_config.host",
        "policy.generation.mcore_generation_config.api_key_env_var",
    ]


# ------------------------------------------------------------------------- adversarial
_JUNK = [
    math.nan,
    math.inf,
    -math.inf,
    -(10**30),
    10**30,
    "x" * 300,
    "",
    [],
    {},
    [[[]]],
    {"a": {"b": [1, None, {"c": math.nan}]}},
    [None] * 50,
]
# Per field: values that are never valid there (the junk above is filtered per field).
_VALID = {
    "temperature": lambda v: isinstance(v, float) and math.isfinite(v) and v >= 0,
    "top_p": lambda v: False,
    "top_k": lambda v: False,
    "n": lambda v: False,
    "max_tokens": lambda v: False,
    "seed": lambda v: False,
    "logprobs": lambda v: False,
    "stream": lambda v: False,
    "ignore_eos": lambda v: False,
    "stop": lambda v: v in ("", []),
    "tools": lambda v: v == [],
    "chat_template_kwargs": lambda v: isinstance(v, dict),
}


def _bad_payloads(seed: int, count: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    payloads: list[tuple[str, bytes]] = []
    while len(payloads) < count:
        path = rng.choice(("/chat/completions", "/completions"))
        body: Any = dict(CHAT if path == "/chat/completions" else COMPLETION)
        kind = rng.randrange(5)
        if kind == 0:  # a field of the wrong type or out of range
            field = rng.choice(sorted(_VALID))
            value = rng.choice(_JUNK)
            if _VALID[field](value):
                continue
            body[field] = value
        elif kind == 1:  # the prompt missing or junk
            key = "messages" if path == "/chat/completions" else "prompt"
            if rng.random() < 0.5:
                del body[key]
            else:
                body[key] = rng.choice([v for v in _JUNK if v != "x" * 300])
        elif kind == 2:  # junk in a message
            role, content = rng.choice(["user", 3, None, "x"]), rng.choice(_JUNK)
            fine = isinstance(content, str) or (
                isinstance(content, list) and all(isinstance(p, str | dict) for p in content)
            )
            if role == "user" and fine:
                continue
            path, body = (
                "/chat/completions",
                {**CHAT, "messages": [{"role": role, "content": content}]},
            )
        elif kind == 3:  # not an object at all
            body = rng.choice([[body], "text", 3, None, [[]], [math.nan]])
        else:  # several bad fields at once, with unknown ones beside
            body.update(
                {
                    "temperature": -rng.random() - 0.1,
                    "top_p": 1 + rng.random(),
                    "zzz": rng.choice(_JUNK),
                }
            )
        payloads.append((path, json.dumps(body).encode()))
    return payloads


def test_a_hundred_bad_payloads_are_each_a_json_4xx_and_the_server_still_serves(fresh):
    server, sampler = fresh
    for path, data in _bad_payloads(seed=45, count=100):
        status, kind, body = _send(f"{server.base_url}{path}", data, timeout=10)
        assert 400 <= status < 500, (data[:200], body)
        _assert_json_error(status, kind, body, status)
    assert sampler.calls == []
    _serves(server)


class _PickyTokenizer(ByteTokenizer):
    """A chat template that cannot render one message (as a model's Jinja template raises)."""

    def apply_chat_template(self, messages, **kwargs):
        if any(m.get("content") == "unrenderable" for m in messages):
            raise TypeError("can only concatenate str (at template.jinja:3)")
        return super().apply_chat_template(messages, **kwargs)


def test_messages_the_template_cannot_render_are_a_400_naming_messages():
    sampler = Sampler()
    with PolicyServer(_client(sampler), _PickyTokenizer(), model_name="stub") as server:
        bad = {**CHAT, "messages": [{"role": "user", "content": "unrenderable"}]}
        error = _assert_json_error(*_post(server, "/chat/completions", bad), 400)
        assert error["param"] == "messages"
        _serves(server)
