"""The driver's handle on a group of policy workers: data-parallel sharding and gathering.

Workers in one data-parallel group (tensor/pipeline partners) receive the same data; each
data-parallel group gets its own shard. Outputs are read from one reporting rank per group and
returned in the caller's order, so algorithms never see the parallel layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nemo_rl_offload.config.cluster_settings import ClusterSettings
from nemo_rl_offload.config.generation_settings import SamplingSettings
from nemo_rl_offload.config.policy_settings import PolicySettings
from nemo_rl_offload.distributed.sharding import split
from nemo_rl_offload.distributed.worker_group import WorkerGroup
from nemo_rl_offload.policy import checkpoint
from nemo_rl_offload.policy.policy_worker import PolicyWorker

# Metrics that describe one rank (its memory, time, learning rate), or that every rank already
# holds reduced over the data-parallel ranks (the multi-token prediction losses, models.mtp;
# router replay's changed share, models.router_replay): the step's value is the largest over
# ranks, not the sum.
_PER_RANK_KEYS = (
    "peak_",
    "gpu_memory",
    "step_time",
    "fwd_bwd_time",
    "lr",
    "grad_norm",
    "offload",
    "pinned",
    "d2h",
    "h2d",
    "cuda_graph",
    "device_",
    "mtp_",
    "router_replay_",
)


# Of the per-rank metrics, those also logged for every rank under ``rank<r>/`` when a group
# has several workers: each rank's peaks, bytes offloaded and pinned memory, which a maximum
# over ranks hides (the rest of the telemetry stays one value per step).
_EVERY_RANK_KEYS = frozenset(
    {
        "peak_fwd_bwd_gpu_memory_gib",
        "peak_activation_gpu_memory_gib",
        "peak_gpu_memory_gib",
        "offloaded_gib_per_step",
        "pinned_host_gib",
    }
)


def combine_step_metrics(results: list[dict[str, float]], reporters: set[int]) -> dict[str, float]:
    """One step's metrics from every worker's: sums once per data-parallel group (the
    reporting ranks), the largest value over ranks for what describes one rank (memory, time,
    offloading); with several workers, each rank's memory and offloading as ``rank<r>/<key>``
    too."""
    totals: dict[str, float] = {}
    for rank, result in enumerate(results):
        for key, value in result.items():
            if key.startswith(_PER_RANK_KEYS):  # every rank's memory and time count
                totals[key] = max(totals.get(key, 0.0), value)
                if len(results) > 1 and key in _EVERY_RANK_KEYS:
                    totals[f"rank{rank}/{key}"] = value
            elif rank in reporters:  # sums: once per data-parallel group
                totals[key] = totals.get(key, 0.0) + value
    return totals


def holds_reference(recipe: dict[str, Any], algorithm: str) -> bool:
    """Whether the policy workers of ``algorithm`` also hold a frozen reference copy of the
    model (DPO always; GRPO with a KL penalty in its loss): memory the policy's own steps live
    beside."""
    if algorithm == "dpo":
        return True
    if algorithm == "grpo":
        from nemo_rl_offload.losses import effective_kl_penalty

        return effective_kl_penalty(recipe.get("loss_fn") or {}) > 0
    return False


class PolicyGroup:
    def __init__(
        self,
        settings: PolicySettings,
        *,
        cluster: ClusterSettings,
        seed: int,
        trainable: bool,
        with_reference: bool = False,
        env_vars: dict[str, str] | None = None,
        gpu_fraction: float = 1.0,
        logits_temperature: float = 1.0,
    ) -> None:
        num_workers, self.on_gpu = cluster.workers, cluster.on_gpu
        where = settings.where
        self.settings = settings
        self.where, self.holds_reference = where, with_reference
        self.group = WorkerGroup(
            PolicyWorker,
            num_workers,
            name=where,
            gpus_per_worker=gpu_fraction if self.on_gpu else 0,
            cpus_per_worker=1 if self.on_gpu else 0.5,
            env_vars=env_vars,
            init_kwargs=lambda rank, world: {
                "settings": settings,
                "rank": rank,
                "world_size": world,
                "seed": seed,
                "on_gpu": self.on_gpu,
                "trainable": trainable,
                "with_reference": with_reference,
                "logits_temperature": logits_temperature,
            },
        )
        address, port = self.group.run_on(0, "node_address")
        self.setup_info = self.group.run("setup", address, port)
        layouts = self.group.run("parallel_layout")
        self.dp_size = int(layouts[0]["dp_size"])
        self.dp_rank_of = [int(layout["dp_rank"]) for layout in layouts]
        self.reporters = {
            int(layout["dp_rank"]): rank for rank, layout in enumerate(layouts) if layout["reports"]
        }
        first = layouts[0]
        self.layout = checkpoint.Layout(
            tensor_parallel=int(first["tensor_parallel"]),
            pipeline_parallel=int(first["pipeline_parallel"]),
            data_parallel=self.dp_size,
            context_parallel=int(first["context_parallel"]),
            expert_parallel=int(first["expert_parallel"]),
            distributed_optimizer=bool(first["distributed_optimizer"]),
        )

    @property
    def workers(self) -> int:
        """The group's workers (one per GPU on GPU nodes): NeMo-RL's per-GPU rates divide by it."""
        return len(self.dp_rank_of)

    @property
    def stopped(self) -> str | None:
        """Why the workers were stopped (a worker died or hung, or :meth:`shutdown`); None while
        they can be called (the policy's HTTP server's ``/health``)."""
        return self.group.stopped

    def check_alive(self) -> str | None:
        """:attr:`stopped`, after looking up whether a worker died meanwhile
        (``WorkerGroup.check_alive``)."""
        return self.group.check_alive()

    @property
    def fp8_linears(self) -> int:
        """How many of a worker's linears make FP8 products (``fp8_cfg``; 0 without)."""
        return max((info.get("fp8_linears", 0) for info in self.setup_info), default=0)

    @property
    def warnings(self) -> list[str]:
        return sorted({line for info in self.setup_info for line in info.get("warnings", [])})

    def _per_worker(self, shards: list[Any], *extra: Any, **kwargs: Any) -> list:
        return [((shards[dp], *extra), kwargs) for dp in self.dp_rank_of]

    def train(self, shards: list[list[dict[str, np.ndarray]]], loss: dict[str, Any]) -> dict:
        """One step: ``shards[d]`` are the micro-batches of data-parallel rank d. Returns the
        summed metrics over data-parallel ranks, plus per-rank maxima of memory and time (and,
        with several workers, each rank's own values: ``combine_step_metrics``)."""
        results = self.group.run("train", per_worker=self._per_worker(shards, loss))
        return combine_step_metrics(results, set(self.reporters.values()))

    def phase_peak_gib(self) -> float:
        """The most GPU memory any worker allocated since the last call or training step (a
        new count starts): two calls bracket a phase of the step."""
        return max(self.group.run("phase_peak_gib"), default=0.0)

    def _map(self, method: str, microbatches: list[Any], *args: Any, **kwargs: Any) -> list:
        """Spread independent items over the data-parallel ranks; results in input order."""
        shards = split(list(range(len(microbatches))), self.dp_size)
        per_dp = [[microbatches[i] for i in shard] for shard in shards]
        results = self.group.run(method, per_worker=self._per_worker(per_dp, *args, **kwargs))
        ordered: list[Any] = [None] * len(microbatches)
        for dp, shard in enumerate(shards):
            for position, index in enumerate(shard):
                ordered[index] = results[self.reporters[dp]][position]
        return ordered

    def token_logprobs(self, microbatches: list[dict], *, reference: bool = False) -> list:
        return self._map("token_logprobs", microbatches, reference=reference)

    def topk_logprobs(self, microbatches: list[dict], k: int | None) -> list:
        return self._map("topk_logprobs", microbatches, k)

    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        *,
        seed: int,
        pad_id: int,
        record_routes: bool = False,
    ) -> list[Any]:
        """Each prompt's ``generation.Generated`` (ids and log-probabilities, and with
        ``record_routes`` its positions' experts), in order."""
        if not prompts:
            return []
        shards = split(list(range(len(prompts))), self.dp_size)
        # Every rank samples at least one prompt (fewer prompts than data-parallel ranks: the
        # first one again, its result dropped): the sampler's ranks agree on their KV cache's
        # size with a collective that a rank without prompts would never join.
        per_dp = [[prompts[i] for i in shard] or [prompts[0]] for shard in shards]
        options = {"pad_id": pad_id, "record_routes": record_routes}
        results = self.group.run(
            "generate",
            per_worker=[
                ((per_dp[dp], settings), {"seed": seed + 7919 * dp, **options})
                for dp in self.dp_rank_of
            ],
        )
        ordered: list[Any] = [None] * len(prompts)
        for dp, shard in enumerate(shards):
            for position, index in enumerate(shard):
                ordered[index] = results[self.reporters[dp]][position]
        return ordered

    def save(self, directory: str) -> None:
        """Every worker writes its part of one checkpoint in ``directory``."""
        self.group.run("save_checkpoint", directory)

    def check_resumable(self, directory: str) -> list[str]:
        """Before a resume: refuse (one line) a checkpoint these workers cannot take their full
        state from; returns notes to show (e.g. what the checkpoint does not restore)."""
        return checkpoint.check_resumable(directory, self.layout)

    def load(self, directory: str, *, weights_only: bool = False) -> int:
        """Load a checkpoint on every worker; the step it was saved at (0 for weights only)."""
        return max(self.group.run("load_checkpoint", directory, weights_only=weights_only))

    def quantize(self, config_value: str, calibration: list[list[list[int]]]) -> dict[str, int]:
        """Every worker makes its part of the policy quantization-aware (PolicyWorker.quantize);
        what the first reports."""
        return self.group.run("quantize", config_value, calibration)[0]

    def shutdown(self) -> None:
        self.group.shutdown()
