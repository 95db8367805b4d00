"""``nemo-rl-offload serve``: a recipe's policy, from a checkpoint or its initial weights,
behind the OpenAI-compatible endpoints until interrupted (docs/serving.md).

For talking to the policy outside a training run: trying an agent or a NeMo-Gym environment
against it, evaluating a checkpoint with an OpenAI client. The workers start as a training run
starts them (the recipe checked first, its parallel layout, its sampling settings), without an
optimizer step ever being taken.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.distributed import cluster
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.policy.checkpoint_dirs import resolve_checkpoint
from nemo_rl_offload.policy.policy_group import PolicyGroup
from nemo_rl_offload.policy.tokenizer import policy_tokenizer
from nemo_rl_offload.preflight import check_recipe
from nemo_rl_offload.serving.policy_endpoint import serve_policy

__all__ = ["serve"]

# How often the serving loop looks for a signal or the stop event.
_POLL_S = 0.2


def _seed(recipe: dict[str, Any], algorithm: str | None) -> int:
    section = recipe.get(algorithm or "") if algorithm else None
    return int(section.get("seed", 0)) if isinstance(section, dict) else 0


def serve(
    config_path: str,
    overrides: list[str],
    *,
    checkpoint: str | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Serve until SIGINT or SIGTERM (or ``stop`` is set): 0 when stopped so; 1 as soon as
    the policy's workers are stopped (a worker died, idle or in a call, or hung), since a
    server without workers can only refuse (its supervisor restarts it)."""
    recipe = load_recipe(config_path, overrides)
    report = check_recipe(recipe, base_dir=Path.cwd(), recipe_path=Path(config_path), starting=True)
    if report.errors:
        raise UserInputError(report.errors)
    for line in report.warnings:
        print(line, file=sys.stderr)
    recipe = report.recipe
    policy_cfg = recipe["policy"]
    settings = report.policies["policy"]
    if settings.quant_cfg is not None:
        raise UserInputError(
            "policy.quant_cfg: nemo-rl-offload serve does not rebuild a quantization-aware "
            "policy yet; export the checkpoint with nemo-rl-offload export-hf and serve the "
            "exported directory as policy.model_name (with policy.quant_cfg removed)"
        )
    source = checkpoint or settings.init_checkpoint
    path = (
        resolve_checkpoint(source, "--checkpoint" if checkpoint else "policy.init_checkpoint")
        if source
        else None
    )
    tokenizer = policy_tokenizer(policy_cfg, settings.tokenizer)
    stop = stop or threading.Event()
    info = cluster.start_or_join(report.cluster, num_cpus=max(os.cpu_count() or 1, 4))
    # After Ray's start, which sets its own SIGTERM handler in the driver. The handler only
    # records the signal: setting an Event from a handler can deadlock on the Event's lock,
    # which the interrupted main thread may hold.
    signalled: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda number, _frame: signalled.append(number))
        for sig in (signal.SIGINT, signal.SIGTERM)
        if threading.current_thread() is threading.main_thread()
    }
    group = server = None
    try:
        group = PolicyGroup(
            settings,
            cluster=report.cluster,
            seed=_seed(recipe, report.algorithm),
            trainable=False,
            env_vars=report.worker_environment("policy") or None,
            logits_temperature=settings.generation.temperature,
        )
        for line in group.warnings:
            print(f"warning: {line}", file=sys.stderr)
        if path is not None:
            group.load(str(path / "policy"), weights_only=True)
            print(f"policy weights loaded from {path}", file=sys.stderr)
        else:
            print(
                "policy: serving the model's initial weights (give --checkpoint to serve a "
                "trained step)",
                file=sys.stderr,
            )
        server = serve_policy(
            settings, group, tokenizer, seed=_seed(recipe, report.algorithm), force=True
        )
        print("serving until interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        while not signalled and not stop.wait(_POLL_S):
            if group.check_alive() is not None:
                print(
                    f"error: the policy's workers stopped ({group.stopped}); the server stops",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        return 0
    finally:
        if server is not None:
            server.stop()
        if group is not None:
            group.shutdown()
        cluster.shutdown(info)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
