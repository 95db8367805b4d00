"""One forward(-backward) pass over a step's micro-batches, through Megatron-core's schedules.

There is one code path: :func:`run_microbatches` hands the micro-batches to
``megatron.core.pipeline_parallel.get_forward_backward_func()``, the schedule Megatron picks for
the parallel state (no pipelining, 1F1B, interleaved), so pipeline parallelism, MoE auxiliary
losses and full-iteration CUDA graphs behave exactly as upstream. On CPU the same schedule runs
inside :func:`cpu_compat.cpu_schedule_allocations`, which only moves the schedule's one
``device="cuda"`` allocation (its token counter) to the CPU for the duration of the call.

The loss contract (every algorithm's loss goes through it):

``loss_fn(batch, output) -> (loss, num_tokens, metrics)`` where ``output`` is what GPTModel
returns for the micro-batch: when ``batch`` has ``"labels"``, the per-token loss [b, s], which
is minus the log-probability of each label (RL losses need token log-probs; asking the model for
them avoids materialising the logits a second time); otherwise the logits [b, s, vocab] (split
over the vocabulary across tensor-parallel ranks). ``loss`` is a scalar SUM over the tokens it
counts, ``num_tokens`` how many tokens that is, ``metrics`` any tensors to report.

Normalisation: the step's loss is the per-token mean over every counted token of every
micro-batch (over all data-parallel ranks when the model is wrapped in Megatron's DDP), which is
what SFT and GRPO's token-level loss need, and gradient accumulation is exact: each micro-batch
backpropagates its sum, and after the last one the gradients are divided by the step's total
token count. That is Megatron's per-token mode (``config.calculate_per_token_loss``, which
``models.builder`` turns on): the division happens in ``config.finalize_model_grads_func``. A
DDP-wrapped model brings Megatron's ``finalize_model_grads`` (all-reduce across data-parallel
ranks, then the division); for a bare model (single rank, tests) this module supplies a
function that only divides, for the duration of the call.

Forward-only passes (log-probabilities, the reference, a teacher's top-k, sampling) go through
the same schedule with :func:`forward_outputs`: pipeline stages exchange activations as in
training, and the last stage's outputs come back. With pipeline parallelism every micro-batch
of a step has one shape (the stages exchange fixed-size activations), so that function pads
the micro-batches to one shape and crops the outputs back (causal attention: padding on the
right of a row, or extra rows, cannot change a real position's output).

Under sequence parallelism each tensor-parallel rank holds an equal slice of the sequence
between the layers, so the model's sequence length must be a multiple of the tensor-parallel
size. Every pass (training, forward-only, sampling, packed micro-batches) meets that here, at
the model's input: :func:`_forward_step` pads the micro-batch on the right and the reducer
crops the output back before ``loss_fn`` sees it, so callers and recipe settings (padding
multiples, buckets, pack lengths) need not know about it.

Under context parallelism (CP) each CP rank runs its share of every sequence
(``models.context_parallel``: two of 2 * CP chunks, each sequence of a pack padded to a
multiple of 2 * CP, and to CP x TP under sequence parallelism). Micro-batches still arrive
whole, the same on every CP rank of a data-parallel rank: :func:`_forward_step` hands the model
this rank's positions, and the model's output is all-gathered back to the micro-batch's own
positions before ``loss_fn`` sees it, so losses (token sums, sequence sums, DPO pairs, packed
segments) are computed exactly as at CP 1, on every CP rank alike. The gather's backward keeps
each rank's own positions only, so the CP ranks' parameter gradients add up (Megatron's DDP
sums over the data-and-context-parallel group) to the gradient of that one loss; its token
count is reported by CP rank 0 alone, so the step still divides by each token once. Forward-only
passes that return per-position outputs apply ``output_fn`` to the rank's own positions and
gather its results instead (a teacher's top-k gathers k values per position, not the logits).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from nemo_rl_offload.models import chunked_logprobs, context_parallel, mtp, router_replay
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


def _mtp_loss_mask(model: Any, batch: dict[str, Tensor]) -> Tensor | None:
    """The ``loss_mask`` to give a model with multi-token prediction (``mtp_num_layers``),
    None without MTP or without a mask: the positions the algorithm's loss counts (this
    package's ``loss_mask``: NeMo-RL's token mask times its sample mask), so the MTP losses
    count no prompt or padding. Megatron rolls it with the labels for each MTP depth. The mask
    is aligned with the labels (position t counts token t + 1); a forward without labels (the
    distillation student's logits) makes Megatron derive them from the input ids and roll the
    mask with them once more, so there it gets each input position's mask."""
    if "loss_mask" not in batch or not mtp.depths(model):
        return None
    mask = batch["loss_mask"]
    if batch.get("labels") is None:
        mask = torch.cat([mask.new_zeros((mask.shape[0], 1)), mask[:, :-1]], dim=1)
    return mask


def _router_routes(batch: dict[str, Tensor], model: Any) -> Tensor | None:
    """The micro-batch's sampled routes (``policy.router_replay``) in the routers' token layout
    (:func:`models.router_replay.router_tokens`), None without routes; ``batch`` holds the
    positions the model is fed (padded, this context-parallel rank's)."""
    routes = batch.get(router_replay.ROUTES_KEY)
    if routes is None:
        return None
    from megatron.core import parallel_state

    slices = sequence_multiple(model.config)  # sequence parallelism's slices, else 1
    rank = parallel_state.get_tensor_model_parallel_rank() if slices > 1 else 0
    return router_replay.router_tokens(routes, rank, slices)


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
    if length % multiple:
        if batch.get("attention_mask") is not None:
            raise ValueError(
                "run_microbatches: a micro-batch with an attention_mask cannot be padded to a "
                f"multiple of {multiple} (sequence parallelism); pad it before"
            )
        inputs = _pad_to(batch, rows, _padded_length(length, multiple))
    position_ids = inputs.get("position_ids")
    if position_ids is None:
        position_ids = _default_position_ids(inputs["input_ids"])
    packed = packed_seq_params(inputs)
    kwargs = {} if packed is None else {"packed_seq_params": packed}
    # policy.logprob_chunk_size: the output layer in chunks (chunked_logprobs.install).
    kwargs.update(chunked_logprobs.forward_kwargs(model, inputs.get("labels") is not None))
    mtp_mask = _mtp_loss_mask(model, inputs)
    if mtp_mask is not None:
        kwargs["loss_mask"] = mtp_mask
    with router_replay.replaying(model, _router_routes(inputs, model), training=training):
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
    """:func:`_forward_step` under context parallelism (module docstring): the model runs
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
    if router_replay.ROUTES_KEY in batch:
        local[router_replay.ROUTES_KEY] = context_parallel.to_local(
            batch[router_replay.ROUTES_KEY], layout, cp, cp_rank, fill=router_replay.NO_ROUTE
        )
    position_ids = context_parallel.to_local(positions, layout, cp, cp_rank)
    kwargs = {}
    if layout.packed:
        kwargs["packed_seq_params"] = packed_seq_params(
            {"cu_seqlens": layout.padded_cu_seqlens.to(batch["input_ids"].device)}
        )
    labels = local.get("labels")
    kwargs.update(chunked_logprobs.forward_kwargs(model, labels is not None))
    mtp_mask = _mtp_loss_mask(model, batch)
    if mtp_mask is not None:
        kwargs["loss_mask"] = context_parallel.to_local(mtp_mask, layout, cp, cp_rank)
    with router_replay.replaying(model, _router_routes(local, model), training=training):
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
    CP rank 0 only (module docstring)."""
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
        # Each CP rank holds its tokens' share of the gradient (module docstring).
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
    per token over the step as the module docstring says. Forward-only passes run under
    ``torch.no_grad()`` and leave gradients untouched.

    Returns one dict per micro-batch (on the last pipeline stage; other stages get []):
    ``metrics`` from ``loss_fn`` plus ``loss`` (the micro-batch's summed loss) and
    ``num_tokens``, all detached. ``local_outputs`` (forward-only, per-position metrics):
    under context parallelism ``loss_fn`` sees this rank's positions and its metrics are
    gathered, rather than seeing the gathered output (module docstring). ``progress``: told
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

    replays = any(router_replay.ROUTES_KEY in mb for mb in microbatches)
    data = iter(microbatches) if progress is None else _counted(microbatches, progress)
    with (
        schedule_context,
        grad_context,
        _bare_model_finalize(config),
        _disarmed_after(model, replays),
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
def _disarmed_after(model: Any, replays: bool) -> Iterator[None]:
    """Routers keep no replayed routes beyond the pass (their backward replay list holds each
    training micro-batch's until a recompute takes it, and none does without recompute)."""
    try:
        yield
    finally:
        if replays:
            router_replay.disarm(model)


OutputFn = Callable[[dict[str, Tensor], Tensor], dict[str, Tensor]]
# The model's inputs: what a forward-only pass pads under pipeline parallelism.
_MODEL_INPUTS = ("input_ids", "labels", "position_ids")
# Inputs _pad_to treats on their own: a packed micro-batch's segment offsets (1-D) and the
# sampled routes a policy.router_replay forward replays ([rows, length, layers, k], padded with
# NO_ROUTE).
_PACKING_INPUTS = ("cu_seqlens", router_replay.ROUTES_KEY)
# Every key of a micro-batch a forward reads (callers send these to the device, nothing else).
FORWARD_INPUTS = _MODEL_INPUTS + _PACKING_INPUTS


def _pad_to(batch: dict[str, Tensor], rows: int, length: int) -> dict[str, Tensor]:
    """``batch``'s model inputs padded with zeros to [rows, length] (on the right and below);
    a packed batch's padding becomes one more segment of its own."""
    padded = {}
    for key in _MODEL_INPUTS:
        if key not in batch:
            continue
        value = batch[key]
        grown = value.new_zeros((rows, length))
        grown[: value.shape[0], : value.shape[1]] = value
        padded[key] = grown
    routes = batch.get(router_replay.ROUTES_KEY)
    if routes is not None:  # no route on padding: the router's own top-k
        padded[router_replay.ROUTES_KEY] = routes.new_full(
            (rows, length, *routes.shape[2:]), router_replay.NO_ROUTE
        )
        padded[router_replay.ROUTES_KEY][: routes.shape[0], : routes.shape[1]] = routes
    if "loss_mask" in batch:  # multi-token prediction's mask (_mtp_loss_mask): none on padding
        mask = batch["loss_mask"]
        padded["loss_mask"] = mask.new_zeros((rows, length))
        padded["loss_mask"][: mask.shape[0], : mask.shape[1]] = mask
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
        inputs = [_pad_to(mb, rows, length) for mb in microbatches]
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
