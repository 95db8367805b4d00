"""GRPO and on-policy distillation with NeMo-Gym rollouts, end to end on CPU workers: NeMo-Gym's
vllm_model model server and simple_agent, and a resources server of this repository's run from
the working directory (tests/support/nemo_gym_servers: graded rewards), against the policy's
HTTP server; two training steps and a validation.

Needs a Python with NeMo-Gym (``scripts/nemo-gym-venv`` makes one; then
``NEMO_RL_OFFLOAD_GYM_PYTHON``); skipped without one, as the GPU tests are without a GPU. The
servers share that one environment (``skip_venv_if_present`` over links, instead of a uv venv
each). The reward (the share of printable ASCII in the answer) varies between a random
policy's samples, so GRPO's loss is not zero; the sampler's log-probabilities that came back
through NeMo-Gym equal the training forward's (token_mult_prob_error 1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rl_offload.config.nemo_gym import GYM_PYTHON_ENV

REPO = Path(__file__).resolve().parents[2]
GYM_PYTHON = os.environ.get(GYM_PYTHON_ENV)
SERVERS = (
    "responses_api_models/vllm_model",
    "responses_api_agents/simple_agent",
    "resources_servers/ascii_share",
)
# A resources server of this repository's (graded rewards), run from the working directory as
# NeMo-Gym runs a user's own servers.
LOCAL_SERVERS = REPO / "tests" / "support" / "nemo_gym_servers"

pytestmark = pytest.mark.skipif(
    not GYM_PYTHON, reason=f"needs NeMo-Gym: scripts/nemo-gym-venv, then {GYM_PYTHON_ENV}"
)


def _nemo_gym_setup(tmp_path: Path) -> str:
    """The recipe sections shared by both runs: NeMo-Gym rows, servers and environments."""
    gym_root = Path(
        subprocess.run(
            [GYM_PYTHON, "-c", "import nemo_gym; print(nemo_gym.PARENT_DIR)"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    venv = Path(GYM_PYTHON).parent.parent
    venvs = tmp_path / "venvs"
    for server in SERVERS:
        (venvs / server).mkdir(parents=True)
        (venvs / server / ".venv").symlink_to(venv)
    shutil.copytree(LOCAL_SERVERS, tmp_path, dirs_exist_ok=True)
    rows = tmp_path / "rows.jsonl"
    example = gym_root / "resources_servers/example_single_tool_call/data/example.jsonl"
    with rows.open("w") as out:
        for line in example.read_text().splitlines():
            row = json.loads(line)
            row["agent_ref"] = {"name": "ascii_share_simple_agent"}
            out.write(json.dumps(row) + "\n")
    return f"""data:
  train: {{data_path: {rows}}}
  validation: {{data_path: {rows}}}
  default: {{dataset_name: NemoGymDataset, env_name: nemo_gym,
            processor: nemo_gym_data_processor}}
env:
  should_use_nemo_gym: true
  nemo_gym:
    config_paths:
      - responses_api_models/vllm_model/configs/vllm_model_for_training.yaml
      - resources_servers/ascii_share/configs/ascii_share.yaml
    uv_venv_dir: {venvs}
    skip_venv_if_present: true
logger: {{log_dir: {tmp_path}/logs}}
checkpointing: {{enabled: false, checkpoint_dir: {tmp_path}/ckpt}}
"""


def _run(tmp_path: Path, command: str, recipe_text: str) -> tuple[list[dict], str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text)
    result = subprocess.run(
        [sys.executable, "-m", "nemo_rl_offload.cli", command, "--config", str(recipe)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "nemo-gym: agents ['ascii_share_simple_agent'] ready" in result.stderr
    assert "servers ready!" in (tmp_path / "logs/nemo_gym/nemo_gym.log").read_text()
    # NeMo-Gym's servers went with the run
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "venvs")], capture_output=True, text=True)
    assert left.stdout.strip() == ""
    records = [json.loads(line) for line in (tmp_path / "logs/metrics.jsonl").open()]
    return records, result.stderr


def test_grpo_trains_on_nemo_gym_rollouts(tmp_path: Path) -> None:
    shared = _nemo_gym_setup(tmp_path)
    records, _ = _run(
        tmp_path,
        "grpo",
        f"""defaults: {REPO}/examples/configs/tiny/grpo.yaml
grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 2, max_num_steps: 2,
        val_period: 2, val_at_start: false, max_val_samples: 2}}
policy:
  init_checkpoint: null
  train_global_batch_size: 4
  train_micro_batch_size: 2
  logprob_batch_size: 2
  max_total_sequence_length: 1024
  generation: {{max_new_tokens: 12}}
{shared}""",
    )
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert 0.0 <= record["reward"] <= 1.0
        # the sampler's log-probabilities, back through NeMo-Gym, are the training forward's
        assert abs(record["token_mult_prob_error"] - 1.0) < 1e-3
    # graded rewards: the groups' advantages are not all zero, so the policy moves
    assert any(record["loss"] != 0.0 and record["grad_norm"] > 0 for record in train)
    (val,) = [r for r in records if r["phase"] == "val"]
    assert 0.0 <= val["val_reward"] <= 1.0


def test_router_replay_goes_through_nemo_gym(tmp_path: Path) -> None:
    """policy.router_replay on NeMo-Gym rollouts: the policy's server returns each completion's
    routes in its message, NeMo-Gym's vllm_model passes them on with the tokens, and every
    position the sampler fed is replayed in training (router_replay_routed 1)."""
    shared = _nemo_gym_setup(tmp_path)
    records, _ = _run(
        tmp_path,
        "grpo",
        f"""defaults: {REPO}/examples/configs/tiny/grpo.yaml
grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 2, max_num_steps: 2,
        val_period: 1000, val_at_start: false}}
policy:
  model_name: tiny-moe
  init_checkpoint: null
  router_replay: {{enabled: true}}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  logprob_batch_size: 2
  max_total_sequence_length: 1024
  generation: {{max_new_tokens: 12}}
{shared}""",
    )
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["router_replay_routed"] == 1.0 for r in train), train
    for record in train:  # the replayed training forward is the sampler's distribution
        assert abs(record["token_mult_prob_error"] - 1.0) < 1e-3


def test_distillation_trains_on_nemo_gym_rollouts(tmp_path: Path) -> None:
    shared = _nemo_gym_setup(tmp_path)
    sizes = (
        "train_global_batch_size: 4\n  train_micro_batch_size: 2\n  logprob_batch_size: 2\n"
        "  max_total_sequence_length: 1024"
    )
    records, _ = _run(
        tmp_path,
        "distill",
        f"""defaults: {REPO}/examples/configs/tiny/distillation.yaml
distillation: {{num_prompts_per_step: 2, num_generations_per_prompt: 2, max_num_steps: 2,
                val_period: 2, val_at_start: false, max_val_samples: 1}}
policy:
  {sizes}
  generation: {{max_new_tokens: 12}}
teacher:
  init_checkpoint: null
  {sizes}
{shared}""",
    )
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    # the student moves towards a (random) teacher on its NeMo-Gym samples: a real loss
    assert all(r["loss"] > 0 and 0.0 <= r["reward"] <= 1.0 for r in train)
    (val,) = [r for r in records if r["phase"] == "val"]
    assert 0.0 <= val["val_reward"] <= 1.0
