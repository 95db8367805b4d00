"""NeMo-Gym's servers for a run: how ``env.nemo_gym`` splits, which Python runs NeMo-Gym, and
what a failing agent looks like (one line naming it and NeMo-Gym's log). The servers
themselves run in tests/functional/test_nemo_gym_cpu.py."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

from nemo_rl_offload.config.nemo_gym import GYM_PYTHON_ENV, gym_python
from nemo_rl_offload.environments import nemo_gym
from nemo_rl_offload.errors import ServiceError, UserInputError


def test_env_nemo_gym_splits_into_nemo_gyms_config_and_nemo_rls_entries():
    settings = nemo_gym.gym_settings(
        {
            "nemo_gym": {
                "config_paths": ["a.yaml", "b.yaml"],
                "invalid_tool_call_patterns": ["[TOOL]"],
                "thinking_tags": ["<t>", "</t>"],
                "num_gpu_nodes": 5,
                "port_range_low": 5000,
                "port_range_high": 5999,
                "math_with_judge": {"resources_servers": {"x": {"should_use_judge": False}}},
            }
        }
    )
    assert settings.config_paths == ("a.yaml", "b.yaml")
    assert settings.invalid_tool_call_patterns == ("[TOOL]",)
    assert settings.thinking_tags == ("<t>", "</t>")
    # NeMo-Gym gets its own keys, not NeMo-RL's
    assert set(settings.global_config) == {"port_range_low", "port_range_high", "math_with_judge"}
    with pytest.raises(UserInputError, match="env.nemo_gym.config_paths"):
        nemo_gym.gym_settings({"nemo_gym": {}})


def test_a_python_without_nemo_gym_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_gym", None)
    monkeypatch.delenv(GYM_PYTHON_ENV, raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(UserInputError, match="no Python with NeMo-Gym found"):
        gym_python()
    monkeypatch.setenv(GYM_PYTHON_ENV, sys.executable)
    assert gym_python() == sys.executable
    if sys.modules.get("nemo_gym") is None:  # this environment has no NeMo-Gym
        with pytest.raises(UserInputError, match="cannot import nemo_gym"):
            nemo_gym._require_nemo_gym(sys.executable)


class _Agent(http.server.BaseHTTPRequestHandler):
    """An agent's /run that fails as a broken environment does."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"detail": "the resources server is down"}).encode()
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_failing_agent_is_one_line_naming_it_and_the_log(tmp_path: Path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        gym = nemo_gym.NemoGymServers(
            nemo_gym.gym_settings({"nemo_gym": {"config_paths": ["a.yaml"]}}),
            policy_base_url="http://unused/v1",
            model_name="m",
            workdir=tmp_path,
            python=sys.executable,
        )
        gym.agents = {"agent": f"http://127.0.0.1:{server.server_address[1]}"}
        row = {"responses_create_params": {"input": []}, "agent_ref": {"name": "agent"}}
        with pytest.raises(ServiceError) as info:
            gym.run([row])
        message = str(info.value)
        assert "agent answered /run with HTTP 500" in message
        assert "the resources server is down" in message and str(tmp_path) in message
        with pytest.raises(UserInputError, match=r"rows name agents \['other'\]"):
            gym.run([{**row, "agent_ref": {"name": "other"}}])
    finally:
        server.shutdown()


def test_the_policy_server_s_key_goes_to_nemo_gym_s_model_servers(tmp_path: Path):
    """NeMo-Gym's model servers send policy_api_key to the policy's server as its bearer key."""

    def config(**kwargs: object) -> dict:
        gym = nemo_gym.NemoGymServers(
            nemo_gym.gym_settings({"nemo_gym": {"config_paths": ["a.yaml"]}}),
            policy_base_url="http://127.0.0.1:1/v1",
            model_name="m",
            workdir=tmp_path,
            python=sys.executable,
            **kwargs,
        )
        return gym._global_config(head_port=2)

    assert config(policy_api_key="s3cret")["policy_api_key"] == "s3cret"
    assert config()["policy_api_key"] == "unused"  # NeMo-Gym needs a value; none is asked
