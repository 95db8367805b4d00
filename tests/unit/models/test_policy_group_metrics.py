"""How one training step's metrics are combined from the workers of a policy group."""

from __future__ import annotations

from nemo_rl_offload.policy.policy_group import combine_step_metrics


def test_sums_once_per_data_parallel_group_and_keeps_each_ranks_offloading():
    # Two tensor-parallel pairs (ranks 0-1 and 2-3), ranks 0 and 2 reporting for their group.
    results = [
        {
            "loss": 1.0,
            "num_tokens": 10,
            "offloaded_gib_per_step": 2.0,
            "peak_fwd_bwd_gpu_memory_gib": 5.0,
            "d2h_gib": 2.0,
        },
        {
            "loss": 1.0,
            "num_tokens": 10,
            "offloaded_gib_per_step": 2.5,
            "peak_fwd_bwd_gpu_memory_gib": 6.0,
        },
        {
            "loss": 3.0,
            "num_tokens": 30,
            "offloaded_gib_per_step": 1.0,
            "peak_fwd_bwd_gpu_memory_gib": 4.0,
        },
        {
            "loss": 3.0,
            "num_tokens": 30,
            "offloaded_gib_per_step": 1.5,
            "peak_fwd_bwd_gpu_memory_gib": 4.5,
        },
    ]
    step = combine_step_metrics(results, reporters={0, 2})
    assert step["loss"] == 4.0 and step["num_tokens"] == 40
    assert step["offloaded_gib_per_step"] == 2.5 and step["peak_fwd_bwd_gpu_memory_gib"] == 6.0
    assert [step[f"rank{r}/offloaded_gib_per_step"] for r in range(4)] == [2.0, 2.5, 1.0, 1.5]
    assert [step[f"rank{r}/peak_fwd_bwd_gpu_memory_gib"] for r in range(4)] == [5.0, 6.0, 4.0, 4.5]
    assert not any(key.startswith("rank") and "loss" in key for key in step)
    # Only the short list: the rest of the telemetry stays one value per step.
    assert step["d2h_gib"] == 2.0
    assert not any(key.startswith("rank") and "d2h" in key for key in step)


def test_one_worker_logs_no_per_rank_copies():
    step = combine_step_metrics([{"loss": 1.0, "offloaded_gib_per_step": 2.0}], reporters={0})
    assert step == {"loss": 1.0, "offloaded_gib_per_step": 2.0}
