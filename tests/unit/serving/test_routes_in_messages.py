"""policy.router_replay through NeMo-Gym: a chat completion's routes, which megatron-core's
endpoint puts beside each choice's message (``moe_topk_indices``), are also put in the message
as ``routed_experts``, where NeMo-Gym's model server reads them (serving/http_server.py)."""

from __future__ import annotations

import asyncio

from quart import Quart, jsonify

from nemo_rl_offload.serving.http_server import _routes_in_messages

ROUTES = [[[1, 2]], [[3, 4]]]


def _app(body: dict, status: int = 200) -> Quart:
    app = Quart(__name__)

    @app.route("/v1/chat/completions", methods=["POST"])
    async def chat():
        return jsonify(body), status

    app.after_request(_routes_in_messages)
    return app


def _post(app: Quart) -> dict:
    async def call() -> dict:
        response = await app.test_client().post("/v1/chat/completions", json={})
        return await response.get_json()

    return asyncio.run(call())


def test_each_choice_s_routes_go_into_its_message():
    body = {
        "choices": [
            {"index": 0, "message": {"content": "a"}, "moe_topk_indices": ROUTES},
            {"index": 1, "message": {"content": "b"}, "moe_topk_indices": None},
        ]
    }
    out = _post(_app(body))
    assert out["choices"][0]["message"]["routed_experts"] == ROUTES
    assert "routed_experts" not in out["choices"][1]["message"]
    assert out["choices"][0]["moe_topk_indices"] == ROUTES  # megatron-core's field stays


def test_responses_without_routes_and_errors_pass_as_they_are():
    plain = {"choices": [{"index": 0, "message": {"content": "a"}}]}
    assert _post(_app(plain)) == plain
    error = {"error": {"message": "bad"}, "choices": [{"moe_topk_indices": ROUTES, "message": {}}]}
    assert _post(_app(error, status=400)) == error
