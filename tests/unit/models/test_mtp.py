"""Multi-token prediction (``policy.megatron_cfg.mtp_num_layers``): Megatron's MTP block is
built on the decoder's layer spec, trained by the policy's training step with the labels' mask,
weighted by ``mtp_loss_scaling_factor``, kept off the output weight by ``mtp_detach_heads``,
reported per depth, checkpointed, and left out of generation (CPU, float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import worker_ranks
from support.worker_ranks import section

from nemo_rl_offload.config.generation_settings import SamplingSettings
from nemo_rl_offload.models import mtp
from nemo_rl_offload.policy.train_step import run_microbatches


def _batches(mask_from: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(2):
        ids = torch.randint(1, 384, (2, 24), generator=g)
        mask = torch.zeros(2, 24)
        mask[:, mask_from:] = 1.0
        batches.append({"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": mask})
    return batches


def _token_loss(batch, output):
    mask = batch["loss_mask"]
    return (output * mask).sum(), mask.sum(), {}


def _step(model, batches) -> dict[str, torch.Tensor]:
    """One training pass: each parameter's gradient by name (the tracker zeroed first)."""
    model.zero_grad(set_to_none=True)
    mtp.start_step(model, torch.device("cpu"))
    run_microbatches(model, batches, _token_loss, forward_only=False)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_block_has_a_layer_per_depth_or_one_repeated(build_tiny):
    model, warnings = build_tiny(mtp_num_layers=2)
    assert not warnings and len(model.mtp.layers) == 2
    repeated, _ = build_tiny(mtp_num_layers=3, mtp_use_repeated_layer=True)
    assert len(repeated.mtp.layers) == 1
    plain, _ = build_tiny(mtp_num_layers=0)  # NeMo-RL's "off"
    assert not hasattr(plain, "mtp") and plain.config.mtp_num_layers is None


def test_the_mtp_loss_trains_the_block_and_weighs_by_its_scale(build_tiny):
    batches = _batches()
    weighted, _ = build_tiny(seed=4, mtp_num_layers=1, mtp_loss_scaling_factor=0.5)
    unweighted, _ = build_tiny(seed=4, mtp_num_layers=1, mtp_loss_scaling_factor=0.0)
    plain, _ = build_tiny(seed=4)
    plain.load_state_dict(
        {k: v for k, v in unweighted.state_dict().items() if not k.startswith("mtp.")},
        strict=False,
    )
    with_mtp, without_mtp, alone = (
        _step(weighted, batches),
        _step(unweighted, batches),
        _step(plain, batches),
    )
    block = [n for n in with_mtp if n.startswith("mtp.")]
    assert block and all(with_mtp[n].abs().sum() > 0 for n in block)
    # At weight 0 the decoder trains exactly as without MTP; at 0.5 the MTP loss reaches it.
    shared = [n for n in alone if "decoder" in n]
    for name in shared:
        torch.testing.assert_close(without_mtp[name], alone[name], rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(with_mtp[n], alone[n]) for n in shared)


@pytest.mark.parametrize("detach", [True, False])
def test_detached_heads_keep_the_mtp_loss_off_the_output_weight(build_tiny, detach):
    batches = _batches()
    grads = [
        _step(
            build_tiny(
                seed=5, mtp_num_layers=1, mtp_loss_scaling_factor=scale, mtp_detach_heads=detach
            )[0],
            batches,
        )
        for scale in (0.0, 1.0)
    ]
    name = "output_layer.weight"
    assert torch.allclose(grads[0][name], grads[1][name]) == detach


def test_the_labels_mask_is_the_mtp_mask(build_tiny):
    """Depth 1 at position i predicts label i + 1, counted where the mask counts label i + 1:
    the mask's ones moved one position earlier (here positions 9..22 of each row)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model, _ = build_tiny(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    _step(model, _batches(mask_from=10))
    counted = float(MTPLossLoggingHelper.tracker["total_values"][0])
    assert counted == 2 * 2 * (24 - 10)  # 2 micro-batches x 2 rows
    metrics = mtp.step_metrics(model, microbatches=2)
    assert set(metrics) == {"mtp_1_loss", "mtp_1_acceptance_rate"}
    assert metrics["mtp_1_loss"] > 0 and 0 <= metrics["mtp_1_acceptance_rate"] <= 100
    assert MTPLossLoggingHelper.tracker == {}  # read once


def test_without_labels_the_mask_counts_the_same_positions(build_tiny):
    """A forward without labels (the distillation student's: the loss takes the logits) makes
    Megatron derive the labels from the input ids; the mask then counts the same positions,
    less the last label, which that derivation makes up."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model, _ = build_tiny(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    batches = [{k: v for k, v in b.items() if k != "labels"} for b in _batches(mask_from=10)]

    def logits_loss(batch, output):
        return output.float().mean() * 0, batch["loss_mask"].sum(), {}

    mtp.start_step(model, torch.device("cpu"))
    run_microbatches(model, batches, logits_loss, forward_only=False)
    counted = float(MTPLossLoggingHelper.tracker["total_values"][0])
    assert counted == 2 * 2 * (24 - 10 - 1)
    mtp.step_metrics(model, microbatches=2)


def test_a_worker_reports_mtp_resumes_exactly_and_generates(megatron_cpu, tmp_path):
    policy = section(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    trained = worker_ranks.single_worker(policy)
    metrics = trained.train(worker_ranks.step_batches(1), worker_ranks.LOSS)
    assert {"mtp_1_loss", "mtp_2_loss", "mtp_2_acceptance_rate"} <= set(metrics)
    assert np.isfinite([metrics["mtp_1_loss"], metrics["mtp_2_loss"]]).all()
    # Whatever the tracker holds before a step (a forward-only pass's values) is not counted.
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    trained.token_logprobs(worker_ranks.step_batches(9, 1))
    MTPLossLoggingHelper.tracker = {key: torch.full((2,), 1e6) for key in mtp.TRACKED}
    again = trained.train(worker_ranks.step_batches(1), worker_ranks.LOSS)
    assert again["mtp_1_loss"] < 100 and again["mtp_1_acceptance_rate"] <= 100
    # The MTP block is in the checkpoint: a resumed run continues exactly.
    resumed = worker_ranks.resumes_exactly(trained, policy, tmp_path / "ckpt", (3, 4))
    # Generation runs the decoder alone (models.cached_forward): MTP takes no part.
    (generated,) = resumed.generate(
        [[1, 2, 3]], SamplingSettings(max_new_tokens=4, greedy=True), seed=0, pad_id=0
    )
    assert len(generated.ids) == 4
    for made in (trained, resumed):
        made.close()


def test_a_teachers_mtp_keys_build_no_block():
    from support.policies import make_policy

    from nemo_rl_offload.config import megatron_settings
    from nemo_rl_offload.config.model_presets import architecture_for

    cfg = {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3}
    settings = {
        where: megatron_settings.effective_settings(
            make_policy(**cfg), architecture_for("tiny-dense"), where=where, te_installed=False
        )
        for where in ("policy", "teacher")
    }
    assert settings["policy"].value("mtp_num_layers") == 2
    assert settings["teacher"].value("mtp_num_layers") is None


def test_the_sampling_temperature_tempers_the_policys_loss_not_the_mtp_losses(build_tiny):
    """GRPO's log-probabilities are those of logits / temperature (chunked_logprobs.install);
    Megatron's MTP losses stay on the logits as they are, as in NeMo-RL."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from nemo_rl_offload.models import chunked_logprobs

    def losses(temperature: float, chunk: int | None) -> tuple[list[float], float]:
        model, _ = build_tiny(seed=6, mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
        chunked_logprobs.install(model, chunk, temperature)
        mtp.start_step(model, torch.device("cpu"))
        reports = run_microbatches(model, _batches(), _token_loss, forward_only=False)
        return [float(r["loss"]) for r in reports], float(
            MTPLossLoggingHelper.tracker["loss_values"][0]
        )

    plain, plain_mtp = losses(1.0, None)
    for chunk in (None, 7):
        tempered, tempered_mtp = losses(2.0, chunk)
        assert tempered != pytest.approx(plain, rel=1e-3)
        assert tempered_mtp == pytest.approx(plain_mtp, rel=1e-6)
    # The main loss is that of logits / 2: the model without MTP at temperature 2 agrees.
    model, _ = build_tiny(seed=6, mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    with torch.no_grad():
        batch = _batches()[0]
        logits = model(batch["input_ids"], torch.arange(24)[None].expand(2, 24), None)
    expected = -torch.log_softmax(logits.float() / 2, -1).gather(-1, batch["labels"][..., None])
    assert float((expected[..., 0] * batch["loss_mask"]).sum()) == pytest.approx(
        tempered[0], rel=1e-5
    )


@pytest.mark.parametrize(
    "recipe,overrides,refused",
    [
        ("dpo", [], True),
        ("grpo", ["++loss_fn.token_level_loss=false"], True),
        ("grpo", [], False),
        ("sft", [], False),
        ("distillation", [], False),
    ],
    ids=["dpo", "grpo_sequence_level", "grpo", "sft", "distillation"],
)
def test_mtp_is_refused_beside_losses_averaged_over_sequences(recipe, overrides, refused):
    """The step divides every gradient by the loss's count; Megatron's MTP losses are summed
    per token, which is right only where that count is tokens."""
    from pathlib import Path

    from nemo_rl_offload.preflight import load_and_check

    tiny = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny"
    report = load_and_check(
        str(tiny / f"{recipe}.yaml"), ["++policy.megatron_cfg.mtp_num_layers=1", *overrides]
    )
    lines = [e for e in report.errors if "multi-token prediction is not implemented yet" in e]
    assert bool(lines) == refused, report.errors
