"""validate's lines for the keys that act only in some setups (checkpoint_must_save_by,
logprob_batch_size, monitor_gpus, num_val_samples_to_print, max_input_seq_length), each
both ways; the GPU monitor's pure parts; the printed validation samples."""

from __future__ import annotations

import pytest

from nemo_rl_offload.algorithms.batching import TokenSequence
from nemo_rl_offload.algorithms.grpo import format_samples
from nemo_rl_offload.config.loader import load_recipe
from nemo_rl_offload.data.tokenizer import ByteTokenizer
from nemo_rl_offload.gpu_monitor import metric_names, summarize
from nemo_rl_offload.preflight import check_recipe

pytest.importorskip("megatron.core")


def report_for(algorithm: str, *overrides: str, starting: bool = False):
    recipe = load_recipe(f"examples/configs/tiny/{algorithm}.yaml", list(overrides))
    return check_recipe(recipe, megatron_crosscheck=False, starting=starting)


def lines_about(report, key: str) -> list[str]:
    return [line for line in report.errors + report.warnings if key in line]


def test_a_malformed_deadline_is_one_line_naming_the_key_and_format():
    report = report_for("sft", "checkpointing.checkpoint_must_save_by=3:45:00")
    assert report.errors == [
        "checkpointing.checkpoint_must_save_by: '3:45:00' is not DD:HH:MM:SS (e.g. '00:03:45:00')"
    ]
    assert report_for("sft", "checkpointing.checkpoint_must_save_by=00:03:45:00").ok


def test_a_deadline_without_checkpointing_warns():
    report = report_for(
        "sft", "checkpointing.checkpoint_must_save_by=00:03:45:00", "checkpointing.enabled=false"
    )
    assert report.ok
    assert lines_about(report, "stops at the deadline without saving")
    assert not lines_about(report_for("sft", "checkpointing.enabled=false"), "deadline")


def test_monitor_gpus_warns_on_cpu_workers_only():
    cpu = report_for("sft", "logger.monitor_gpus=true")
    assert lines_about(cpu, "logger.monitor_gpus") == [
        "warning: logger.monitor_gpus: has no effect on CPU workers (cluster.gpus_per_node is 0)"
    ]
    assert not lines_about(report_for("sft", "logger.monitor_gpus=false"), "logger.monitor_gpus")
    gpu = report_for("sft", "logger.monitor_gpus=true", "cluster.gpus_per_node=1")
    assert not lines_about(gpu, "logger.monitor_gpus")


@pytest.mark.parametrize(("algorithm", "warns"), [("sft", True), ("dpo", True), ("grpo", False)])
def test_num_val_samples_to_print_warns_where_validation_generates_nothing(algorithm, warns):
    report = report_for(algorithm, "++logger.num_val_samples_to_print=3")
    assert bool(lines_about(report, "num_val_samples_to_print")) is warns
    assert not lines_about(
        report_for(algorithm, "++logger.num_val_samples_to_print=0"), "num_val_samples_to_print"
    )


def test_logprob_batch_size_must_be_positive_and_matches_at_tp4():
    report = report_for("grpo", "policy.logprob_batch_size=0")
    assert lines_about(report, "policy.logprob_batch_size: must be at least 1 (got: 0)")
    tp4 = report_for(
        "grpo",
        "policy.logprob_batch_size=64",
        "++policy.megatron_cfg.tensor_model_parallel_size=4",
        starting=True,  # validate only warns: the switch is the launch environment's
    )
    assert any(line.startswith("policy.logprob_batch_size: 64 differs") for line in tp4.errors)
    same = report_for("grpo", "++policy.megatron_cfg.tensor_model_parallel_size=4")
    assert not lines_about(same, "logprob_batch_size")
    # NeMo-RL's ways out: a forced on-policy ratio reads no old log-probabilities, and its
    # environment switch accepts the difference
    forced = report_for(
        "grpo",
        "policy.logprob_batch_size=64",
        "++policy.megatron_cfg.tensor_model_parallel_size=4",
        "++loss_fn.force_on_policy_ratio=true",
    )
    assert not lines_about(forced, "logprob_batch_size")


def test_nemo_rls_switch_accepts_a_logprob_batch_size_that_differs_at_tp4(monkeypatch):
    """With the switch set the difference is accepted with one warning naming it and the risk
    (tests/unit/test_preflight.py checks both ways)."""
    monkeypatch.setenv("NRL_IGNORE_TP_ACCURACY_CHECK", "1")
    report = report_for(
        "grpo", "policy.logprob_batch_size=64", "++policy.megatron_cfg.tensor_model_parallel_size=4"
    )
    (warning,) = lines_about(report, "logprob_batch_size")
    assert warning.startswith("warning: policy.logprob_batch_size: 64 differs")


def test_max_input_seq_length_over_the_total_warns_and_below_one_is_refused():
    over = report_for("grpo", "data.max_input_seq_length=100")
    assert lines_about(over, "warning: data.max_input_seq_length: 100 is more than")
    assert not lines_about(report_for("grpo"), "max_input_seq_length")
    assert lines_about(report_for("grpo", "data.max_input_seq_length=0"), "must be at least 1")


def test_gpu_metrics_are_the_step_mean_utilisation_and_peak_memory():
    samples = [[(0, 10.0, 1.0), (1, 50.0, 2.0)], [(0, 30.0, 3.0), (1, 70.0, 1.5)]]
    assert summarize(samples, node=1) == {
        "node.1.gpu.0.util": 20.0,
        "node.1.gpu.0.mem_gb": 3.0,
        "node.1.gpu.1.util": 60.0,
        "node.1.gpu.1.mem_gb": 2.0,
    }
    assert summarize([], node=0) == {}
    assert metric_names(0, 3) == ("node.0.gpu.3.util", "node.0.gpu.3.mem_gb")


@pytest.mark.gpu
def test_nvml_reads_every_gpu_of_the_node():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from nemo_rl_offload.gpu_monitor import NodeSampler

    sampler = NodeSampler(interval=0.1)
    assert sampler.error is None
    error, samples = sampler.take()
    sampler.stop()
    assert error is None and samples
    metrics = summarize(samples, node=0)
    # NVML sees every GPU of the node, CUDA_VISIBLE_DEVICES or not (one job per GPU on a
    # shared host): the sampler reports them all, at least the ones this process uses.
    import pynvml

    pynvml.nvmlInit()
    node_gpus = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
    assert len(metrics) == 2 * node_gpus >= 2 * torch.cuda.device_count()
    assert all(value >= 0 for value in metrics.values())


def test_validation_samples_print_as_a_readable_block():
    tok = ByteTokenizer()
    prompts = [TokenSequence(tok.encode("Q: 1+1=? A:", add_bos=True), 12)] * 3
    responses = [tok.encode(" 2", add_eos=True), tok.encode(" 3", add_eos=True)] * 2
    text = format_samples(tok, prompts, responses[:3], [1.0, 0.0, 1.0], count=2, step=20)
    assert text.splitlines() == [
        "validation samples at step 20 (2 of 3):",
        "--- sample 1 | reward 1",
        "prompt:   'Q: 1+1=? A:'",
        "response: ' 2<eos>'",
        "--- sample 2 | reward 0",
        "prompt:   'Q: 1+1=? A:'",
        "response: ' 3<eos>'",
        "---",
    ]
