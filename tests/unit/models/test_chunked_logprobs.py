"""``policy.logprob_chunk_size``: label log-probabilities and teacher top-k scores taken in
chunks of the sequence equal the unchunked ones (values and gradients, float32 on CPU)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_offload.models import chunked_logprobs
from nemo_rl_offload.policy.train_step import run_microbatches


def _logits_and_labels(seq=13, batch=3, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(seq, batch, vocab, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    return logits, labels


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
def test_chunked_label_loss_equals_megatrons_cross_entropy(megatron_cpu, chunk):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, labels = _logits_and_labels()
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    # Megatron's cross entropy shifts float32 logits in place: give it a copy.
    expected = vocab_parallel_cross_entropy(logits.clone(), labels.t().contiguous()).t()
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    loss = chunked_logprobs.chunked_label_loss(labels, logits, chunk)
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
    assert loss.shape == labels.shape and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_the_gradient_is_written_over_the_logits_and_equals_a_separate_one(megatron_cpu):
    """The backward writes the gradient over the kept logits (no second buffer) when they are
    an intermediate; a caller's own leaf is left as it is; both gradients are the same bits."""
    logits, labels = _logits_and_labels()
    leaf = logits.detach().to(torch.bfloat16).requires_grad_()
    before = leaf.detach().clone()
    (separate,) = torch.autograd.grad(
        chunked_logprobs.chunked_label_loss(labels, leaf, 4).sum(), leaf
    )
    assert torch.equal(leaf.detach(), before)  # the caller's tensor is untouched
    intermediate = leaf * 1
    seen: list[torch.Tensor] = []
    intermediate.register_hook(seen.append)
    chunked_logprobs.chunked_label_loss(labels, intermediate, 4).sum().backward()
    (written,) = seen
    assert written.data_ptr() == intermediate.data_ptr()
    assert torch.equal(written, separate)


def test_another_node_that_saved_the_logits_fails_loudly(megatron_cpu):
    """Should anything else keep the same logits for its backward, the in-place gradient
    makes its backward fail on the version counter instead of reading a gradient."""
    logits, labels = _logits_and_labels()
    intermediate = logits * 1
    other = (intermediate * intermediate).sum()  # saves the logits for its backward
    loss = chunked_logprobs.chunked_label_loss(labels, intermediate, 4).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


def test_half_precision_logits_get_float32_log_probabilities(megatron_cpu):
    logits, labels = _logits_and_labels()
    half = logits.detach().to(torch.bfloat16).requires_grad_()
    loss = chunked_logprobs.chunked_label_loss(labels, half, 5)
    reference = torch.nn.functional.cross_entropy(
        half.float().permute(1, 2, 0), labels, reduction="none"
    )
    torch.testing.assert_close(loss, reference, atol=1e-4, rtol=1e-4)
    (grad,) = torch.autograd.grad(loss.sum(), half)
    assert grad.dtype == torch.bfloat16


def _token_loss(batch, output):
    mask = batch["loss_mask"]
    return (output * mask).sum(), mask.sum(), {}


def test_a_model_with_chunked_log_probabilities_trains_as_without(build_tiny):
    model, _ = build_tiny()
    g = torch.Generator().manual_seed(2)
    batches = [
        {
            "input_ids": torch.randint(1, 384, (2, 24), generator=g),
            "labels": torch.randint(1, 384, (2, 24), generator=g),
            "loss_mask": (torch.rand(2, 24, generator=g) > 0.3).float(),
        }
        for _ in range(2)
    ]

    def step() -> tuple[list[float], list[torch.Tensor]]:
        for p in model.parameters():
            p.grad = None
        reports = run_microbatches(model, batches, _token_loss, forward_only=False)
        return [float(r["loss"]) for r in reports], [p.grad.clone() for p in model.parameters()]

    losses, grads = step()
    chunked_logprobs.install(model, 5)
    assert model.compute_language_model_loss.__func__ is not type(model).compute_language_model_loss
    chunked_losses, chunked_grads = step()
    assert chunked_losses == pytest.approx(losses, rel=1e-5)
    for grad, ref in zip(chunked_grads, grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-6, rtol=1e-4)


def test_install_without_a_chunk_size_leaves_the_model_alone(build_tiny):
    model, _ = build_tiny()
    chunked_logprobs.install(model, None)
    assert "compute_language_model_loss" not in vars(model)


@pytest.mark.parametrize("k", [None, 4])
def test_chunked_top_k_equals_the_whole_log_softmax(k):
    logits = 3 * torch.randn(2, 11, 40, generator=torch.Generator().manual_seed(4))
    full = torch.log_softmax(logits.float(), dim=-1)
    out = chunked_logprobs.topk_logprobs(logits, k, 3)
    if k is None:
        torch.testing.assert_close(out["values"], full)
        assert "indices" not in out
    else:
        values, indices = full.topk(k, dim=-1)
        torch.testing.assert_close(out["values"], values)
        assert torch.equal(out["indices"], indices)
    assert chunked_logprobs.topk_logprobs(logits, k, None)["values"].shape == out["values"].shape


@pytest.mark.parametrize("chunk", [0, -3, 2.5, "big"])
def test_validate_refuses_a_chunk_size_that_is_not_a_positive_integer(chunk):
    from support.policies import make_policy

    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.offload.capabilities import detect
    from nemo_rl_offload.preflight import check_policy

    policy = {**make_policy(), "logprob_chunk_size": chunk}
    findings = check_policy(
        policy, where="policy", architecture=architecture_for("tiny-dense"), caps=detect()
    )
    assert [e for e in findings.errors if e.startswith("policy.logprob_chunk_size: must be")]
    policy["logprob_chunk_size"] = 1024
    findings = check_policy(
        policy, where="policy", architecture=architecture_for("tiny-dense"), caps=detect()
    )
    assert not [e for e in findings.errors if "logprob_chunk_size" in e]


@pytest.mark.parametrize("chunk", [None, 1024])
def test_validate_refuses_the_chunked_output_layer_with_a_deferred_embedding_gradient(chunk):
    from support.policies import make_policy

    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.offload.capabilities import detect
    from nemo_rl_offload.preflight import check_policy

    policy = {
        **make_policy(
            model_overrides={"defer_embedding_wgrad_compute": True}, chunked_output_layer=True
        ),
        "logprob_chunk_size": chunk,
    }
    findings = check_policy(
        policy, where="policy", architecture=architecture_for("tiny-dense"), caps=detect()
    )
    refused = [e for e in findings.errors if "defer_embedding_wgrad_compute (the chunked" in e]
    assert len(refused) == (1 if chunk else 0), findings.errors
    # The log-softmax alone in chunks runs the output layer once: no conflict.
    policy["megatron_cfg"]["chunked_output_layer"] = False
    findings = check_policy(
        policy, where="policy", architecture=architecture_for("tiny-dense"), caps=detect()
    )
    assert not [e for e in findings.errors if "defer_embedding_wgrad_compute" in e]


@pytest.mark.parametrize(
    ("value", "chunk", "expected"),
    [
        ("yes", 1024, "chunked_output_layer: must be true or false"),
        (True, None, "chunked_output_layer: has no effect without policy.logprob_chunk_size"),
        (True, 1024, None),
        (False, None, None),
    ],
)
def test_validate_checks_the_chunked_output_layer_switch(value, chunk, expected):
    from support.policies import make_policy

    from nemo_rl_offload.config.model_presets import architecture_for
    from nemo_rl_offload.offload.capabilities import detect
    from nemo_rl_offload.preflight import check_policy

    policy = {**make_policy(chunked_output_layer=value), "logprob_chunk_size": chunk}
    findings = check_policy(
        policy, where="policy", architecture=architecture_for("tiny-dense"), caps=detect()
    )
    said = [line for line in [*findings.errors, *findings.warnings] if "chunked_output" in line]
    assert said == ([] if expected is None else [s for s in said if expected in s]) and (
        expected is None or len(said) == 1
    ), said


# The output layer in chunks (ChunkedOutputLogprobs, handed to GPTModel.forward by
# forward_kwargs): a length the chunk size does not divide.
LENGTH, CHUNK = 23, 5


def _ids_and_labels(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 384, (2, LENGTH), generator=g)
    labels = torch.randint(1, 384, (2, LENGTH), generator=g)
    return ids, labels, torch.arange(LENGTH).unsqueeze(0).expand(2, LENGTH)


def _loss_and_grads(model, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    weights = torch.rand(2, LENGTH, generator=torch.Generator().manual_seed(6))
    model.zero_grad(set_to_none=True)
    loss = forward()
    (loss * weights).sum().backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_chunked_output_layer_equals_the_plain_path(build_tiny, temperature):
    """Per-token losses and every parameter's gradient (the output layer's included) equal
    those of the plain path's logits, divided by the temperature, and their log-softmax."""
    model, _ = build_tiny()
    ids, labels, positions = _ids_and_labels()

    def plain() -> torch.Tensor:
        logits = model(ids, positions, None).float() / temperature  # [b, s, v]
        logprobs = torch.log_softmax(logits, dim=-1)
        return -logprobs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    expected, expected_grads = _loss_and_grads(model, plain)
    assert chunked_logprobs.forward_kwargs(model, True) == {}  # nothing installed yet
    chunked_logprobs.install(model, CHUNK, temperature, chunked_output_layer=True)
    assert chunked_logprobs.forward_kwargs(model, False) == {}  # no labels: the logits
    kwargs = chunked_logprobs.forward_kwargs(model, True)
    assert isinstance(kwargs["output_processor"], chunked_logprobs.ChunkedOutputLogprobs)
    loss, grads = _loss_and_grads(
        model, lambda: model(ids, positions, None, labels=labels, **kwargs)
    )
    assert loss.shape == labels.shape and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert "output_layer.weight" in grads and grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    with torch.no_grad():  # forward-only passes: the same chunks, without checkpoints
        torch.testing.assert_close(model(ids, positions, None, labels=labels, **kwargs), loss)


def _saved_shapes(forward) -> list[tuple[int, ...]]:
    """The shapes of the tensors autograd saves during ``forward()`` for the backward."""
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward().sum().backward()
    return shapes


def test_the_chunked_output_layer_keeps_no_logits_for_the_backward(build_tiny):
    """Plain, the loss keeps tensors over the vocabulary (the logits' softmax) for the
    backward; chunked, only the final hidden states and the labels: each chunk's logits are
    recomputed in the backward."""
    model, _ = build_tiny()
    vocab = model.output_layer.weight.shape[0]
    ids, labels, positions = _ids_and_labels()
    plain = _saved_shapes(lambda: model(ids, positions, None, labels=labels))
    assert [s for s in plain if s[-1] == vocab]
    chunked_logprobs.install(model, CHUNK, chunked_output_layer=True)
    kwargs = chunked_logprobs.forward_kwargs(model, True)
    chunked = _saved_shapes(lambda: model(ids, positions, None, labels=labels, **kwargs))
    assert chunked and not [s for s in chunked if s[-1] == vocab]
    # ... and without the processor, the installed chunked log-softmax keeps the logits.
    loss_only = _saved_shapes(lambda: model(ids, positions, None, labels=labels))
    assert [s for s in loss_only if s[-1] == vocab]


def _saved_over_the_vocabulary(forward, vocab: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape[-1] == vocab:
            saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward().sum().backward()
    return saved


def test_the_chunked_log_softmax_keeps_the_logits_in_their_precision_and_nothing_else(
    build_tiny,
):
    """NeMo-RL's meaning of logprob_chunk_size (no chunked output layer): the loss keeps the
    half-precision logits alone over the vocabulary, where Megatron's cross entropy keeps a
    float32 softmax; the output layer is not given a processor, and the losses and every
    gradient equal the plain path's."""
    from megatron.core.transformer.module import Float16Module

    model, _ = build_tiny()
    model.config.bf16 = True
    wrapped = Float16Module(model.config, model)
    vocab = model.output_layer.weight.shape[0]
    ids, labels, positions = _ids_and_labels()
    plain = _saved_over_the_vocabulary(lambda: wrapped(ids, positions, None, labels=labels), vocab)
    assert [dtype for _, dtype in plain] == [torch.float32]
    expected, expected_grads = _loss_and_grads(
        wrapped, lambda: wrapped(ids, positions, None, labels=labels)
    )
    chunked_logprobs.install(wrapped, CHUNK)
    assert chunked_logprobs.forward_kwargs(wrapped, True) == {}
    lean = _saved_over_the_vocabulary(lambda: wrapped(ids, positions, None, labels=labels), vocab)
    assert lean == [((LENGTH, 2, vocab), torch.bfloat16)]
    loss, grads = _loss_and_grads(wrapped, lambda: wrapped(ids, positions, None, labels=labels))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():  # bfloat16 gradients: rounded in another order
        reference = expected_grads[name].float()
        error = (grad.float() - reference).norm() / reference.norm()
        assert error < 1e-2, (name, float(error))


@pytest.fixture(scope="module")
def one_rank_passes(tmp_path_factory) -> tuple[dict, str]:
    """Every pass of one rank without chunking, from a checkpoint after one step."""
    from support.worker_ranks import load_then_every_pass, run_ranks, save_after_one_step, section

    out = tmp_path_factory.mktemp("one_rank")
    run_ranks(save_after_one_step, 1, out, policy=section())
    ckpt = str(out / "ckpt")
    (single,) = run_ranks(load_then_every_pass, 1, out / "single", policy=section(), ckpt=ckpt)
    return single, ckpt


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "chunked_output_layer": True},
        {"context_parallel_size": 2, "chunked_output_layer": True},
    ],
    ids=["tp2", "tp2_sp", "tp2_sp_output_layer", "cp2_output_layer"],
)
def test_chunked_log_probabilities_agree_on_two_ranks(one_rank_passes, layout, tmp_path):
    """Two gloo ranks of tensor parallelism (with and without sequence parallelism, where the
    sequence is padded to even lengths and each rank chunks its half) or of context
    parallelism (each rank chunks its share of the positions) with a chunk size, the output
    layer whole or in the chunks too: the label
    log-probabilities, a packed micro-batch's, one training step's loss, gradient norm and
    update agree with one rank's unchunked model."""
    import numpy as np
    from support.worker_ranks import load_then_every_pass, run_ranks, section

    single, ckpt = one_rank_passes
    policy = {**section(**layout), "logprob_chunk_size": CHUNK}
    results = run_ranks(load_then_every_pass, 2, tmp_path, policy=policy, ckpt=ckpt)
    reporting = [result for result in results if result["reports"]]
    assert reporting
    for result in reporting:
        for key in ("logprobs", "packed_logprobs"):
            for got, expected in zip(result[key], single[key], strict=True):
                np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert result["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
        np.testing.assert_allclose(
            result["probe_after_step"], single["probe_after_step"], rtol=0, atol=2e-5
        )
