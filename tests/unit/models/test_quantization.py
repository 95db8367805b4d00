"""Quantization-aware training with ModelOpt (``policy.quant_cfg``, models/quantization.py) on
CPU workers: the CPU NVFP4 kernel is ModelOpt's arithmetic, the configs quantize what they
name, gradients pass the quantizers, a resumed policy keeps its calibrated ranges and trains
bitwise on, and rollouts run with or without the quantizers as generation.quant_cfg says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support import worker_ranks

from nemo_rl_offload.config.generation_settings import SamplingSettings
from nemo_rl_offload.errors import UserInputError
from nemo_rl_offload.models import quantization

pytest.importorskip("modelopt.torch.quantization")

REPO = Path(__file__).resolve().parents[3]
MLP_WEIGHTS = "NVFP4_MLP_WEIGHT_ONLY_CFG"
# Static per-tensor FP8 input ranges: the one of ModelOpt's stock configs here that calibrates.
CALIBRATED = "FP8_DEFAULT_CFG"


def _ids(seed: int, rows: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(1, 300, (rows, length), generator=torch.Generator().manual_seed(seed))


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    return model(ids, positions, None)


def test_the_cpu_nvfp4_kernel_is_modelopts_arithmetic():
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3
    amax = x.abs().amax()
    ours = quantization.nvfp4_fake_quant(x, amax, 16)
    packed, scale, double_scale = NVFP4QTensor.quantize(
        x.clone(), 16, weights_scaling_factor_2=amax.float() / (6 * 448)
    )
    reference = packed.dequantize(
        dtype=torch.float32, scale=scale, double_scale=double_scale, block_sizes={-1: 16}
    )
    assert torch.equal(ours, reference)
    assert not torch.equal(ours, x)
    # E2M1's values and its ties to the even mantissa, with a block scale of 1.
    row = torch.tensor([[0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, -0.75, 0, 0, 0, 0, 0, 6]])
    assert quantization.nvfp4_fake_quant(row, torch.tensor(6.0 * 448), 16).tolist() == [
        [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0, 0, 0, 0, 0, 6.0]
    ]


def nvfp4_weights_file(quantizers: str) -> dict:
    """A recipe file as NeMo-RL's quant_configs write them (format names, not ModelOpt's
    tuples): NVFP4 weights, blocks of 16, for the weight quantizers ``quantizers`` matches."""
    nvfp4 = {"num_bits": "e2m1", "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": "e4m3"}}
    return {
        "metadata": {"recipe_type": "ptq"},
        "quantize": {  # no algorithm: ModelOpt's max is the default
            "quant_cfg": [
                {"quantizer_name": "*", "enable": False},
                {"quantizer_name": quantizers, "enable": True, "cfg": nvfp4},
            ],
        },
    }


@pytest.mark.parametrize("source", ["name", "file"])
def test_mlp_weight_quantization_changes_the_forward_and_lets_gradients_through(
    build_tiny, tmp_path, source
):
    plain, _ = build_tiny()
    quantized, _ = build_tiny()
    if source == "file":
        (tmp_path / "mlp.yaml").write_text(
            yaml.safe_dump(nvfp4_weights_file("*mlp*weight_quantizer"))
        )
        config = quantization.resolve("mlp.yaml", [tmp_path])
    else:
        config = quantization.resolve(MLP_WEIGHTS, [])
    info = quantization.quantize(
        quantized, config, [], on_gpu=False, pipeline_or_context_parallel=False
    )
    enabled = quantization.enabled_quantizers(quantized)
    assert info == {"quantizers": len(enabled), "calibration_batches": 0}
    assert enabled and all(".mlp." in n and n.endswith("weight_quantizer") for n in enabled)
    ids = _ids(1)
    want = _forward(plain, ids)
    got = _forward(quantized, ids)
    assert not torch.allclose(got, want)
    with quantization.quantizers_off(quantized):
        assert torch.equal(_forward(quantized, ids), want)
    assert torch.equal(_forward(quantized, ids), got)  # back on after the block
    got.float().logsumexp(-1).mean().backward()
    for name, param in quantized.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_a_calibrating_config_needs_calibration_data_and_sets_its_ranges(build_tiny):
    model, _ = build_tiny()
    config = quantization.resolve(CALIBRATED, [])
    with pytest.raises(UserInputError, match="set policy.quant_calib_size"):
        quantization.quantize(model, config, [], on_gpu=False, pipeline_or_context_parallel=False)
    model, _ = build_tiny()
    with pytest.raises(UserInputError, match="pipeline stages or context-parallel"):
        quantization.quantize(
            model, config, [_ids(2)], on_gpu=False, pipeline_or_context_parallel=True
        )
    model, _ = build_tiny()
    info = quantization.quantize(
        model, config, [_ids(2), _ids(3)], on_gpu=False, pipeline_or_context_parallel=False
    )
    assert info["calibration_batches"] == 2
    ranges = [
        m.amax for n, m in model.named_modules() if n.endswith("input_quantizer") and m.is_enabled
    ]
    assert ranges and all(r is not None and r > 0 for r in ranges)


def test_a_config_that_names_no_layer_of_the_model_is_one_line(build_tiny, tmp_path):
    experts_only = tmp_path / "experts.yaml"
    experts_only.write_text(yaml.safe_dump(nvfp4_weights_file("*.experts.*weight_quantizer")))
    model, _ = build_tiny()
    config = quantization.resolve(str(experts_only), [])
    assert config["algorithm"] == "max"
    with pytest.raises(UserInputError) as caught:
        quantization.quantize(model, config, [], on_gpu=False, pipeline_or_context_parallel=False)
    (line,) = caught.value.problems
    assert line.startswith("policy.quant_cfg: ")


def test_an_unknown_config_name_lists_modelopts():
    with pytest.raises(UserInputError, match="NVFP4_DEFAULT_CFG"):
        quantization.resolve("NVFP4_NOT_A_CFG", [])


def _quantized_worker(policy: dict, calibration: list[list[list[int]]]):
    worker = worker_ranks.single_worker(policy)
    worker.quantize(policy["quant_cfg"], calibration)
    return worker


def test_a_quantized_policy_resumes_with_its_ranges_and_trains_bitwise(megatron_cpu, tmp_path):
    # NeMo-RL's exemplars' optimizer: distributed, parameters gathered in the next forward.
    exemplar = worker_ranks.section(
        optimizer={"use_distributed_optimizer": True},
        distributed_data_parallel_config={"overlap_param_gather": True},
    )
    policy = {**exemplar, "quant_cfg": CALIBRATED}
    trained = _quantized_worker(policy, [_ids(4).tolist()])
    plain = worker_ranks.single_worker(exemplar)
    first = trained.train(worker_ranks.step_batches(1), worker_ranks.LOSS)
    assert first["loss"] != plain.train(worker_ranks.step_batches(1), worker_ranks.LOSS)["loss"]
    trained.train(worker_ranks.step_batches(2), worker_ranks.LOSS)
    trained.save_checkpoint(str(tmp_path / "ckpt"))
    # Calibrated on other data: only the checkpoint can give it the saved ranges.
    resumed = _quantized_worker(policy, [(_ids(5) * 0 + 7).tolist()])

    def ranges(worker) -> list[float]:
        return [
            float(m.amax)
            for n, m in worker._unwrapped().named_modules()
            if n.endswith("input_quantizer") and m.is_enabled
        ]

    assert ranges(resumed) != ranges(trained)
    assert resumed.load_checkpoint(str(tmp_path / "ckpt")) == 2
    assert ranges(resumed) == ranges(trained)
    for step in (3, 4):
        want = trained.train(worker_ranks.step_batches(step), worker_ranks.LOSS)
        got = resumed.train(worker_ranks.step_batches(step), worker_ranks.LOSS)
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), step
    for worker in (trained, resumed, plain):
        worker.close()


@pytest.mark.parametrize("rollouts_quantized", [False, True])
def test_rollouts_run_without_the_quantizers_unless_generation_asks(
    megatron_cpu, rollouts_quantized
):
    generation = {"quant_cfg": MLP_WEIGHTS if rollouts_quantized else None}
    policy = {**worker_ranks.section(), "quant_cfg": MLP_WEIGHTS, "generation": generation}
    quantized = _quantized_worker(policy, [])
    plain = worker_ranks.single_worker(worker_ranks.section())
    settings = SamplingSettings(max_new_tokens=6, greedy=True)
    prompts = [[5, 9, 11, 3]]
    (got,) = quantized.generate(prompts, settings, seed=0, pad_id=0)
    (want,) = plain.generate(prompts, settings, seed=0, pad_id=0)
    assert (got.logprobs == want.logprobs) is not rollouts_quantized
    assert quantization.enabled_quantizers(quantized._unwrapped())  # on again for training
    for worker in (quantized, plain):
        worker.close()


def _export(step_dir, out, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemo_rl_offload.cli", "export-hf", "--config",
         str(REPO / "examples" / "configs" / "tiny" / "sft.yaml"),
         "--checkpoint", str(step_dir), "--out", str(out), *overrides],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_a_quantized_checkpoint_exports_its_trained_weights_and_starts_no_other_run(
    megatron_cpu, tmp_path
):
    from safetensors.torch import load_file

    from nemo_rl_offload.algorithms.common import _not_quantized

    policy = {**worker_ranks.section(), "quant_cfg": CALIBRATED}
    quantized = _quantized_worker(policy, [_ids(4).tolist()])
    quantized.train(worker_ranks.step_batches(1), worker_ranks.LOSS)
    quantized.save_checkpoint(str(tmp_path / "q" / "step_000001" / "policy"))
    # The same weights in a plain model's checkpoint: what the export must give.
    plain = worker_ranks.single_worker(worker_ranks.section())
    weights = {
        k: v
        for k, v in quantized._unwrapped().state_dict().items()
        if "_quantizer." not in k and "_extra_state" not in k
    }
    plain._unwrapped().load_state_dict(weights, strict=False)
    plain.save_checkpoint(str(tmp_path / "p" / "step_000001" / "policy"))
    for worker in (quantized, plain):
        worker.close()
    for run in ("q", "p"):
        (tmp_path / run / "step_000001" / "state.json").write_text('{"step": 1, "position": 0}')

    refused = _export(tmp_path / "q", tmp_path / "hf_refused")
    assert refused.returncode != 0 and "written by a quantization-aware run" in refused.stderr
    done = _export(tmp_path / "q", tmp_path / "hf_q", f"++policy.quant_cfg={CALIBRATED}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _export(tmp_path / "p", tmp_path / "hf_p").returncode == 0
    got, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf_q", "hf_p"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(UserInputError, match="export them with nemo-rl-offload export-hf"):
        _not_quantized(tmp_path / "q" / "step_000001" / "policy", "policy.init_checkpoint")
    _not_quantized(tmp_path / "p" / "step_000001" / "policy", "policy.init_checkpoint")
