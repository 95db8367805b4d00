"""NeMo-Gym's own ``vllm_model`` server in front of this backend's served policy.

NeMo-RL's NeMo-Gym recipes configure NeMo-Gym's ``responses_api_models/vllm_model`` with
``return_token_id_information: true`` and point it at the policy's HTTP server. This script
runs that server in-process (FastAPI's test client) against a running ``nemo-rl-offload serve``
and checks what NeMo-RL trains from: the output items' token ids and log-probabilities, a second
turn's prompt beginning with the first turn's tokens, and an over-long prompt finishing by
length. NeMo-Gym's dependencies are heavy, so it runs in a venv of its own:

    python3.12 -m venv /tmp/gymvenv && /tmp/gymvenv/bin/pip install nemo-gym==0.4.0
    scripts/venv-run nemo-rl-offload serve --config examples/configs/tiny/grpo.yaml \\
        policy.init_checkpoint=null policy.max_total_sequence_length=256 &
    /tmp/gymvenv/bin/python scripts/nemo_gym_model_server_check.py http://HOST:PORT/v1

A server that asks for a key (NEMO_RL_OFFLOAD_API_KEY set where it started) gets the same
variable's value from this script's environment. It prints one JSON line with the findings;
exit 0 when all hold.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import version
from unittest.mock import MagicMock


def main(base_url: str) -> int:
    import nemo_gym.server_utils
    from fastapi.testclient import TestClient
    from nemo_gym.server_utils import ServerClient
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    # The app reads NeMo-Gym's global config, which only its CLI sets up.
    nemo_gym.server_utils.get_global_config_dict = MagicMock(return_value={})
    config = VLLMModelConfig(
        host="127.0.0.1",
        port=0,
        base_url=base_url,
        api_key=os.environ.get("NEMO_RL_OFFLOAD_API_KEY") or "unused",
        model="policy",
        entrypoint="",
        name="policy_model",
        return_token_id_information=True,
        uses_reasoning_parser=False,
    )
    server = VLLMModel(config=config, server_client=MagicMock(spec=ServerClient))
    client = TestClient(server.setup_webserver()).__enter__()  # one event loop throughout
    question = {"role": "user", "content": "12+7="}
    first = client.post(
        "/v1/responses", json={"input": [question], "max_output_tokens": 6, "temperature": 1.0}
    )
    first.raise_for_status()
    output = first.json()["output"]
    item = output[-1]
    keys = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    seen = [int(t) for t in item["prompt_token_ids"] + item["generation_token_ids"]]
    second = client.post(
        "/v1/responses",
        json={
            "input": [question, *output, {"role": "user", "content": "and 1+1="}],
            "max_output_tokens": 4,
        },
    )
    second.raise_for_status()
    turn2 = second.json()["output"][-1]
    too_long = client.post(
        "/v1/responses", json={"input": [{"role": "user", "content": "x" * 4096}]}
    )
    too_long.raise_for_status()
    findings = {
        "nemo_gym": version("nemo-gym"),
        "turn1_has_token_fields": all(k in item for k in keys),
        "turn1_tokens": len(item["generation_token_ids"]),
        "turn1_logprobs_per_token": len(item["generation_log_probs"])
        == len(item["generation_token_ids"]),
        "turn2_prompt_starts_with_turn1_tokens": [
            int(t) for t in turn2["prompt_token_ids"][: len(seen)]
        ]
        == seen,
        "over_long_prompt_incomplete": (too_long.json().get("incomplete_details") or {}).get(
            "reason"
        ),
    }
    print(json.dumps(findings))
    ok = (
        findings["turn1_has_token_fields"]
        and findings["turn1_logprobs_per_token"]
        and findings["turn2_prompt_starts_with_turn1_tokens"]
        and findings["over_long_prompt_incomplete"] == "max_output_tokens"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
