"""Stand-ins for the planner's GPU side (``planner._measure``) and its CPU ledger
(``planner._layer_costs``), for planner tests that run no workers.

:func:`graphed_records`: telemetry as a graphed job reports it (warm-up steps eager, one
captured, the rest replayed); offloading saves 2 GiB of peak and moves 0.5 GiB per module and
micro-batch. :func:`simulated`: a GPU whose peaks and times follow the cost model with
constants the planner does not know (its "truth"), and that runs out of memory above a
capacity: what the planner must find its way through by measuring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_rl_offload.config.model_shape import DENSE
from nemo_rl_offload.config.overrides import parse_override
from nemo_rl_offload.distributed.worker_group import WorkerError
from nemo_rl_offload.planning import cost_model, planner
from nemo_rl_offload.planning.activation_bytes import ActivationTable, Row
from nemo_rl_offload.planning.cost_model import Calibration, LayerCosts

GIB = 2**30
# One dense layer per micro-batch, shaped as a Llama layer's ledger is (GiB): what each module
# saves, the offload module and the recompute option that remove it.
LAYER = (
    (0.10 * GIB, "attn_norm", "full"),
    (0.10 * GIB, "qkv_linear", "layernorm"),
    (0.30 * GIB, "core_attn", "core_attn"),
    (0.10 * GIB, "attn_proj", "full"),
    (0.10 * GIB, "mlp_norm", "full"),
    (0.10 * GIB, "mlp_fc1", "layernorm"),
    (0.50 * GIB, "mlp_act", "mlp"),
    (0.25 * GIB, "mlp_fc2", "mlp_act"),
    (0.05 * GIB, None, "full"),
)


def layer_table(
    layers: int,
    saved: tuple[tuple[float, str | None, str | None], ...],
    layer_input: float,
    model: float = 0.0,
) -> ActivationTable:
    """An activation table of ``layers`` dense layers, each saving ``saved`` ((bytes, offload
    module, recompute option) per entry; every tensor large enough to offload), one
    micro-batch in flight: the arithmetic's input without measuring a ledger."""
    rows = tuple(
        Row(f"{offload or 'entry'}.{i}", DENSE, layers, nbytes, offload, recompute, layers > 1)
        for i, (nbytes, offload, recompute) in enumerate(saved)
    )
    return ActivationTable(1024, "test", 1, rows, layer_input, model, layers)


FLOPS = {
    "layernorm": 1e9,
    "core_attn": 2e11,
    "mlp": 5e11,
    "mlp_act": 1e9,
    "moe": 0.0,
    "moe_act": 0.0,
    "full": 1e12,
}


def small_costs(layers: int = 8, microbatches: int = 2) -> planner.RecipeCosts:
    costs = LayerCosts(layer_table(layers, LAYER, 0.1 * GIB, 1.0 * GIB), {DENSE: FLOPS})
    return planner.RecipeCosts(costs, layers * 1e12 + 0.5e12, microbatches)


# What the simulated GPU does: the ledger's activations 5% over its count, 20 GiB resident,
# 50 TFLOP/s, 50 GB/s copies, 1 ms of host time per hook.
TRUTH = Calibration(
    resident_bytes=20 * GIB,
    activation_scale=1.05,
    base_step_s=1.02,
    microbatches=2,
    flops_per_s=5e13,
    hbm_bytes_per_s=3e12,
    d2h_bytes_per_s=50e9,
    h2d_bytes_per_s=50e9,
    host_s_per_hook=1e-3,
    offload_peak_bytes=0.0,  # the simulated GPU's offload plans peak on the line
)


BY_MODULE = "activation_offload_fraction_by_module"


def candidate_of(overrides: list[str]) -> planner.Candidate:
    """The candidate a measurement's override lines set (the planner's patch, read back)."""
    settings: dict[str, Any] = {}
    own: dict[str, float] = {}  # activation_offload_fraction_by_module, one line per module
    chunk = None  # policy.logprob_chunk_size
    for line in overrides:
        override = parse_override(line)
        if override.path[:3] == ("policy", "megatron_cfg", BY_MODULE):
            own[override.path[3]] = float(override.value)
        elif override.path[:2] == ("policy", "megatron_cfg"):
            settings[override.path[-1]] = override.value
        elif override.path == ("policy", "logprob_chunk_size"):
            chunk = override.value
    fgo = settings.get("fine_grained_activation_offloading") is True
    host = settings.get("optimizer_cpu_offload") is True
    common: dict[str, Any] = {
        "logprob_chunk": chunk,
        "output_chunked": settings.get("chunked_output_layer") is True,
        "host_optimizer": float(settings["optimizer_offload_fraction"]) if host else None,
    }
    modules = tuple(settings.get("offload_modules") or ()) if fgo else ()
    if settings.get("activation_checkpointing") is True and (
        settings.get("recompute_granularity") != "selective"
    ):
        block = settings.get("recompute_num_layers") if settings.get("recompute_method") else None
        return planner.Candidate(
            modules, 1.0, None, full_recompute=True, recompute_num_layers=block, **common
        )
    selective = settings.get("activation_checkpointing") is True
    return planner.Candidate(
        modules,
        float(settings.get("activation_offload_fraction", 1.0)),
        None,
        recompute_modules=tuple(settings.get("recompute_modules") or ()) if selective else (),
        fraction_by_module=tuple(own.items()),
        **common,
    )


@dataclass
class Simulated:
    """``planner._measure`` on a simulated GPU of ``capacity_gib``; ``calls``: the candidates
    measured, by name, in order."""

    costs: planner.RecipeCosts
    capacity_gib: float
    truth: Calibration = TRUTH
    # What the whole optimizer state on the host takes off the peak and adds to the step
    host_state_gib: float = 0.0
    host_step_s: float = 0.0

    def __post_init__(self) -> None:
        self.calls: list[str] = []

    def truth_of(self, candidate: planner.Candidate) -> cost_model.Prediction:
        return cost_model.predict(self.costs.layers, candidate.settings(), self.truth)

    def __call__(self, config: str, overrides: list[str], steps: int, err: Any) -> list[dict]:
        candidate = candidate_of(overrides)
        self.calls.append(candidate.name)
        true = self.truth_of(candidate)
        share = candidate.host_optimizer or 0.0
        peak = true.peak_bytes / GIB - share * self.host_state_gib
        if peak > self.capacity_gib:
            raise WorkerError(
                "policy",
                0,
                f"OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                f"total capacity of {self.capacity_gib:.2f} GiB of which 0 bytes is free.",
            )
        copies = {"d2h_gb_per_s": 50.0, "h2d_gb_per_s": 50.0} if true.removal.hooks else {}
        return [
            {
                "length": 1024,
                "peak_fwd_bwd_gpu_memory_gib": peak,
                "peak_activation_gpu_memory_gib": peak - self.truth.resident_bytes / GIB,
                "fwd_bwd_time_s": true.step_s,
                "train_time_s": true.step_s + 0.1 + share * self.host_step_s,
                **copies,
            }
            for _ in range(steps)
        ]


def graphed_records(overrides: list[str], steps: int) -> list[dict]:
    offloading = any("fine_grained_activation_offloading=true" in o for o in overrides)
    recomputing = any("activation_checkpointing=true" in o for o in overrides)
    records = []
    for step in range(1, steps + 1):
        record = {
            "length": 1024,
            "peak_fwd_bwd_gpu_memory_gib": 18.0 if offloading or recomputing else 20.0,
            "peak_activation_gpu_memory_gib": 5.0,
            "fwd_bwd_time_s": 0.3,
            "offload_step_microbatches": 4.0,
            "cuda_graph_replayed": float(step >= 4),
            "cuda_graph_captured": float(step == 4),
        }
        if offloading:
            record.update({f"offloaded_gib_{m}": 2.0 for m in planner.DENSE_MODULES})
        records.append(record)
    return records
