"""The policy server's front door: the API key, the body's checks, and every error as OpenAI's
JSON error object.

megatron-core's endpoints trust their input (see :mod:`.request_bounds`) and answer errors as
plain text, some with the exception's text; an unhandled exception is a bare 500. Here, before
an endpoint runs: a key is asked for (``Authorization: Bearer KEY``, as vLLM's ``--api-key``)
when one is set, the body must be JSON (415 otherwise) and an object whose every field is within
its bounds (400 naming the field), and generation is refused with 503 while the policy's workers
are down. After it: an error the endpoint wrote as text becomes the JSON error object; a server
error (5xx) is logged here in full and answered with a generic message, so that no exception
type, source line or worker detail reaches a client.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from nemo_rl_offload.serving.request_bounds import (
    InvalidRequest,
    Limits,
    check_chat,
    check_completion,
    error_body,
)

__all__ = ["HEALTH_PATHS", "SERVER_ERROR_MESSAGE", "install"]

_LOG = logging.getLogger("nemo_rl_offload.serving")

HEALTH_PATHS = ("/health", "/v1/health")
SERVER_ERROR_MESSAGE = "the server failed to serve this request (its log has the details)"
_CHECKS: dict[str, Callable[[Any, Limits], None]] = {
    "/v1/chat/completions": check_chat,
    "/chat/completions": check_chat,
    "/v1/completions": check_completion,
    "/completions": check_completion,
}
# megatron-core's chat endpoint answers a chat its template cannot render with 500 and this.
_TEMPLATE_FAILED = "Error processing 'messages'"
# A client's field named at the start of a refusal (the sampler client's messages, as
# megatron-core's endpoints relay them: "Inference request(s) failed: Request 0: FIELD: ...").
_NAMED_FIELD = re.compile(r"(?:^|Request \d+: )([a-z_]+): ")
_FIELDS = ("max_tokens", "top_logprobs", "logprobs", "stop", "prompt", "messages", "echo")


def _json_error(status: int, message: str, **fields: Any) -> Any:
    from quart import jsonify

    kind = "invalid_request_error" if status < 500 else "server_error"
    response = jsonify(error_body(message, kind=kind, **fields))
    response.status_code = status
    return response


def _authorized(header: str | None, key: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _named_field(message: str) -> str | None:
    found = _NAMED_FIELD.search(message)
    return found.group(1) if found and found.group(1) in _FIELDS else None


async def _as_json_error(response: Any) -> Any:
    """An error response of megatron-core's (text) or Quart's (HTML) as the JSON error object;
    anything else as it is."""
    if response.status_code < 400 or response.mimetype == "application/json":
        return response
    status = response.status_code
    text = (await response.get_data(as_text=True)).strip()
    if status >= 500:
        if text.startswith(_TEMPLATE_FAILED):  # the client's messages (logged by megatron-core)
            return _json_error(
                400, "messages: the chat template could not render them", param="messages"
            )
        _LOG.error("request failed with %d: %s", status, text)
        return _json_error(status, SERVER_ERROR_MESSAGE)
    if not text or text.startswith("<"):  # a page (megatron-core's text is sent as text/html)
        return _json_error(status, HTTPStatus(status).phrase)
    code = "context_length_exceeded" if "maximum context length" in text else None
    return _json_error(status, text, param=_named_field(text), code=code)


def install(
    app: Any, *, limits: Limits, api_key: str | None, health: Callable[[], str | None]
) -> None:
    """Guard ``app``'s requests. ``health()`` is None while the policy serves, else why not."""
    from quart import request
    from werkzeug.exceptions import HTTPException

    @app.before_request
    async def guard() -> Any:
        if (
            api_key
            and request.path not in HEALTH_PATHS
            and not _authorized(request.headers.get("Authorization"), api_key)
        ):
            return _json_error(
                401,
                "a valid API key is needed: send the header Authorization: Bearer KEY",
                code="invalid_api_key",
            )
        check = _CHECKS.get(request.path)
        if check is None or request.method != "POST":
            return None
        problem = health()
        if problem is not None:
            return _json_error(503, "the policy is not available (its workers have stopped)")
        if not request.is_json:
            return _json_error(
                415,
                f"Content-Type {(request.mimetype or '(none)')[:60]!r} is not served; send "
                "the body as application/json",
            )
        # cached: the endpoint reads the same bytes again
        data = await request.get_data(cache=True, as_text=False)
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            return _json_error(400, "the request body is not valid JSON")
        try:
            check(body, limits)
        except InvalidRequest as refused:
            return _json_error(refused.status, refused.message, param=refused.param)
        return None

    @app.after_request
    async def json_errors(response: Any) -> Any:
        return await _as_json_error(response)

    @app.errorhandler(Exception)
    async def failed(error: Exception) -> Any:
        if isinstance(error, HTTPException) and error.code is not None:
            return _json_error(error.code, HTTPStatus(error.code).phrase)
        _LOG.exception("request %s %s failed", request.method, request.path)
        return _json_error(500, SERVER_ERROR_MESSAGE)

    @app.route("/health", methods=["GET"])
    @app.route("/v1/health", methods=["GET"])
    async def health_check() -> Any:
        from quart import jsonify

        problem = health()
        status = {"status": "ok", "service": "nemo_rl_offload policy server", "ready": True}
        if problem is None:
            return jsonify(status)
        # why is in the server's log (the worker's error); a client learns only that it is down
        status.update(status="error", ready=False, details="the policy's workers have stopped")
        return jsonify(status), 503
