"""``nemo-rl-offload serve`` as a user runs it: the tiny GRPO recipe's two CPU workers behind
the OpenAI-compatible endpoints, asked by a client, stopped with Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "configs" / "tiny" / "grpo.yaml"


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


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
            env={**os.environ, "PYTHONPATH": str(REPO)},
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
