"""One forward(-backward) pass over a step's micro-batches, through Megatron-core's schedules.

:func:`run_microbatches` hands the micro-batches to Megatron's schedule, so pipelining, MoE
losses and CUDA graphs behave as upstream. Every algorithm's loss goes through one contract,
``loss_fn(batch, output) -> (loss, num_tokens, metrics)`` with ``loss`` a token sum, and the
step divides once by its token count. The contract, and the padding and gathering under
sequence and context parallelism: docs/training.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from nemo_rl_offload.models import chunked_logprobs, context_parallel
from nemo_rl_offload.models.step_feature import FeatureInput
from nemo_rl_offload.policy.step_features import STEP_FEATURES, forward_keys
from nemo_rl_offload.progress import Progress

LossFn = Callable[[dict[str, Tensor], Tensor], tuple[Tensor, Tensor | int, dict[str, Tensor]]]


def _default_position_ids(input_ids: Tensor) -> Tensor:
    batch, seq = input_ids.shape
    return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)


def packed_seq_params(batch: dict[str, Tensor]) -> Any:
    """Megatron's ``PackedSeqParams`` (THD) for a packed micro-batch (one row holding several
    sequences, ``cu_seqlens`` the offsets where each starts, the pack's end last), else None.
    The attention keeps tokens within their sequence and RoPE restarts at each offset."""
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = cu_seqlens.to(torch.int32)
    # A host int: the longest segment (RoPE's table size; the flash kernel's bound).
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def sequence_multiple(config: Any) -> int:
    """What the model's sequence length must be a multiple of: the tensor-parallel size under
    sequence parallelism (each rank holds an equal slice of the sequence between the layers'
    gathers and scatters), else 1."""
    if getattr(config, "sequence_parallel", False):
        return max(1, int(config.tensor_model_parallel_size))
    return 1


def _padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def _feature_inputs(model: Any, batch: dict[str, Tensor]) -> dict[str, FeatureInput]:
    """Every registered feature's per-position inputs for ``batch`` (docs/architecture.md)."""
    found: dict[str, FeatureInput] = {}
    for feature in STEP_FEATURES:
        found.update(feature.inputs(model, batch))
    return found


def _grown(value: Tensor, rows: int, length: int, fill: int | float) -> Tensor:
    """``value`` ([rows', length', ...]) padded with ``fill`` to [rows, length, ...]."""
    grown = value.new_full((rows, length, *value.shape[2:]), fill)
    grown[: value.shape[0], : value.shape[1]] = value
    return grown


@contextlib.contextmanager
def _features_forward(
    model: Any, inputs: dict[str, Tensor], kwargs: dict[str, Any], *, training: bool
) -> Iterator[None]:
    """Each registered feature's keyword arguments added to ``kwargs`` and its context around
    the model's call; ``inputs``: the features' inputs as this rank feeds them."""
    with contextlib.ExitStack() as stack:
        for feature in STEP_FEATURES:
            extra, context = feature.forward(model, inputs, training=training)
            kwargs.update(extra)
            stack.enter_context(context)
        yield


def _forward_step(
    loss_fn: LossFn,
    multiple: int,
    local_outputs: bool,
    cp_length: int | None,
    training: bool,
    data_iterator: Iterator[dict[str, Tensor]],
    model: Any,
):
    """Megatron's forward_step_func: run one micro-batch, return its output and reducer.

    The model sees the micro-batch right-padded to a multiple of ``multiple`` (see
    :func:`sequence_multiple`); the reducer crops the output back to the micro-batch's own
    length, so the padding is invisible to ``loss_fn`` (causal attention: padding on the
    right cannot change a real position's output)."""
    batch = next(data_iterator)
    rows, length = batch["input_ids"].shape
    cp, cp_rank = context_parallel.cp_world()
    if cp > 1:
        return _forward_step_cp(
            loss_fn, multiple, local_outputs, cp_length, training, batch, model, (cp, cp_rank)
        )
    inputs = batch
    features = {key: given.value for key, given in _feature_inputs(model, batch).items()}
    if length % multiple:
        if batch.get("attention_mask") is not None:
            raise ValueError(
                "run_microbatches: a micro-batch with an attention_mask cannot be padded to a "
                f"multiple of {multiple} (sequence parallelism); pad it before"
            )
        padded = _padded_length(length, multiple)
        inputs = _pad_to(batch, rows, padded, model)
        features = {key: inputs[key] for key in features}
    position_ids = inputs.get("position_ids")
    if position_ids is None:
        position_ids = _default_position_ids(inputs["input_ids"])
    packed = packed_seq_params(inputs)
    kwargs = {} if packed is None else {"packed_seq_params": packed}
    # policy.logprob_chunk_size: the output layer in chunks (chunked_logprobs.install).
    kwargs.update(chunked_logprobs.forward_kwargs(model, inputs.get("labels") is not None))
    with _features_forward(model, features, kwargs, training=training):
        output = model(
            inputs["input_ids"],
            position_ids,
            batch.get("attention_mask"),
            labels=inputs.get("labels"),
            **kwargs,
        )
    return output, functools.partial(_reduce, loss_fn, batch)


def _forward_step_cp(
    loss_fn: LossFn,
    multiple: int,
    local_outputs: bool,
    cp_length: int | None,
    training: bool,
    batch: dict[str, Tensor],
    model: Any,
    cp_world: tuple[int, int],
):
    """:func:`_forward_step` under context parallelism (docs/training.md): the model runs
    this CP rank's positions of the padded layout; the reducer gathers them back.
    ``cp_length``: the padded length every micro-batch takes (pipeline stages exchange one
    shape), else None."""
    cp, cp_rank = cp_world
    if batch.get("attention_mask") is not None:
        raise ValueError(
            "run_microbatches: a micro-batch with an attention_mask cannot be split over "
            "context-parallel ranks (causal attention only)"
        )
    length = batch["input_ids"].shape[1]
    layout = context_parallel.split_layout(
        length, batch.get("cu_seqlens"), cp, cp * multiple, at_least=cp_length
    )
    positions = batch.get("position_ids")
    if positions is None:
        positions = _default_position_ids(batch["input_ids"])
    local = {
        key: context_parallel.to_local(batch[key], layout, cp, cp_rank)
        for key in ("input_ids", "labels")
        if key in batch
    }
    features = {
        key: context_parallel.to_local(given.value, layout, cp, cp_rank, fill=given.fill)
        for key, given in _feature_inputs(model, batch).items()
    }
    position_ids = context_parallel.to_local(positions, layout, cp, cp_rank)
    kwargs = {}
    if layout.packed:
        kwargs["packed_seq_params"] = packed_seq_params(
            {"cu_seqlens": layout.padded_cu_seqlens.to(batch["input_ids"].device)}
        )
    labels = local.get("labels")
    kwargs.update(chunked_logprobs.forward_kwargs(model, labels is not None))
    with _features_forward(model, features, kwargs, training=training):
        output = model(local["input_ids"], position_ids, None, labels=labels, **kwargs)
    return output, functools.partial(_reduce_cp, loss_fn, batch, layout, cp, local_outputs)


def _reduce_cp(
    loss_fn: LossFn,
    batch: dict[str, Tensor],
    layout: context_parallel.SplitLayout,
    cp: int,
    local_outputs: bool,
    output: Tensor,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """:func:`_reduce` under context parallelism: ``loss_fn`` on the gathered output (or, for
    ``local_outputs``, on this rank's positions, its results gathered); the token count from
    CP rank 0 only (docs/training.md)."""
    if local_outputs:
        loss, num_tokens, metrics = loss_fn(batch, output)
        metrics = {
            name: context_parallel.gather_to_full(value, layout, cp, with_grad=False)
            for name, value in metrics.items()
        }
    else:
        full = context_parallel.gather_to_full(output, layout, cp, with_grad=True)
        loss, num_tokens, metrics = loss_fn(batch, full)
    if context_parallel.cp_world()[1] != 0:
        num_tokens = 0
    return _reported(loss, num_tokens, metrics)


def _reduce(
    loss_fn: LossFn, batch: dict[str, Tensor], output: Tensor
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Megatron's loss_func: (summed loss, token count, what the caller gets back). It runs on
    the last pipeline stage, whose output is [rows, positions, ...]: positions the model saw
    beyond the micro-batch's length (padding for sequence parallelism) are cropped first."""
    output = output[:, : batch["input_ids"].shape[1]]
    return _reported(*loss_fn(batch, output))


def _reported(
    loss: Tensor, num_tokens: Tensor | int, metrics: dict[str, Tensor]
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """What Megatron's loss_func returns: the loss, its token count as an int32 tensor on the
    loss's device (Megatron adds it into such a counter), and what the caller gets back."""
    num_tokens = torch.as_tensor(num_tokens, device=loss.device).to(torch.int)
    report = {name: value.detach() for name, value in metrics.items()}
    report["loss"] = loss.detach()
    report["num_tokens"] = num_tokens.detach().clone()
    return loss, num_tokens, report


def _divide_bare_model_grads(
    models: list[torch.nn.Module], num_tokens: Tensor | None, **_: Any
) -> None:
    """finalize_model_grads for a model without Megatron's DDP wrapper: the token count lives on
    the last pipeline stage, so it is broadcast there first; then gradients are divided by it."""
    if num_tokens is None:
        return
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            num_tokens,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    if parallel_state.get_context_parallel_world_size() > 1:
        # Each CP rank holds its tokens' share of the gradient (docs/training.md).
        group = parallel_state.get_context_parallel_group()
        torch.distributed.all_reduce(num_tokens, group=group)
        for model in models:
            for param in model.parameters():
                if param.grad is not None:
                    torch.distributed.all_reduce(param.grad, group=group)
    scale = 1.0 / torch.clamp(num_tokens, min=1)
    for model in models:
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(scale.to(param.grad.dtype))


@contextlib.contextmanager
def _bare_model_finalize(config: Any) -> Iterator[None]:
    if config.finalize_model_grads_func is not None:
        yield
        return
    config.finalize_model_grads_func = _divide_bare_model_grads
    try:
        yield
    finally:
        config.finalize_model_grads_func = None


def run_microbatches(
    model: torch.nn.Module,
    microbatches: list[dict[str, Tensor]],
    loss_fn: LossFn,
    *,
    forward_only: bool,
    local_outputs: bool = False,
    progress: Progress | None = None,
) -> list[dict[str, Tensor]]:
    """Forward (and, unless ``forward_only``, backward) over ``microbatches`` as one step.

    Each micro-batch is a dict with ``input_ids`` [b, s] and optionally ``position_ids``
    (default 0..s-1), ``attention_mask`` (default None: causal; right padding needs none),
    ``labels`` (ask the model for per-token losses), ``cu_seqlens`` (a packed micro-batch of
    one row: see :func:`packed_seq_params`) and anything ``loss_fn`` reads. Gradients
    accumulate into the parameters' existing gradients (zero them between steps), normalised
    per token over the step as docs/training.md says. Forward-only passes run under
    ``torch.no_grad()`` and leave gradients untouched.

    Returns one dict per micro-batch (on the last pipeline stage; other stages get []):
    ``metrics`` from ``loss_fn`` plus ``loss`` (the micro-batch's summed loss) and
    ``num_tokens``, all detached. ``local_outputs`` (forward-only, per-position metrics):
    under context parallelism ``loss_fn`` sees this rank's positions and its metrics are
    gathered, rather than seeing the gathered output (docs/training.md). ``progress``: told
    how many micro-batches are done as the schedule takes each next one (its caller started
    the phase and finishes it).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        raise ValueError("run_microbatches: no micro-batches")
    config = model.config
    if not config.calculate_per_token_loss:
        raise ValueError(
            "run_microbatches: the model's TransformerConfig needs calculate_per_token_loss=True "
            "(models.builder sets it): the loss is normalised per token over the whole step"
        )
    shape = tuple(microbatches[0]["input_ids"].shape)
    multiple = sequence_multiple(config)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and any(
        tuple(mb["input_ids"].shape) != shape for mb in microbatches
    ):
        raise ValueError(
            "run_microbatches: with pipeline parallelism every micro-batch needs the same "
            f"[batch, sequence] shape (the first is {list(shape)}); pad them to one length"
        )

    seq_length = _padded_length(shape[1], multiple)
    cp_length = None
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        seq_length = max(
            context_parallel.split_layout(
                mb["input_ids"].shape[1], mb.get("cu_seqlens"), cp, cp * multiple
            ).padded_length
            for mb in microbatches
        )
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # The stages exchange one shape: every micro-batch padded to the longest layout.
            cp_length = seq_length

    on_cpu = next(model.parameters()).device.type == "cpu"
    if on_cpu:
        from nemo_rl_offload.models.cpu_compat import cpu_schedule_allocations

        schedule_context: contextlib.AbstractContextManager[None] = cpu_schedule_allocations()
    else:
        schedule_context = contextlib.nullcontext()
    grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()

    data = iter(microbatches) if progress is None else _counted(microbatches, progress)
    with (
        schedule_context,
        grad_context,
        _bare_model_finalize(config),
        _features_after(model, microbatches),
    ):
        return get_forward_backward_func()(
            forward_step_func=functools.partial(
                _forward_step, loss_fn, multiple, local_outputs, cp_length, not forward_only
            ),
            data_iterator=data,
            model=[model],
            num_microbatches=len(microbatches),
            # What the stages exchange: the padded length (see _forward_step).
            seq_length=seq_length,
            micro_batch_size=shape[0],
            forward_only=forward_only,
        )


def _counted(microbatches: list[dict[str, Tensor]], progress: Progress) -> Iterator[dict]:
    """The micro-batches in order, ``progress`` told of those before each one the schedule
    takes (with pipeline stages, forwards started; one micro-batch at a time otherwise)."""
    for done, microbatch in enumerate(microbatches):
        progress.update(done)
        yield microbatch


@contextlib.contextmanager
def _features_after(model: Any, microbatches: list[dict[str, Tensor]]) -> Iterator[None]:
    """Each registered feature's :meth:`after_pass`, whether the pass raised or not."""
    try:
        yield
    finally:
        for feature in STEP_FEATURES:
            feature.after_pass(model, microbatches)


OutputFn = Callable[[dict[str, Tensor], Tensor], dict[str, Tensor]]
# The model's inputs: what a forward-only pass pads under pipeline parallelism.
_MODEL_INPUTS = ("input_ids", "labels", "position_ids")
# Every key of a micro-batch a forward reads (callers send these to the device, nothing else):
# the model's inputs, a packed micro-batch's segment offsets, and what the registered features'
# forwards read (e.g. the routes a policy.router_replay forward replays).
FORWARD_INPUTS = (*_MODEL_INPUTS, "cu_seqlens", *forward_keys())


def _pad_to(batch: dict[str, Tensor], rows: int, length: int, model: Any) -> dict[str, Tensor]:
    """``batch``'s model inputs padded with zeros to [rows, length] (on the right and below),
    and the registered features' inputs with their own fill; a packed batch's padding becomes
    one more segment of its own."""
    padded = {key: _grown(batch[key], rows, length, 0) for key in _MODEL_INPUTS if key in batch}
    for key, given in _feature_inputs(model, batch).items():
        padded[key] = _grown(given.value, rows, length, given.fill)
    if "cu_seqlens" in batch:
        cu_seqlens = batch["cu_seqlens"]
        if int(cu_seqlens[-1]) < length:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([length])])
        padded["cu_seqlens"] = cu_seqlens
    return padded


def forward_outputs(
    model: torch.nn.Module,
    microbatches: list[dict[str, Tensor]],
    output_fn: OutputFn,
    *,
    per_position: bool = True,
) -> list[dict[str, Tensor]]:
    """A forward-only pass over ``microbatches`` through Megatron's schedule: for each, what
    ``output_fn(batch, model_output)`` returns (a dict of tensors whose first dimension is the
    batch's rows, and, when ``per_position``, whose second is its positions). The model output
    is as in the loss contract: per-token losses when ``batch`` has ``labels``, else logits.

    Returns the outputs on the last pipeline stage ([] on the others); under pipeline
    parallelism they are computed on micro-batches padded to one shape and cropped back to
    each micro-batch's own. ``output_fn`` runs on every tensor-parallel rank of the last
    stage, so it may use tensor-parallel collectives (e.g. gathering the vocabulary).
    """
    from megatron.core import parallel_state

    shapes = [tuple(mb["input_ids"].shape) for mb in microbatches]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        rows = max(shape[0] for shape in shapes)
        length = max(shape[1] for shape in shapes)
        inputs = [_pad_to(mb, rows, length, model) for mb in microbatches]
    else:
        keys = FORWARD_INPUTS
        inputs = [{k: mb[k] for k in keys if k in mb} for mb in microbatches]

    def loss_fn(batch: dict[str, Tensor], output: Tensor):
        results = output_fn(batch, output)
        return output.new_zeros(()), 0, results

    reports = run_microbatches(
        model, inputs, loss_fn, forward_only=True, local_outputs=per_position
    )
    if not reports:  # not the last pipeline stage
        return []
    outputs = []
    for (rows, length), report in zip(shapes, reports, strict=True):
        outputs.append(
            {
                name: value[:rows, :length] if per_position else value[:rows]
                for name, value in report.items()
                if name not in ("loss", "num_tokens")
            }
        )
    return outputs
