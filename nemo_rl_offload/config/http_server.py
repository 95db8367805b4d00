"""``policy.generation.mcore_generation_config.expose_http_server``: the rules and the settings.

This module owns the decision of what is served and what is refused; the serving package
(:mod:`nemo_rl_offload.serving`) applies :class:`ServingSettings`. The keys read and what they
mean: docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_HOST",
    "MEGATRON_PARSERS",
    "OWN_PARSERS",
    "SERVING_ALGORITHMS",
    "VLLM_EQUIVALENTS",
    "ServingSettings",
    "api_key",
    "open_to_the_network",
    "parser_names",
    "problems",
    "serving_settings",
]

# The algorithms whose policy samples (SFT and DPO never generate).
SERVING_ALGORITHMS = ("grpo", "distillation")
# Where the server listens unless ``host`` says otherwise: this machine only (NeMo-Gym's servers
# of a run are on it too). "0.0.0.0" listens on every interface, for clients on other nodes.
DEFAULT_HOST = "127.0.0.1"
# The environment variable whose value, when set, is the key every request must bring
# (``Authorization: Bearer KEY``) unless ``api_key_env_var`` names another.
API_KEY_ENV = "NEMO_RL_OFFLOAD_API_KEY"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


# megatron-core 0.19's response parsers (its tokenizers.text.parsers.PARSER_MAPPING) and this
# backend's (serving/parsers.py): the names a recipe may give; tests/unit/serving/
# test_parsers.py keeps this list equal to the two registries.
MEGATRON_PARSERS = ("deepseek-r1-reasoning", "nemotron-v3-reasoning", "qwen3-coder-tool")
OWN_PARSERS = ("hermes-tool", "qwen3-reasoning")

# vLLM's parser names (NeMo-RL's vllm_cfg.http_server_serving_chat_kwargs) -> the parser
# served for them. nano_v3 is NeMo-RL's reasoning-parser plugin for Nemotron 3, which
# megatron-core's nemotron-v3 parser mirrors.
VLLM_EQUIVALENTS: dict[str, dict[str, str]] = {
    "reasoning_parser": {
        "deepseek_r1": "deepseek-r1-reasoning",
        "nano_v3": "nemotron-v3-reasoning",
        "qwen3": "qwen3-reasoning",
    },
    "tool_parser": {"qwen3_coder": "qwen3-coder-tool", "hermes": "hermes-tool"},
}


def parser_names() -> tuple[str, ...]:
    """The response parsers served: megatron-core's and this backend's."""
    return tuple(sorted({*MEGATRON_PARSERS, *OWN_PARSERS}))


@dataclass(frozen=True)
class ServingSettings:
    expose: bool = False
    parsers: tuple[str, ...] = ()
    port_range: tuple[int, int] | None = None  # [low, high); None: any free port
    # vLLM's server-side chat template and template arguments (NeMo-RL's vllm_cfg.
    # http_server_serving_chat_kwargs); a request's chat_template_kwargs win over the defaults.
    chat_template: str | None = None
    template_defaults: Mapping[str, Any] = field(default_factory=dict)
    host: str = DEFAULT_HOST
    # The environment variable holding the API key; ``api_key_named`` when the recipe named it
    # (then it must be set when the server starts).
    api_key_env_var: str = API_KEY_ENV
    api_key_named: bool = False
    # Where the settings came from, for messages.
    source: str = "policy.generation.mcore_generation_config"


# The generation backends whose vLLM settings NeMo-RL's HTTP server reads.
_VLLM_BACKENDS = ("vllm", "dynamo")
_CHAT_KWARGS = "http_server_serving_chat_kwargs"
_SERVED_CHAT_KWARGS = (
    "enable_auto_tools",
    "reasoning_parser",
    "tool_parser",
    "chat_template",
    "default_chat_template_kwargs",
)


def _generation(section: Mapping[str, Any]) -> Mapping[str, Any]:
    generation = section.get("generation")
    return generation if isinstance(generation, Mapping) else {}


def _sub(mapping: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = mapping.get(key)
    return value if isinstance(value, Mapping) else {}


def _uses_vllm_cfg(section: Mapping[str, Any]) -> bool:
    """NeMo-RL reads expose_http_server from the chosen backend's section: vllm_cfg for vLLM
    and Dynamo, mcore_generation_config for Megatron."""
    return _generation(section).get("backend") in _VLLM_BACKENDS


def _listener(section: Mapping[str, Any]) -> Mapping[str, Any]:
    """The chosen backend's section of the serving keys (vllm_cfg or mcore_generation_config)."""
    generation = _generation(section)
    key = "vllm_cfg" if _uses_vllm_cfg(section) else "mcore_generation_config"
    return _sub(generation, key)


def serving_settings(section: Mapping[str, Any]) -> ServingSettings:
    """The settings of a policy section that :func:`problems` passed."""
    generation = _generation(section)
    low, high = generation.get("port_range_low"), generation.get("port_range_high")
    port_range = (int(low), int(high)) if low is not None and high is not None else None
    listener = _listener(section)
    common: dict[str, Any] = {
        "port_range": port_range,
        "host": listener.get("host") or DEFAULT_HOST,
        "api_key_env_var": listener.get("api_key_env_var") or API_KEY_ENV,
        "api_key_named": listener.get("api_key_env_var") is not None,
    }
    if _uses_vllm_cfg(section):
        chat = _sub(listener, _CHAT_KWARGS)
        parsers = tuple(
            VLLM_EQUIVALENTS[kind][chat[kind]]
            for kind in ("reasoning_parser", "tool_parser")
            if chat.get(kind) is not None
        )
        return ServingSettings(
            expose=listener.get("expose_http_server") is True,
            parsers=parsers,
            chat_template=chat.get("chat_template"),
            template_defaults=dict(chat.get("default_chat_template_kwargs") or {}),
            source="policy.generation.vllm_cfg",
            **common,
        )
    return ServingSettings(
        expose=listener.get("expose_http_server") is True,
        parsers=tuple(listener.get("parsers") or ()),
        **common,
    )


def api_key(settings: ServingSettings, environ: Mapping[str, str]) -> str | None:
    """The key clients must send (None: none asked), from ``settings.api_key_env_var`` in
    ``environ``. Raises ValueError, naming the key, when the recipe named a variable that is
    unset or empty (a server meant to ask for a key must not start open)."""
    value = environ.get(settings.api_key_env_var) or None
    if value is None and settings.api_key_named:
        raise ValueError(
            f"{settings.source}.api_key_env_var: the environment variable "
            f"{settings.api_key_env_var} is not set; set it to the key clients send "
            "(Authorization: Bearer KEY), or remove api_key_env_var"
        )
    return value


def open_to_the_network(settings: ServingSettings, key: str | None) -> str | None:
    """A warning line when the server listens beyond this machine without a key."""
    if key is not None or settings.host in _LOOPBACK:
        return None
    return (
        f"warning: {settings.source}.host: {settings.host} listens beyond this machine and no "
        f"key is asked (set {settings.api_key_env_var}): anyone who reaches the port can sample "
        "from the policy"
    )


def _listener_problems(section: Mapping[str, Any], where: str) -> list[str]:
    listener = _listener(section)
    source = "vllm_cfg" if _uses_vllm_cfg(section) else "mcore_generation_config"
    key = f"{where}.generation.{source}"
    errors = []
    host = listener.get("host")
    if host is not None and (not isinstance(host, str) or not host or " " in host):
        errors.append(
            f"{key}.host: {host!r} is not an address to listen on; give one such as 127.0.0.1 "
            "(this machine only, the default) or 0.0.0.0 (every interface)"
        )
    env = listener.get("api_key_env_var")
    if env is not None and not (isinstance(env, str) and env.isidentifier()):
        errors.append(
            f"{key}.api_key_env_var: {env!r} is not an environment variable's name; give one "
            f"such as {API_KEY_ENV}"
        )
    return errors


def _vllm_problems(section: Mapping[str, Any], where: str) -> list[str]:
    vllm = _sub(_generation(section), "vllm_cfg")
    key = f"{where}.generation.vllm_cfg"
    errors = []
    expose = vllm.get("expose_http_server", False)
    if expose is not None and not isinstance(expose, bool):
        errors.append(f"{key}.expose_http_server: {expose!r} must be true or false")
    chat = vllm.get(_CHAT_KWARGS)
    if chat is None:
        return errors
    if not isinstance(chat, Mapping):
        return [*errors, f"{key}.{_CHAT_KWARGS}: {chat!r} must be a mapping"]
    for name, value in chat.items():
        where_key = f"{key}.{_CHAT_KWARGS}.{name}"
        if name in VLLM_EQUIVALENTS:
            if value is not None and value not in VLLM_EQUIVALENTS[name]:
                errors.append(
                    f"{where_key}: {value!r} is not served by this backend (its parsers for "
                    f"{name}: {sorted(VLLM_EQUIVALENTS[name])}); use one of them, or set "
                    "backend: megatron with mcore_generation_config.parsers"
                )
        elif name == "enable_auto_tools":
            if not isinstance(value, bool):
                errors.append(f"{where_key}: {value!r} must be true or false")
        elif name == "chat_template":
            if value is not None and not isinstance(value, str):
                errors.append(f"{where_key}: must be a Jinja template string")
        elif name == "default_chat_template_kwargs":
            if value is not None and not isinstance(value, Mapping):
                errors.append(f"{where_key}: {value!r} must be a mapping")
        else:
            errors.append(
                f"{where_key}: not implemented by this backend's HTTP server (it serves "
                f"{', '.join(_SERVED_CHAT_KWARGS)}); remove it"
            )
    return errors


def problems(
    section: Mapping[str, Any], where: str, algorithm: str | None
) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the serving keys of a policy section ``where``: the chosen
    backend's section (mcore_generation_config, or vllm_cfg for vLLM and Dynamo) and the
    port range."""
    errors: list[str] = []
    warnings: list[str] = []
    generation = _generation(section)
    mcore = _sub(generation, "mcore_generation_config")
    key = f"{where}.generation.mcore_generation_config"
    expose = mcore.get("expose_http_server", False)
    if expose is not None and not isinstance(expose, bool):
        errors.append(f"{key}.expose_http_server: {expose!r} must be true or false")
    parsers = mcore.get("parsers")
    if parsers is not None:
        known = parser_names()
        if not isinstance(parsers, list) or not all(isinstance(p, str) for p in parsers):
            errors.append(
                f"{key}.parsers: {parsers!r} must be a list of parser names (of {list(known)})"
            )
        else:
            for name in parsers:
                if name not in known:
                    errors.append(
                        f"{key}.parsers: {name!r} is not one of the response parsers "
                        f"{list(known)}; use one of them (or remove it)"
                    )
            if len(set(parsers)) != len(parsers):
                errors.append(f"{key}.parsers: {parsers!r} names a parser twice; name it once")
    if _uses_vllm_cfg(section):
        errors += _vllm_problems(section, where)
    errors += _listener_problems(section, where)
    low = generation.get("port_range_low")
    high = generation.get("port_range_high")
    g = f"{where}.generation"
    if (low is None) != (high is None):
        errors.append(
            f"{g}.port_range_low/high: give both ends of the port range or neither "
            f"(got low {low!r}, high {high!r})"
        )
    elif low is not None and not (
        isinstance(low, int) and isinstance(high, int) and 0 < low < high <= 65536
    ):
        errors.append(
            f"{g}.port_range_low/high: [{low!r}, {high!r}) is not a range of ports; give "
            "integers with 0 < low < high <= 65536"
        )
    if errors:
        return errors, warnings
    settings = serving_settings(section)
    if settings.expose and algorithm is not None and algorithm not in SERVING_ALGORITHMS:
        warnings.append(
            f"warning: {settings.source}.expose_http_server: {algorithm} never samples from "
            "the policy, so nothing is served (the HTTP server runs in grpo and distillation "
            "runs, and under nemo-rl-offload serve)"
        )
    return errors, warnings
