"""Which attention kernels let an offloading model's gradients equal a plain model's, bitwise?

Two policy workers in one process (same seed, so the same weights), one with fine-grained
offloading, one without, train the same batch with learning rate 0; the plain one trains it
twice, which measures its own run-to-run spread. Repeated for torch's SDPA kernels (flash,
cuDNN, math, or torch's own choice), with and without ``torch.use_deterministic_algorithms``.
Measured on an H100 (benchmarks/results/2026-11-22_h100_attention_determinism.json): the flash
backward differs between two plain passes (and so does the offloading model, by as much); the
math kernel is bitwise reproducible and the offloading model equals the plain one, which is why
``deterministic_mode`` selects it (nemo_rl_offload/models/attention.py).

Run on a GPU machine: python3 benchmarks/attention_determinism.py [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402

FIVE = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
KERNELS = ("all", "flash", "cudnn", "math")


def _worker(modules: list[str], offload: bool):
    from nemo_rl_offload.policy.policy_worker import PolicyWorker
    from nemo_rl_offload.preflight import resolve_policy

    section = {
        "model_name": "llama-1b",
        "precision": "bfloat16",
        "max_total_sequence_length": 2048,
        "megatron_cfg": {
            "enabled": True,
            "fine_grained_activation_offloading": offload,
            "offload_modules": modules if offload else None,
            "min_offloaded_tensor_size": 65536,
            "model_overrides": {"num_layers": 4},
            "optimizer": {
                "optimizer": "adam",
                "lr": 0.0,
                "min_lr": 0.0,
                "clip_grad": 0.0,
                "use_distributed_optimizer": False,
            },
        },
    }
    worker = PolicyWorker(
        settings=resolve_policy(section), rank=0, world_size=1, seed=3, on_gpu=True
    )
    worker.setup(*worker.node_address())
    return worker


def _grads(worker) -> list[torch.Tensor]:
    return [p.main_grad.clone() for p in worker._unwrapped().parameters()]


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def _kernels(name: str) -> None:
    cuda = torch.backends.cuda
    cuda.enable_flash_sdp(name in ("flash", "all"))
    cuda.enable_mem_efficient_sdp(name == "all")
    cuda.enable_math_sdp(name in ("math", "all"))
    cuda.enable_cudnn_sdp(name in ("cudnn", "all"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    ids = np.random.default_rng(0).integers(0, 32000, (2, 1024))
    batch = [{"input_ids": ids, "labels": ids, "loss_mask": np.ones((2, 1024), np.float32)}] * 2
    runs = []
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        for kernel in KERNELS:
            for modules in (FIVE, ["core_attn"]):
                if kernel not in ("all", "flash") and modules != FIVE:
                    continue
                _kernels(kernel)
                offloading, plain = _worker(modules, True), _worker(modules, False)
                rows = []
                for _ in range(3):
                    offloading.train(batch, {"name": "nll"})
                    plain.train(batch, {"name": "nll"})
                    first = _grads(plain)
                    plain.train(batch, {"name": "nll"})
                    rows.append((_diff(_grads(offloading), first), _diff(_grads(plain), first)))
                run = {
                    "det": deterministic,
                    "backend": kernel,
                    "modules": modules,
                    "fgo_vs_plain": [a for a, _ in rows],
                    "plain_vs_plain": [b for _, b in rows],
                }
                print(json.dumps(run), flush=True)
                runs.append(run)
                offloading = plain = None
                gc.collect()
                PipelineOffloadManager.reset_instance()
                torch.cuda.empty_cache()
    _kernels("all")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(runs, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
