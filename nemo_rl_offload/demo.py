"""The embedded default job: tiny SFT, then GRPO from its checkpoint, on the arithmetic task.

It runs the same commands a user would (``sft`` then ``grpo`` on examples/configs/tiny) on an
embedded local Ray cluster, on one GPU when there is one and on two CPU workers otherwise, and
ends by saying what improved and where the metrics are.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.metrics_logger import read_metrics

TINY = Path("examples/configs/tiny")


def _recipe(name: str) -> str:
    path = TINY / name
    if not path.is_file():
        raise UserInputError(
            f"{path}: not found; run the demo from the repository root (where examples/ is)"
        )
    return str(path)


def _device_overrides() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return ["cluster.gpus_per_node=1"]
    return ["cluster.gpus_per_node=0", "cluster.num_cpu_workers=2"]


def _first_last(log_dir: Path, key: str) -> tuple[float, float] | None:
    values = [r[key] for r in read_metrics(log_dir, "val") if r.get(key) is not None]
    return (values[0], values[-1]) if len(values) >= 2 else None


def run_demo(output_dir: str) -> int:
    from nemo_rl_offload.algorithms.grpo import run_grpo
    from nemo_rl_offload.algorithms.sft import run_sft
    from nemo_rl_offload.planning.plan_at_start import checked

    root = Path(output_dir)
    shutil.rmtree(root, ignore_errors=True)
    device = _device_overrides()
    sft_dir, grpo_dir = root / "sft", root / "grpo"
    print(
        f"demo: tiny SFT then GRPO on arithmetic ({' '.join(device)}); output in {root}",
        file=sys.stderr,
    )
    run_sft(
        checked(
            _recipe("sft.yaml"),
            [
                *device,
                f"checkpointing.checkpoint_dir={sft_dir / 'checkpoints'}",
                f"logger.log_dir={sft_dir / 'logs'}",
            ],
            "sft",
        )
    )
    run_grpo(
        checked(
            _recipe("grpo.yaml"),
            [
                *device,
                f"policy.init_checkpoint={sft_dir / 'checkpoints'}",
                f"checkpointing.checkpoint_dir={grpo_dir / 'checkpoints'}",
                f"logger.log_dir={grpo_dir / 'logs'}",
            ],
            "grpo",
        )
    )
    loss = _first_last(sft_dir / "logs", "val_loss")
    reward = _first_last(grpo_dir / "logs", "val_reward")
    print("\ndemo finished", file=sys.stderr)
    if loss:
        print(f"  SFT  held-out loss    {loss[0]:.3f} -> {loss[1]:.3f}", file=sys.stderr)
    if reward:
        print(f"  GRPO held-out reward  {reward[0]:.3f} -> {reward[1]:.3f}", file=sys.stderr)
    for name, directory in (("SFT", sft_dir), ("GRPO", grpo_dir)):
        print(f"  {name} metrics: {directory / 'logs' / 'metrics.jsonl'}", file=sys.stderr)
    return 0
