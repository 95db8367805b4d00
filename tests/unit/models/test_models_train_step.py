"""run_microbatches: exact per-token gradient accumulation through Megatron's schedule on CPU,
forward-only collection, and tiny models that learn."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.policy.train_step import run_microbatches

SEQ = 32


def _batches(vocab: int, n: int, batch: int = 2, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Micro-batches with next-token labels and different loss masks (different token counts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (batch, SEQ), generator=g)
        mask = torch.ones(batch, SEQ)
        mask[:, SEQ - 4 * (i + 1) :] = 0  # right padding of growing length
        out.append({"input_ids": ids, "labels": torch.roll(ids, -1, dims=1), "loss_mask": mask})
    return out


def token_loss(batch, output):
    """Masked sum of -logprob(label) over the micro-batch, as the loss contract asks."""
    mask = batch["loss_mask"]
    loss = (output * mask).sum()
    return loss, mask.sum().to(torch.int), {"logprobs": -output}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradients_equal_one_backward_over_the_concatenated_batch(build_tiny):
    model, _ = build_tiny("tiny-dense")
    batches = _batches(model.vocab_size, 3)
    outputs = run_microbatches(model, batches, token_loss, forward_only=False)
    accumulated = _grads(model)
    model.zero_grad(set_to_none=True)

    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    mask = torch.cat([b["loss_mask"] for b in batches])
    pos = torch.arange(SEQ).expand(ids.shape[0], SEQ)
    per_token = model(ids, pos, None, labels=labels)
    ((per_token * mask).sum() / mask.sum()).backward()
    plain = _grads(model)

    assert accumulated.keys() == plain.keys() and len(plain) > 0
    for name, grad in plain.items():
        torch.testing.assert_close(accumulated[name], grad, atol=1e-6, rtol=0, msg=name)
    assert [int(o["num_tokens"]) for o in outputs] == [2 * (SEQ - 4), 2 * (SEQ - 8), 2 * (SEQ - 12)]


def test_forward_only_collects_outputs_and_leaves_no_grads(build_tiny):
    model, _ = build_tiny("tiny-dense")
    batches = _batches(model.vocab_size, 2, seed=1)
    outputs = run_microbatches(model, batches, token_loss, forward_only=True)
    assert all(p.grad is None for p in model.parameters())
    assert len(outputs) == 2
    for batch, out in zip(batches, outputs, strict=True):
        pos = torch.arange(SEQ).expand(2, SEQ)
        with torch.no_grad():
            expected = -model(batch["input_ids"], pos, None, labels=batch["labels"])
        assert not out["logprobs"].requires_grad
        torch.testing.assert_close(out["logprobs"], expected)
        torch.testing.assert_close(out["loss"], (-expected * batch["loss_mask"]).sum())
        assert int(out["num_tokens"]) == int(batch["loss_mask"].sum())


def test_without_labels_the_loss_sees_logits(build_tiny):
    model, _ = build_tiny("tiny-dense")
    seen = []

    def logits_loss(batch, output):
        seen.append(tuple(output.shape))
        return output.float().logsumexp(-1).sum(), output.shape[0] * output.shape[1], {}

    batch = {"input_ids": torch.randint(0, model.vocab_size, (2, 16))}
    run_microbatches(model, [batch], logits_loss, forward_only=True)
    assert seen == [(2, 16, model.vocab_size)]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_tiny_models_learn_a_fixed_batch(build_tiny, preset):
    model, _ = build_tiny(preset)
    batches = _batches(model.vocab_size, 2, seed=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        optimizer.zero_grad(set_to_none=True)
        outs = run_microbatches(model, batches, token_loss, forward_only=False)
        optimizer.step()
        losses.append(sum(float(o["loss"]) for o in outs) / sum(int(o["num_tokens"]) for o in outs))
    assert losses[-1] < losses[0] - 0.5, losses


def test_full_recompute_runs_on_cpu_with_the_same_gradients(build_tiny):
    plain, _ = build_tiny("tiny-dense", seed=5)
    recompute, _ = build_tiny("tiny-dense", seed=5, activation_checkpointing=True)
    assert recompute.config.recompute_granularity == "full"
    recompute.load_state_dict(plain.state_dict())
    batches = _batches(plain.vocab_size, 2, seed=3)
    run_microbatches(plain, batches, token_loss, forward_only=False)
    run_microbatches(recompute, batches, token_loss, forward_only=False)
    reference = _grads(plain)
    for name, grad in _grads(recompute).items():
        torch.testing.assert_close(grad, reference[name], atol=1e-6, rtol=0, msg=name)


def test_rejects_a_model_without_per_token_loss(build_tiny):
    model, _ = build_tiny("tiny-dense")
    model.config.calculate_per_token_loss = False
    with pytest.raises(ValueError, match="calculate_per_token_loss=True"):
        run_microbatches(model, _batches(model.vocab_size, 1), token_loss, forward_only=True)


def test_progress_is_told_the_micro_batches_done_as_the_schedule_takes_them(build_tiny):
    """What a worker's training phase reports (nemo_rl_offload.progress): before each
    micro-batch, how many are done; the caller finishes the phase."""

    class Recorder:
        def __init__(self) -> None:
            self.done: list[int] = []

        def update(self, done: int | None = None, **fields: object) -> None:
            self.done.append(done)

    model, _ = build_tiny("tiny-dense")
    progress = Recorder()
    run_microbatches(
        model, _batches(model.vocab_size, 3), token_loss, forward_only=False, progress=progress
    )
    assert progress.done == [0, 1, 2]
