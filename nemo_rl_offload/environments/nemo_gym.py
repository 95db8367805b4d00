"""NeMo-Gym for a GRPO run (``env.should_use_nemo_gym``): its servers, and rollouts through its
agents against the policy's HTTP server.

NeMo-Gym runs as its own command (``gym env start``) under a Python that has it installed
(:func:`gym_python`), joined to the run's Ray cluster; rollouts are plain HTTP to its agents.
How this differs from NeMo-RL's Ray actor: docs/nemo_gym.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nemo_rl_offload.config.nemo_gym import GYM_PYTHON_ENV, gym_python
from nemo_rl_offload.config.safe_yaml import load_yaml
from nemo_rl_offload.errors import ServiceError, UserInputError

__all__ = ["GYM_PYTHON_ENV", "GymSettings", "NemoGymServers", "gym_python", "gym_settings"]


# env.nemo_gym entries that are NeMo-RL's, not NeMo-Gym's global configuration.
_NEMO_RL_KEYS = (
    "invalid_tool_call_patterns",
    "thinking_tags",
    "effort_levels",
    "pad_dynamic_image_shapes",
    "tokenizer_config",
    "require_routed_experts",
    "routed_experts_dtype",
    "use_fastokens",
    "num_gpu_nodes",
)
# What NeMo-Gym prints once every server answers (nemo_gym/cli/env.py, 0.4).
_READY_LINE = "servers ready!"
_START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class GymSettings:
    config_paths: tuple[str, ...]
    global_config: Mapping[str, Any]  # the rest of env.nemo_gym, for NeMo-Gym
    invalid_tool_call_patterns: tuple[str, ...] | None = None
    thinking_tags: tuple[str, ...] | None = None


def gym_settings(env_cfg: Mapping[str, Any]) -> GymSettings:
    """``env.nemo_gym`` split into NeMo-Gym's configuration and NeMo-RL's own entries."""
    section = dict((env_cfg or {}).get("nemo_gym") or {})
    paths = section.pop("config_paths", None) or []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths) or not paths:
        raise UserInputError(
            f"env.nemo_gym.config_paths: {paths!r} must list NeMo-Gym's server config files "
            "(e.g. responses_api_models/vllm_model/configs/vllm_model_for_training.yaml and a "
            "resources server's config)"
        )
    own = {key: section.pop(key) for key in _NEMO_RL_KEYS if key in section}
    patterns, tags = own.get("invalid_tool_call_patterns"), own.get("thinking_tags")
    return GymSettings(
        config_paths=tuple(paths),
        global_config=section,
        invalid_tool_call_patterns=tuple(patterns) if patterns else None,
        thinking_tags=tuple(tags) if tags else None,
    )


def _require_nemo_gym(python: str) -> None:
    """Refuse, in one line, a ``python`` that cannot import NeMo-Gym (before NeMo-Gym's own
    command would fail in its log)."""
    done = subprocess.run(
        [python, "-c", "import nemo_gym"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserInputError(
            f"{GYM_PYTHON_ENV}: {python} cannot import nemo_gym ({reason}); install nemo-gym "
            "into that environment (scripts/nemo-gym-venv makes one)"
        )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class NemoGymServers:
    """NeMo-Gym's servers for one run (:meth:`start` .. :meth:`stop`), and :meth:`run`."""

    def __init__(
        self,
        settings: GymSettings,
        *,
        policy_base_url: str,
        model_name: str,
        workdir: Path,
        ray_address: str | None = None,
        python: str | None = None,
        max_concurrent: int = 256,
        policy_api_key: str | None = None,
    ) -> None:
        self.settings = settings
        self._policy_base_url = policy_base_url
        # The key the policy's server asks for (None: it asks none; NeMo-Gym needs a value).
        self._policy_api_key = policy_api_key
        self._model_name = model_name
        self._workdir = Path(workdir)
        self._ray_address = ray_address
        self._python = python or gym_python()
        self._max_concurrent = max_concurrent
        self._process: subprocess.Popen | None = None
        self._log = self._workdir / "nemo_gym.log"
        self.head_url: str | None = None
        self.agents: dict[str, str] = {}

    # ------------------------------------------------------------------ servers
    def _global_config(self, head_port: int) -> dict[str, Any]:
        config = dict(self.settings.global_config)
        config.update(
            policy_model_name=self._model_name,
            policy_api_key=self._policy_api_key or "unused",
            policy_base_url=self._policy_base_url,
            head_server={"host": "127.0.0.1", "port": head_port},
        )
        if self._ray_address:
            config["ray_head_node_address"] = self._ray_address
        return config

    def start(self) -> NemoGymServers:
        """Start NeMo-Gym and return once every server answers."""
        self._workdir.mkdir(parents=True, exist_ok=True)
        _require_nemo_gym(self._python)
        head_port = _free_port()
        ours = self._workdir / "nemo_gym_run.yaml"
        ours.touch(mode=0o600)  # it may hold the policy server's key
        ours.chmod(0o600)  # (touch keeps an existing file's mode)
        ours.write_text(yaml.safe_dump(self._global_config(head_port), sort_keys=False))
        command = [
            self._python,
            "-c",
            "import sys; from nemo_gym.cli.main import main; sys.exit(main())",
            "env",
            "start",
        ]
        for path in (*self.settings.config_paths, str(ours)):
            command += ["--config", path]
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        # NeMo-Gym's environment's commands first (uv, which makes each server's venv).
        env["PATH"] = os.pathsep.join([str(Path(self._python).parent), env.get("PATH", "")])
        env.setdefault("RAY_AUTH_MODE", "token")  # the run's cluster takes a token
        with self._log.open("w") as sink:
            self._process = subprocess.Popen(
                command,
                # NeMo-Gym resolves config paths and server directories in the working
                # directory first (a user's own servers), then its install root (built-ins).
                cwd=Path.cwd(),
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # stop() ends its servers with it
            )
        self.head_url = f"http://127.0.0.1:{head_port}"
        deadline = time.monotonic() + _START_TIMEOUT_S
        while _READY_LINE not in self._log.read_text(errors="replace"):
            if self._process.poll() is not None:
                lines = self._log.read_text(errors="replace").strip().splitlines()
                raise ServiceError(
                    f"NeMo-Gym stopped while starting (exit {self._process.returncode}): "
                    f"{lines[-1] if lines else 'no output'}; its log: {self._log}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(
                    f"NeMo-Gym's servers were not all ready in {_START_TIMEOUT_S:g} s (NeMo-Gym "
                    f"0.4 prints 'N / N {_READY_LINE}' once they are); its log: {self._log}"
                )
            time.sleep(1)
        self.agents = self._agent_urls()
        return self

    def _agent_urls(self) -> dict[str, str]:
        """Each agent's URL by its top-level name (what data rows' ``agent_ref.name`` is)."""
        with urllib.request.urlopen(f"{self.head_url}/global_config_dict_yaml", timeout=60) as r:
            config = load_yaml(json.loads(r.read().decode()))
        agents = {}
        for name, entry in config.items():
            servers = entry.get("responses_api_agents") if isinstance(entry, Mapping) else None
            if isinstance(servers, Mapping) and servers:
                server = next(iter(servers.values()))
                agents[name] = f"http://{server['host']}:{server['port']}"
        return agents

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(30)

    # ------------------------------------------------------------------ rollouts
    def run(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Each row's result (its agent's ``/run`` answer), in order."""
        unknown = sorted(
            {str((row.get("agent_ref") or {}).get("name")) for row in rows} - set(self.agents)
        )
        if unknown:
            raise UserInputError(
                f"data: rows name agents {unknown} that env.nemo_gym.config_paths do not start "
                f"(started: {sorted(self.agents)}); fix the rows' agent_ref.name or the configs"
            )
        workers = max(1, min(self._max_concurrent, len(rows)))
        with concurrent.futures.ThreadPoolExecutor(workers, "nemo-gym-rollout") as pool:
            return list(pool.map(self._run_one, rows))

    def _run_one(self, row: Mapping[str, Any]) -> dict[str, Any]:
        url = f"{self.agents[row['agent_ref']['name']]}/run"
        request = urllib.request.Request(
            url, json.dumps(row).encode(), {"Content-Type": "application/json"}
        )
        name = row["agent_ref"]["name"]
        try:
            with urllib.request.urlopen(request, timeout=3600) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = " ".join(error.read().decode(errors="replace").split())[:500]
            raise ServiceError(
                f"NeMo-Gym agent {name} answered /run with HTTP {error.code}: {detail} (its "
                f"log: {self._log})"
            ) from None
        except (urllib.error.URLError, OSError) as error:
            raise ServiceError(
                f"NeMo-Gym agent {name} at {url} did not answer /run ({error}); its log: "
                f"{self._log}"
            ) from None
