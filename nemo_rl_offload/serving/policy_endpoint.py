"""Serve a run's policy workers (:class:`~nemo_rl_offload.policy.policy_group.PolicyGroup`)
over HTTP when the recipe exposes them (``config.http_server``): the one place a GRPO or
distillation run and ``nemo-rl-offload serve`` start the server."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from nemo_rl_offload.config import http_server
from nemo_rl_offload.config.generation_settings import SamplingSettings
from nemo_rl_offload.config.policy_settings import PolicySettings
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy.generation import Generated
from nemo_rl_offload.serving.http_server import PolicyServer
from nemo_rl_offload.serving.sampler_client import SamplerClient

__all__ = ["MAX_REQUESTS_PER_CALL", "serve_policy"]

# The most requests one sampler call takes; the sampler splits a call whose KV cache would not
# fit into chunks that do (policy.generation), so this bounds latency, not memory.
MAX_REQUESTS_PER_CALL = 1024


def _advertised_host(host: str) -> str:
    """The address clients are told: ``host`` itself, or for every interface ("0.0.0.0") the
    address other machines reach this one at (Ray's node address when Ray runs)."""
    if host not in ("0.0.0.0", "::"):
        return host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - Ray is a dependency
        pass
    return "127.0.0.1"


def _stopped(policy: Any) -> str | None:
    """Why ``policy``'s workers are stopped (a dead one looked up at most every second), or
    None while they can sample."""
    check = getattr(policy, "check_alive", None)
    return check() if check is not None else getattr(policy, "stopped", None)


def serve_policy(
    settings: PolicySettings,
    policy: Any,
    tokenizer: Any,
    *,
    seed: int,
    policy_epoch: Callable[[], int] = lambda: 0,
    force: bool = False,
    stop_token_ids: Sequence[int] | None = None,
) -> PolicyServer | None:
    """Start the server in front of ``policy`` when its ``settings`` expose it (always with
    ``force``: ``nemo-rl-offload serve``, NeMo-Gym); None otherwise. The caller stops it.
    ``stop_token_ids``: the stops besides end-of-sequence (default: the recipe's)."""
    serving = settings.serving
    if not (serving.expose or force):
        return None
    try:
        api_key = http_server.api_key(serving, os.environ)
    except ValueError as exc:
        raise UserInputError(str(exc)) from None
    warning = http_server.open_to_the_network(serving, api_key)
    if warning:
        print(warning, file=sys.stderr)
    pad_id = tokenizer.pad_id
    # policy.router_replay: each completion carries its routes (to NeMo-Gym, for the trainer).
    record_routes = settings.records_routes

    def generate(
        prompts: list[list[int]], sampling: SamplingSettings, seed: int
    ) -> list[Generated]:
        return policy.generate(
            prompts,
            sampling,
            seed=seed,
            pad_id=pad_id,
            record_routes=record_routes,
        )

    client = SamplerClient(
        generate,
        decode=tokenizer.decode,
        max_len=settings.max_total_sequence_length,
        eos_id=tokenizer.eos_id,
        stop_token_ids=(
            settings.generation.stop_token_ids if stop_token_ids is None else stop_token_ids
        ),
        vocab_limit=tokenizer.vocab_size,
        seed=seed,
        max_batch=MAX_REQUESTS_PER_CALL,
        policy_epoch=policy_epoch,
    )
    server = PolicyServer(
        client,
        tokenizer,
        model_name=settings.model_name,
        parsers=serving.parsers,
        chat_template=serving.chat_template,
        template_defaults=serving.template_defaults,
        host=serving.host,
        port_range=serving.port_range,
        advertised_host=_advertised_host(serving.host),
        api_key=api_key,
        # /health answers 503 once the workers are stopped (a worker died or hung)
        health=lambda: _stopped(policy),
    ).start()
    parsers = f" with parsers {', '.join(serving.parsers)}" if serving.parsers else ""
    key = f", key from {serving.api_key_env_var}" if api_key else ""
    print(
        f"policy: OpenAI-compatible endpoints at {server.base_url} (chat/completions, "
        f"completions, models){parsers}{key}",
        file=sys.stderr,
        flush=True,
    )
    return server
