"""validate's memory estimate (nemo_rl_offload/planning/memory_report.py) on tiny recipes:
the warning both ways, CPU workers, a model not on this machine, the teacher beside the policy,
and the ledger cache (nemo_rl_offload/planning/ledger_cache.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from nemo_rl_offload.config.loader import load_recipe  # noqa: E402
from nemo_rl_offload.planning import ledger_cache
from nemo_rl_offload.planning.memory_report import memory_estimate  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny"


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv(ledger_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(ledger_cache, "_MEMO", {})  # as in a new process


def test_warns_only_when_the_estimate_exceeds_the_gpu():
    recipe = load_recipe(TINY / "grpo.yaml", ["cluster.gpus_per_node=1"])
    fits = memory_estimate(recipe, "grpo", gpu_memory_gib=80)
    assert fits.warnings == []
    assert fits.lines[-1].startswith("  peak: ")
    assert fits.lines[-1].endswith("of 80.00 GiB GPU memory (--gpu-memory-gib)")
    tight = memory_estimate(recipe, "grpo", gpu_memory_gib=0.001)
    assert len(tight.warnings) == 1
    assert tight.warnings[0].startswith("warning: memory estimate: ")
    assert "more than the GPU's 0.00 GiB" in tight.warnings[0]
    assert "(policy training)" in tight.warnings[0]
    assert "policy.megatron_cfg.offload_modules" in tight.warnings[0]


def test_cpu_workers_are_not_compared_with_a_gpu():
    recipe = load_recipe(TINY / "grpo.yaml")
    found = memory_estimate(recipe, "grpo", gpu_memory_gib=0.001)
    assert found.warnings == []
    assert "CPU workers (cluster.gpus_per_node 0): not compared with a GPU" in found.lines[-1]
    text = "\n".join(found.lines)
    for part in ("weights", "gradient buffers", "optimizer state", "activations", "KV cache"):
        assert f"policy {part}" in text or f"policy generation {part}" in text, part


def test_a_model_not_on_this_machine_skips_the_estimate_in_one_line():
    recipe = load_recipe(TINY / "sft.yaml", ["policy.model_name=someorg/not-on-this-machine"])
    found = memory_estimate(recipe, "sft")
    assert found.lines == [
        "memory estimate: skipped (policy.model_name is not on this machine, so its shapes "
        "are unknown)"
    ]
    assert found.warnings == []


def test_the_teacher_is_estimated_beside_the_policy():
    recipe = load_recipe(TINY / "distillation.yaml", ["cluster.gpus_per_node=1"])
    found = memory_estimate(recipe, "distillation", gpu_memory_gib=80)
    assert [e.where for e in found.estimates] == ["policy", "teacher"]
    assert found.estimates[1].activations is None
    assert any(line.startswith("  teacher weights: ") for line in found.lines)


def test_the_ledger_is_measured_once_per_model_and_read_back_from_disk():
    recipe = load_recipe(TINY / "sft.yaml")
    first, hit = ledger_cache.cached_ledger(recipe["policy"])
    assert not hit
    assert len(list(ledger_cache.cache_dir().glob("ledger-*.json"))) == 1
    ledger_cache._MEMO.clear()  # a new process
    longer = dict(recipe["policy"], max_total_sequence_length=128)
    again, hit = ledger_cache.cached_ledger(longer)
    assert hit  # lengths do not change what a layer saves per token
    assert again.total_bytes(64) == pytest.approx(first.total_bytes(64))
    chunked = dict(recipe["policy"], logprob_chunk_size=16)
    _, hit = ledger_cache.cached_ledger(chunked)
    assert not hit  # the loss saves other tensors with chunked log-probabilities


def test_a_step_whose_kv_cache_does_not_fit_counts_the_chunk_the_sampler_takes():
    """The sampler samples in chunks of rows whose cache fits 60% of the free memory
    (policy/generation.py); the estimate counts one chunk's cache, and says so."""
    overrides = ["cluster.gpus_per_node=1", "policy.generation.max_new_tokens=48"]
    recipe = load_recipe(TINY / "grpo.yaml", overrides)
    roomy = memory_estimate(recipe, "grpo", gpu_memory_gib=80)
    whole = roomy.estimates[0].kv_cache
    assert whole > 0 and not any("chunks" in line for line in roomy.lines)
    gpu = (roomy.estimates[0].between_steps + 1.2 * whole) / 2**30  # 60% of the rest: ~72%
    tight = memory_estimate(recipe, "grpo", gpu_memory_gib=gpu)
    chunk = tight.estimates[0].kv_cache
    assert 0 < chunk < whole
    assert any("the sampler takes chunks of about" in line for line in tight.lines)
    assert not any("(policy generation)" in w for w in tight.warnings)
