"""``nemo-rl-offload serve`` as a user runs it: the tiny GRPO recipe's two CPU workers behind
the OpenAI-compatible endpoints, asked by a client (with the key of the server's environment;
a bad request refused without harm to the next), stopped with Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "configs" / "tiny" / "grpo.yaml"
KEY = "functional-test-key"


def _post(url: str, body: dict[str, Any], key: str | None = KEY) -> Any:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _refused(url: str, body: dict[str, Any], key: str | None = KEY) -> tuple[int, dict]:
    try:
        _post(url, body, key)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    raise AssertionError(f"{body} was served")


def test_serve_answers_clients_until_interrupted(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nemo_rl_offload.cli",
                "serve",
                "--config",
                str(RECIPE),
                "policy.init_checkpoint=null",
                "++policy.generation.port_range_low=25000",
                "++policy.generation.port_range_high=26000",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO), "NEMO_RL_OFFLOAD_API_KEY": KEY},
        )
    try:
        deadline = time.monotonic() + 240
        url = None
        while url is None and time.monotonic() < deadline and process.poll() is None:
            time.sleep(1)
            found = re.search(r"endpoints at (http://\S+/v1)", log.read_text())
            url = found.group(1) if found else None
        assert url is not None, log.read_text()[-3000:]
        assert 25000 <= int(url.rsplit(":", 1)[1].split("/")[0]) < 26000
        assert url.startswith("http://127.0.0.1:")  # this machine only, unless host says
        chat_body = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}
        assert _refused(f"{url}/chat/completions", chat_body, key=None)[0] == 401
        # what once failed in the workers and ended the server: refused, naming the field
        status, error = _refused(f"{url}/chat/completions", {**chat_body, "temperature": -1})
        assert (status, error["error"]["param"]) == (400, "temperature")
        status, error = _refused(f"{url}/chat/completions", {**chat_body, "top_k": 100000})
        assert (status, error["error"]["param"]) == (400, "top_k")
        nan = {**chat_body, "temperature": float("nan")}
        assert _refused(f"{url}/chat/completions", nan)[1]["error"]["param"] == "temperature"
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as health:
            assert json.loads(health.read())["ready"] is True
        # one request: fewer prompts than the two data-parallel workers
        chat = _post(
            f"{url}/chat/completions",
            {"messages": [{"role": "user", "content": "12+7="}], "max_tokens": 6, "temperature": 0},
        )
        message = chat["choices"][0]["message"]
        assert 1 <= len(message["generation_token_ids"]) <= 6
        assert len(message["generation_log_probs"]) == len(message["generation_token_ids"])
        # three prompts in one request, sampled on both workers
        completions = _post(
            f"{url}/completions", {"prompt": ["1+1=", "2+2=", "3+3="], "max_tokens": 3}
        )
        assert [len(c["generation_token_ids"]) <= 3 for c in completions["choices"]] == [True] * 3
        # twice, as a shell's Ctrl-C and a supervisor's signal may both arrive
        process.send_signal(signal.SIGINT)
        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 0, log.read_text()[-3000:]
        assert "Traceback" not in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
