"""megatron-core's OpenAI-compatible endpoints, served in this process in front of the sampler.

The endpoints are megatron-core's own blueprints, the ones NeMo-RL's Megatron backend serves;
this module adds ``/v1/models`` and :mod:`.request_guard` in front and runs the app on hypercorn
in a background thread. What is served, and how: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nemo_rl_offload.config.router_replay import ROUTES_KEY
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.serving import parsers as response_parsers
from nemo_rl_offload.serving import request_guard
from nemo_rl_offload.serving.request_bounds import Limits
from nemo_rl_offload.serving.sampler_client import SamplerClient

__all__ = ["PolicyServer", "ServingTokenizer", "bound_socket"]

_NEEDED_BLUEPRINTS = ("chat_completions_api", "completions_api")
_START_TIMEOUT_S = 60.0


class ServingTokenizer:
    """This backend's tokenizer with the names megatron-core's endpoints call; with the
    server's own ``chat_template`` (vLLM's ``--chat-template``) rendering chats instead of the
    tokenizer's, and ``template_defaults`` under each request's ``chat_template_kwargs``."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        template_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        from nemo_rl_offload.data.tokenizer import HFTokenizer

        if chat_template is not None and not isinstance(tokenizer, HFTokenizer):
            raise UserInputError(
                "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.chat_template: a "
                "server-side chat template needs a Hugging Face tokenizer; the byte tokenizer "
                "of the tiny presets has its own chat layout (remove chat_template)"
            )
        self._tokenizer = tokenizer
        self._template = chat_template
        self._defaults = dict(template_defaults or {})

    @property
    def chat_template(self) -> str | None:
        return self._template or getattr(self._tokenizer, "chat_template", None)

    @property
    def bos(self) -> int | None:
        return self._tokenizer.bos_id

    @property
    def eos_id(self) -> int:
        return self._tokenizer.eos_id

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.vocab_size)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        if not tokenize:
            raise ValueError("only tokenized chat templates are served")
        kwargs = {**self._defaults, **template_kwargs}
        if self._template is not None:
            kwargs["chat_template"] = self._template
        return self._tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special=False)


# megatron-core's chat endpoint puts a choice's routes (the sampler's experts of its prompt
# and generated tokens) beside its message; NeMo-Gym's model server reads them from the message,
# under this name (its TokenIDLogProbMixin), and hands them to the trainer with the tokens.
_MEGATRON_ROUTES = "moe_topk_indices"


async def _routes_in_messages(response: Any) -> Any:
    """A chat completion's routes also in each message as ``routed_experts`` (``policy.
    router_replay`` through NeMo-Gym); any other response as it is."""
    if response.status_code != 200 or response.mimetype != "application/json":
        return response
    body = await response.get_json()
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not any(
        isinstance(c, dict) and c.get(_MEGATRON_ROUTES) is not None for c in choices
    ):
        return response
    for choice in choices:
        message = choice.get("message")
        if isinstance(message, dict) and choice.get(_MEGATRON_ROUTES) is not None:
            message[ROUTES_KEY] = choice[_MEGATRON_ROUTES]
    response.set_data(json.dumps(body))
    return response


def _endpoint_blueprints() -> list[Any]:
    """megatron-core's endpoint blueprints this server registers (its profiling one is left
    out: it drives CUDA profiling of megatron-core's own engine)."""
    try:
        import quart  # noqa: F401  (the endpoints are defined only when it imports)
        from megatron.core.inference.text_generation_server.dynamic_text_gen_server import (
            endpoints,
        )
    except ImportError as exc:
        raise UserInputError(
            f"expose_http_server needs megatron-core's text generation server and its web "
            f"framework ({exc}); pip install quart hypercorn"
        ) from None
    by_name = {bp.name: bp for bp in endpoints.__all__}
    missing = [name for name in _NEEDED_BLUEPRINTS if name not in by_name]
    if missing:
        import megatron.core

        raise RuntimeError(
            f"megatron-core {megatron.core.__version__}'s text generation server lacks the "
            f"endpoints {missing} this backend serves (it was written against 0.19's "
            f"dynamic_text_gen_server.endpoints: {list(_NEEDED_BLUEPRINTS)})"
        )
    return [by_name[name] for name in _NEEDED_BLUEPRINTS]


def bound_socket(host: str, low: int | None = None, high: int | None = None) -> socket.socket:
    """A listening-ready socket bound on ``host`` at a free port in ``[low, high)`` (any free
    port without a range)."""
    ports: Sequence[int] = [0] if low is None or high is None else range(int(low), int(high))
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            continue
        return sock
    raise UserInputError(
        f"policy.generation.port_range_low/high: no free port in [{low}, {high}) on {host}; "
        "widen the range or free a port"
    )


class PolicyServer:
    """The endpoints on ``host`` (a free port, within ``port_range`` when given) until
    :meth:`stop`. ``model_name`` is what ``/v1/models`` lists; ``parsers`` are megatron-core's
    parser names (``mcore_generation_config.parsers``); ``api_key``, when given, is asked of
    every request but ``/health``; ``health()`` is None while the policy can sample, else why
    not (``/health`` answers 503 then)."""

    def __init__(
        self,
        client: SamplerClient,
        tokenizer: Any,
        *,
        model_name: str,
        parsers: Sequence[str] = (),
        chat_template: str | None = None,
        template_defaults: Mapping[str, Any] | None = None,
        host: str = "127.0.0.1",
        port_range: tuple[int, int] | None = None,
        advertised_host: str | None = None,
        api_key: str | None = None,
        health: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.client = client
        self._tokenizer = ServingTokenizer(
            tokenizer, chat_template=chat_template, template_defaults=template_defaults
        )
        self.model_name = model_name
        self.parsers = list(parsers)
        self._host = host
        self._advertised = advertised_host or ("127.0.0.1" if host == "0.0.0.0" else host)
        self._port_range = port_range
        self.api_key = api_key or None
        self.health = health
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as ``base_url`` (NeMo-Gym's ``policy_base_url``)."""
        if self.port is None:
            raise RuntimeError("the server has not started")
        return f"http://{self._advertised}:{self.port}/v1"

    def _app(self) -> Any:
        from quart import Blueprint, Quart, jsonify

        app = Quart("nemo_rl_offload.serving")
        app.config["MAX_CONTENT_LENGTH"] = 2**30  # long prompts (megatron-core's limit too)
        app.config["client"] = self.client
        app.config["tokenizer"] = self._tokenizer
        app.config["parsers"] = self.parsers
        app.config["verbose"] = False
        response_parsers.register()
        for blueprint in _endpoint_blueprints():
            app.register_blueprint(blueprint)
        models = Blueprint("models_api", __name__)
        listing = {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "owned_by": "nemo_rl_offload",
                    "max_model_len": self.client.max_len,
                }
            ],
        }

        @models.route("/v1/models", methods=["GET"])
        async def list_models() -> Any:
            return jsonify(listing)

        app.register_blueprint(models)
        request_guard.install(
            app,
            limits=Limits(max_len=self.client.max_len, vocab_size=self._tokenizer.vocab_size),
            api_key=self.api_key,
            health=self.health,
        )

        @app.after_request
        async def routes_for_nemo_gym(response: Any) -> Any:
            return await _routes_in_messages(response)

        return app

    def start(self) -> PolicyServer:
        """Bind, serve in a background thread, and return once requests are accepted."""
        if self._thread is not None:
            raise RuntimeError("the server is already running")
        app = self._app()
        low, high = self._port_range or (None, None)
        sock = bound_socket(self._host, low, high)
        # Listening now, so that a request sent as soon as start() returns waits in the
        # backlog rather than being refused while hypercorn is still setting up.
        sock.listen(1024)
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._serve, args=(app, sock), name="policy-http-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._ready.wait(0.05):
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the policy's HTTP server did not start: {self._error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the policy's HTTP server did not start in {_START_TIMEOUT_S}s")
        return self

    def _serve(self, app: Any, sock: socket.socket) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        config = Config()
        # hypercorn owns the descriptor from here (it closes it when serving ends).
        config.bind = [f"fd://{sock.detach()}"]
        config.keep_alive_timeout = 30.0  # agents hold connections across long generations
        # A step's rollouts connect at once: with hypercorn's default backlog (100) the rest of
        # a burst is dropped and retried a second later (megatron-core's server sets it so too).
        config.backlog = 2**14
        config.accesslog = None
        config.errorlog = None

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._shutdown = asyncio.Event()

            @app.before_serving
            async def ready() -> None:
                self._ready.set()

            await serve(app, config, shutdown_trigger=self._shutdown.wait)

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by start() or stop()
            self._error = exc
        finally:
            self.client.stop()

    def stop(self) -> None:
        """Stop serving (requests in flight are dropped) and wait for the thread."""
        if self._thread is None:
            return
        if self._loop is not None and self._shutdown is not None:
            self._loop.call_soon_threadsafe(self._shutdown.set)
        self._thread.join(timeout=30)
        self._thread = None

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
