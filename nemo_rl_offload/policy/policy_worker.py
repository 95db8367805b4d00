"""The policy worker: one process holding one rank of a Megatron-core GPT model.

Usable in-process (tests) and as a Ray actor (``WorkerGroup``). Construction is cheap; the work
happens in :meth:`PolicyWorker.setup`, called on every rank of a group together, so that a
failure there reaches the driver as that rank's error. Order of setup matters: NUMA binding
first (before any host memory is allocated), then torch.distributed, Megatron's parallel state,
the model, its data-parallel wrapper and optimizer, and the offload runtime.

All tensors cross the process boundary as numpy arrays or lists; micro-batches are dicts of
arrays (``input_ids``, ``labels``, ``loss_mask`` and what the loss reads). Loss and metric
values come back as sums with their counts, so the driver can combine ranks exactly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_offload import known_warnings
from nemo_rl_offload.config.generation_settings import SamplingSettings
from nemo_rl_offload.config.policy_settings import PolicySettings
from nemo_rl_offload.config.router_replay import ROUTES_KEY
from nemo_rl_offload.progress import Progress

_LOG = logging.getLogger("nemo_rl_offload.worker")
OPTIMIZER_KEYS_FROM_RECIPE = (
    "optimizer",
    "lr",
    "min_lr",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "sgd_momentum",
    "use_distributed_optimizer",
    "use_precision_aware_optimizer",
    "clip_grad",
    "optimizer_cpu_offload",
    "optimizer_offload_fraction",
)


def weight_decay_overrides(opt_cfg: dict[str, Any]) -> dict[Any, Any] | None:
    """megatron-core's parameter-group overrides: None keeps its standard groups, which exempt
    biases and 1-D weights (norms) from weight decay; ``weight_decay_all_params`` gives every
    parameter the decay, as torch's AdamW over all parameters (NeMo-RL's DTensor backend) does."""
    return {} if opt_cfg.get("weight_decay_all_params") is True else None


def build_param_scheduler(
    optimizer: Any, opt_cfg: Mapping[str, Any], sched: Mapping[str, Any]
) -> Any:
    """megatron-core's OptimizerParamScheduler for a section's optimizer and scheduler settings:
    one function, so that the schedule a DTensor recipe is mapped onto can be tested against
    torch's schedulers exactly as the worker builds it."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr = float(opt_cfg["lr"])
    weight_decay = float(opt_cfg.get("weight_decay", 0.01))
    decay_steps = max(2, int(sched.get("lr_decay_iters") or 10**9))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=float(sched.get("lr_warmup_init", 0.0)),
        max_lr=lr,
        min_lr=float(opt_cfg.get("min_lr", lr)),
        lr_warmup_steps=min(int(sched.get("lr_warmup_iters", 0)), decay_steps - 1),
        lr_decay_steps=decay_steps,
        lr_decay_style=str(sched.get("lr_decay_style", "constant")),
        start_wd=float(sched.get("start_weight_decay", weight_decay)),
        end_wd=float(sched.get("end_weight_decay", weight_decay)),
        wd_incr_steps=decay_steps,
        wd_incr_style=str(sched.get("weight_decay_incr_style", "constant")),
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _use_deterministic_algorithms() -> None:
    """Megatron's deterministic_mode (model_overrides.deterministic_mode): torch's
    deterministic kernels (attention backward included), with the cuBLAS workspace setting they
    need; ops without a deterministic kernel warn rather than fail."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


class _PassTimer:
    """Time of a stretch of GPU work without synchronising the step: CUDA events on the
    current stream, read when asked (by then the step's outputs have been waited for). On CPU,
    wall time."""

    def __init__(self, on_gpu: bool) -> None:
        import torch

        self._events = None
        self._start = time.perf_counter()
        if on_gpu:
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()
        self._seconds = 0.0

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._start

    def seconds(self) -> float:
        if self._events is None:
            return self._seconds
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _drop_graph_attributes(model: Any) -> None:
    """Clear tensors that carry an autograd graph (``grad_fn``) from the plain-object helpers
    of ``model``'s modules (e.g. MoE token dispatchers): see :meth:`PolicyWorker.close`."""
    import torch

    for module in model.modules():
        for helper in vars(module).values():
            if isinstance(helper, torch.nn.Module) or not hasattr(helper, "__dict__"):
                continue
            for name, value in list(vars(helper).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(helper, name, None)


def _forget_other_models_moe_metrics() -> None:
    """Megatron's MoE routers add their auxiliary-loss metrics into one process-wide tracker
    whose per-layer buffers are sized (and placed) by the first model that records: a later
    model in the same process with more layers, or on another device, would index past them.
    This backend does not read those metrics, so a new model starts with a fresh tracker."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()


class PolicyWorker:
    def __init__(
        self,
        *,
        settings: PolicySettings,
        rank: int,
        world_size: int,
        seed: int,
        on_gpu: bool,
        trainable: bool = True,
        with_reference: bool = False,
        logits_temperature: float = 1.0,
    ) -> None:
        # Before this process imports megatron-core (setup does), in case Ray's worker setup
        # hook did not run (a Ray started by someone else, or the worker used in-process).
        known_warnings.install()
        self.settings, self.where = settings, settings.where
        # GRPO's sampling temperature: its log-probabilities (training, old, reference) are
        # those of logits / temperature, as the sampler's (chunked_logprobs.install).
        self.logits_temperature = logits_temperature
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.on_gpu, self.trainable, self.with_reference = on_gpu, trainable, with_reference
        self.model: Any = None
        self.reference: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.graphs: Any = None  # StepGraphs with cuda_graph_impl full_iteration
        self.layer_inputs: Any = None  # offload.layer_input.LayerInputOffloader, when on
        self.quantized = False  # policy.quant_cfg applied (quantize)
        self.step = 0

    # ------------------------------------------------------------------------------ setup
    def node_address(self) -> tuple[str, int]:
        """Where rank 0 listens for torch.distributed's rendezvous."""
        return socket.gethostbyname(socket.gethostname()), _free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        import torch

        from nemo_rl_offload.errors import UserInputError
        from nemo_rl_offload.models.builder import build_gpt_model
        from nemo_rl_offload.models.chunked_logprobs import install as install_chunked_logprobs
        from nemo_rl_offload.models.layer_input_block import layer_input_offloader
        from nemo_rl_offload.models.parallel import initialize_megatron_parallel
        from nemo_rl_offload.offload.runtime import OffloadRuntime, default_host_budget_bytes
        from nemo_rl_offload.policy.step_graphs import (
            StepGraphs,
            allow_reuse_of_offloaded_memory_in_capture,
        )

        numa: dict[str, Any] = {}
        if self.on_gpu:
            from nemo_rl_offload.distributed.numa import bind_to_gpu_numa_node

            binding = bind_to_gpu_numa_node(0)
            numa = {"numa_node": binding.numa_node, "numa_skipped": binding.skipped_reason}
            torch.cuda.set_device(0)
        if not torch.distributed.is_initialized():  # else: a second model in this process
            torch.distributed.init_process_group(
                "nccl" if self.on_gpu else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
            )
        settings = self.settings
        self.architecture = settings.architecture
        effective = settings.effective
        if settings.fp8_errors:
            # A worker started without validate (a benchmark, a script) refuses an fp8_cfg
            # that validate would refuse, rather than train in the training dtype silently.
            raise UserInputError(settings.fp8_errors[0])
        # The offload rules refuse CUDA graphs on CPU workers; this guards in-process use.
        graphed = self.on_gpu and effective.value("cuda_graph_impl") == "full_iteration"
        initialize_megatron_parallel(
            settings.parallel_sizes(), seed=self.seed, on_gpu=self.on_gpu, cudagraphable_rng=graphed
        )
        _forget_other_models_moe_metrics()
        model, warnings = build_gpt_model(effective, self.architecture, on_gpu=self.on_gpu)
        # Full recompute's segment inputs offloaded (offload_modules: [layer_input]): its bytes
        # are reported per step beside the offload runtime's.
        self.layer_inputs = layer_input_offloader(model)
        if graphed:
            allow_reuse_of_offloaded_memory_in_capture()
            self.graphs = StepGraphs(warmup_steps=model.config.cuda_graph_warmup_steps)
        if model.config.deterministic_mode:
            _use_deterministic_algorithms()
        if self.architecture.hf_directory and not settings.init_checkpoint:
            # Before the reference copy and the optimizer, which copy the weights.
            from nemo_rl_offload.models.hf_checkpoint import load_into_model

            load_into_model(model, self.architecture)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.on_gpu
            else torch.device("cpu")
        )
        budget_gib = settings.offload.host_budget_gib
        self.runtime = OffloadRuntime(
            model.config,
            host_budget_bytes=int(budget_gib * 2**30)
            if budget_gib
            else default_host_budget_bytes(),
            sequence_buckets=list(settings.offload.sequence_buckets),
            graphed=self.graphs is not None,
            on_release=self._release_graphs,
            choices=settings.offload.choices(graphed=self.graphs is not None),
        )
        # policy.logprob_chunk_size: the labels' log-probabilities in chunks of the sequence.
        chunk, chunked_output_layer = settings.logprob_chunk, settings.chunked_output_layer
        install_chunked_logprobs(
            model, chunk, self.logits_temperature, chunked_output_layer=chunked_output_layer
        )
        if self.with_reference:
            reference, _ = build_gpt_model(effective, self.architecture, on_gpu=self.on_gpu)
            install_chunked_logprobs(
                reference,
                chunk,
                self.logits_temperature,
                chunked_output_layer=chunked_output_layer,
            )
            reference.load_state_dict(model.state_dict())
            reference.config.fine_grained_activation_offloading = False
            self.reference = self._precision_wrap(reference).eval()
        self.model = self._precision_wrap(model)
        if self.trainable:
            self._setup_training(model.config)
        params = sum(p.numel() for p in model.parameters())
        from nemo_rl_offload.models.fp8_linear import count_fp8_linears

        return {
            "warnings": warnings,
            "parameters": params,
            "device": str(self.device),
            "fp8_linears": count_fp8_linears(model),
            **numa,
        }

    def quantize(self, config_value: str, calibration: list[list[list[int]]]) -> dict[str, int]:
        """Make the policy quantization-aware (``policy.quant_cfg``, ``models.quantization``)
        once its weights are final, calibrating on ``calibration`` (token id batches, the same
        on every rank). Before a resume's load, which then restores the quantizers' state."""
        import torch
        from megatron.core import parallel_state as ps

        from nemo_rl_offload.models import quantization

        config = quantization.resolve(config_value, [Path.cwd()])
        batches = [torch.tensor(b, dtype=torch.long, device=self.device) for b in calibration]
        # Megatron's DDP with overlap_param_gather keeps a forward pre-hook per submodule it
        # saw when built; the quantizers are new submodules. Off and on again around the
        # insertion, every module has one (no step has run: nothing to gather).
        hooked = getattr(self.model, "use_forward_hook", False)
        if hooked:
            self.model.disable_forward_pre_hook(param_sync=False)
        try:
            info = quantization.quantize(
                self._unwrapped(),
                config,
                batches,
                on_gpu=self.on_gpu,
                pipeline_or_context_parallel=ps.get_pipeline_model_parallel_world_size() > 1
                or ps.get_context_parallel_world_size() > 1,
            )
        finally:
            if hooked:
                self.model.enable_forward_pre_hook()
        self.quantized = True
        return info

    def _rollout_quantizers(self) -> contextlib.AbstractContextManager[None]:
        """Rollouts of a quantized policy run without its quantizers unless
        ``generation.quant_cfg`` asks for them (``config.quantization``)."""
        if not self.quantized or self.settings.rollouts_quantized:
            return contextlib.nullcontext()
        from nemo_rl_offload.models.quantization import quantizers_off

        return quantizers_off(self._unwrapped())

    def parallel_layout(self) -> dict[str, int | bool]:
        """This rank's data-parallel coordinates, whether it returns outputs (the first
        tensor- and context-parallel rank of the last pipeline stage: every such rank has
        identical ones, and only the first context-parallel rank counts the step's tokens),
        and the group's parallel sizes and optimizer kind (what a checkpoint records)."""
        from megatron.core import parallel_state as ps

        return {
            "dp_rank": ps.get_data_parallel_rank(),
            "dp_size": ps.get_data_parallel_world_size(),
            "reports": ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
            and ps.is_pipeline_last_stage(),
            "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
            "context_parallel": ps.get_context_parallel_world_size(),
            "expert_parallel": ps.get_expert_model_parallel_world_size(),
            "distributed_optimizer": self._distributed_optimizer,
        }

    def _precision_wrap(self, model: Any) -> Any:
        """Megatron's Float16Module for bf16/fp16 (casts inputs, returns float32 outputs)."""
        if model.config.bf16 or model.config.fp16:
            from megatron.core.transformer.module import Float16Module

            return Float16Module(model.config, model)
        return model

    def _setup_training(self, config: Any) -> None:
        import torch
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from nemo_rl_offload.config import megatron_settings
        from nemo_rl_offload.offload.capabilities import detect

        opt_cfg = dict(self.settings.optimizer)
        ddp_cfg = dict(self.settings.ddp)
        # On CPU workers too: its reduce-scatter and all-gather run on gloo.
        use_distributed = bool(opt_cfg.get("use_distributed_optimizer", False))
        ddp_cfg.pop("use_custom_fsdp", None)
        # Parameter all-gathers exist only with the distributed optimizer (sharded parameters).
        ddp_cfg["overlap_param_gather"] = (
            bool(ddp_cfg.get("overlap_param_gather")) and use_distributed
        )
        ddp = DistributedDataParallelConfig(
            **{
                k: v
                for k, v in ddp_cfg.items()
                if k in DistributedDataParallelConfig.__annotations__
            },
            use_distributed_optimizer=use_distributed,
        )
        stream = None
        if self.graphs is not None:
            # Built on the stream graphs are captured on: the gradient-accumulation nodes it
            # creates remember their stream, and a capture must not meet another one.
            from megatron.core.full_cuda_graph import get_shared_capture_stream

            stream = get_shared_capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # None: the current stream, as without graphs
            self.model = DistributedDataParallel(config=config, ddp_config=ddp, module=self.model)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        precision = self.settings.precision
        kwargs = {k: opt_cfg[k] for k in OPTIMIZER_KEYS_FROM_RECIPE if k in opt_cfg}
        kwargs["use_distributed_optimizer"] = use_distributed
        kwargs["use_precision_aware_optimizer"] = megatron_settings.precision_aware_optimizer(
            opt_cfg, te_installed=detect().has_transformer_engine, on_gpu=self.on_gpu
        )
        kwargs["clip_grad"] = float(kwargs.get("clip_grad") or 0.0)
        with self._optimizer_construction():
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    **kwargs,
                    bf16=precision == "bfloat16",
                    fp16=precision == "float16",
                    params_dtype=getattr(torch, str(opt_cfg.get("params_dtype", "float32"))),
                ),
                [self.model],
                config_overrides=weight_decay_overrides(opt_cfg),
            )
        self.scheduler = build_param_scheduler(
            self.optimizer, self.settings.optimizer, self.settings.scheduler
        )

    def _optimizer_construction(self) -> contextlib.AbstractContextManager[None]:
        """On CPU workers, the distributed optimizer is built with its parameters answering
        CUDA type names (``cpu_compat.params_typed_as_cuda``): it checks them by name."""
        if self.on_gpu:
            return contextlib.nullcontext()
        from nemo_rl_offload.models.cpu_compat import params_typed_as_cuda

        return params_typed_as_cuda(self.model.parameters())

    # ------------------------------------------------------------------------- passes
    def _tensors(self, microbatches: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
        """The micro-batches on the device. On a GPU they go through pinned memory without
        waiting for the GPU: the host then begins the forward while the GPU still runs the
        previous step's optimizer, so a forward whose host work is close to its GPU time starts
        ahead of the GPU instead of level with it."""
        import torch

        def on_device(value: np.ndarray) -> torch.Tensor:
            if not self.on_gpu:
                return torch.tensor(value)
            # One copy out of numpy, straight into pinned memory: torch refuses to pin a tensor
            # built from numpy, and Ray hands the worker read-only arrays.
            dtype = torch.from_numpy(np.empty(0, dtype=value.dtype)).dtype
            pinned = torch.empty(value.shape, dtype=dtype, pin_memory=True)
            pinned.numpy()[...] = value
            return pinned.to(self.device, non_blocking=True)

        return [{key: on_device(value) for key, value in mb.items()} for mb in microbatches]

    def train(self, microbatches: list[dict[str, np.ndarray]], loss: dict[str, Any]) -> dict:
        """One optimizer step over this rank's micro-batches; returns loss and metric sums."""
        import torch

        from nemo_rl_offload import losses
        from nemo_rl_offload.offload.runtime import pad_microbatches
        from nemo_rl_offload.policy.step_features import STEP_FEATURES
        from nemo_rl_offload.policy.train_step import run_microbatches

        start = time.perf_counter()
        self.model.zero_grad_buffer()
        # Frees the previous step's float32 copies of the gradients (with bf16 gradient
        # buffers): measured from here, the peak is this step's own.
        self.optimizer.zero_grad()
        fwd_bwd = _PassTimer(self.on_gpu)
        if self.layer_inputs is not None:
            self.layer_inputs.counters.reset()
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats()
            at_start = torch.cuda.memory_allocated() / 2**30
        if self._pipeline_stages > 1:  # the stages exchange activations of one shape
            longest = max(batch["input_ids"].shape[1] for batch in microbatches)
            microbatches = pad_microbatches(microbatches, longest)
        microbatches = self.runtime.prepare_step(microbatches, sync_length=self._dp_max)
        loss_fn = losses.make_loss_fn(loss)
        for feature in STEP_FEATURES:
            feature.start_step(self.model, self.device)

        # Rank 0 says how far its micro-batches are when the step is slow (the driver said
        # the phase started).
        progress = Progress(f"{self.where} rank 0, step {self.step + 1}", enabled=self.rank == 0)
        progress.start("training", len(microbatches), unit="micro-batches", announce=False)

        def forward_backward(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return run_microbatches(
                self.model, tensors, loss_fn, forward_only=False, progress=progress
            )

        tensors = self._tensors(microbatches)
        graph_metrics: dict[str, float] = {}
        if self.graphs is None:
            outputs, mode = forward_backward(tensors), "eager"
        else:
            key = self._graph_key(tensors, loss)
            outputs, mode = self.graphs.run(key, tensors, forward_backward)
            graph_metrics = self.graphs.metrics(mode)
        fwd_bwd.stop()
        progress.finish(len(microbatches))
        # Activations (what offloading moves) peak in the forward-backward; the optimizer step
        # has its own peak (its states), reported separately by memory_stats.
        fwd_bwd_peak = torch.cuda.max_memory_allocated() / 2**30 if self.on_gpu else None
        if mode != "eager":
            # A replay allocates nothing (the capture reserved its memory): report the
            # captured step's peak, which every replay of it reaches again.
            fwd_bwd_peak = at_start + self.graphs.activation_peak_bytes(key) / 2**30
        metrics = self._sum_outputs(outputs)  # read before any other step reuses the buffers
        for feature in STEP_FEATURES:
            metrics.update(feature.step_metrics(self.model, self.device, len(microbatches)))
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        self.step += 1
        metrics.update(
            grad_norm=float(grad_norm or 0.0),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            step_time_s=time.perf_counter() - start,
            fwd_bwd_time_s=fwd_bwd.seconds(),
            **self.runtime.after_step(copies_timed=mode == "eager"),
            **graph_metrics,
            **self.memory_stats(),
        )
        if self.layer_inputs is not None:
            moved = self.layer_inputs.counters.offloaded_bytes / 2**30
            metrics["offloaded_gib_layer_input"] = moved
            metrics["offloaded_gib_per_step"] = metrics.get("offloaded_gib_per_step", 0.0) + moved
        if fwd_bwd_peak is not None:
            # What the device really holds, graph memory pools included (a graph's replays
            # allocate nothing, so allocated-bytes peaks do not see them).
            metrics["peak_reserved_gpu_memory_gib"] = torch.cuda.max_memory_reserved() / 2**30
            metrics["peak_fwd_bwd_gpu_memory_gib"] = fwd_bwd_peak
            # What the step's activations added over the resident state (weights, gradients,
            # optimizer): what offloading changes, independent of other models in the process.
            metrics["peak_activation_gpu_memory_gib"] = fwd_bwd_peak - at_start
        return metrics

    def _graph_key(self, tensors: list[dict[str, Any]], loss: dict[str, Any]) -> tuple:
        """A training step's graph key: its offload plan's shape (which the runtime's budget
        may release), every input tensor's shape and dtype, and the loss settings, which the
        graph bakes in as constants."""
        from nemo_rl_offload.policy.step_graphs import input_signature

        return (self.runtime.step_shape, input_signature(tensors), repr(sorted(loss.items())))

    def _release_graphs(self, shape: tuple[int, int]) -> None:
        """The runtime released the offload plan of ``shape``: its graphs go with it (they
        write to that plan's pinned buffers)."""
        if self.graphs is not None:
            self.graphs.release(lambda key: key[0] == shape)

    def _dp_max(self, length: int) -> int:
        """The longest padded length over the data-parallel ranks (graphed steps only): all
        ranks then run the same step key and capture at the same step, as the collectives in
        their graphs require."""
        import torch
        from megatron.core import parallel_state

        if self.graphs is None or parallel_state.get_data_parallel_world_size() == 1:
            return length
        value = torch.tensor([length], device=self.device)
        torch.distributed.all_reduce(
            value,
            op=torch.distributed.ReduceOp.MAX,
            group=parallel_state.get_data_parallel_group(),
        )
        return int(value.item())

    @staticmethod
    def _sum_outputs(outputs: list[dict[str, Any]]) -> dict[str, float]:
        totals: dict[str, float] = {}
        for output in outputs:
            for key, value in output.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        return totals

    def token_logprobs(
        self, microbatches: list[dict[str, np.ndarray]], *, reference: bool = False
    ) -> list[np.ndarray]:
        """log p(label) per position [b, s] for each micro-batch (forward only; on the ranks
        that report, see :meth:`parallel_layout`, [] on the other pipeline stages)."""

        def label_logprobs(batch: dict[str, Any], per_token_loss: Any) -> dict[str, Any]:
            return {"logprobs": -per_token_loss.float()}

        model = self.reference if reference else self.model
        if reference:  # the reference policy routes on its own (policy.router_replay, NeMo-RL's)
            microbatches = [{k: v for k, v in mb.items() if k != ROUTES_KEY} for mb in microbatches]
        outputs = self._forward(model, microbatches, label_logprobs, with_labels=True)
        return [output["logprobs"].cpu().numpy() for output in outputs]

    def topk_logprobs(
        self, microbatches: list[dict[str, np.ndarray]], k: int | None
    ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The top-k next-token log-probabilities and their token ids per position (all of the
        vocabulary when k is None), for distillation teachers; computed on the last pipeline
        stage, where the logits are."""
        from nemo_rl_offload.models.cached_forward import full_vocab
        from nemo_rl_offload.models.chunked_logprobs import topk_logprobs

        vocab = self.architecture.vocab_size
        chunk = self.settings.logprob_chunk

        def top_k(batch: dict[str, Any], logits: Any) -> dict[str, Any]:
            return topk_logprobs(full_vocab(logits)[..., :vocab], k, chunk)

        outputs = self._forward(self.model, microbatches, top_k, with_labels=False)
        return [
            (
                output["values"].cpu().numpy(),
                output["indices"].cpu().numpy() if "indices" in output else None,
            )
            for output in outputs
        ]

    def _forward(
        self, model: Any, microbatches: list[dict], output_fn: Any, *, with_labels: bool
    ) -> list[dict[str, Any]]:
        """Forward-only pass through Megatron's schedule (``train_step.forward_outputs``),
        outside the offload plan: ``output_fn`` gets per-token losses (minus the labels'
        log-probabilities) with labels, else logits."""
        from nemo_rl_offload.policy.train_step import FORWARD_INPUTS, forward_outputs

        if not microbatches:
            # A data-parallel rank with no share of the pass (fewer packs than ranks): the
            # ranks of its group all have none, so no collective waits for it.
            return []
        keys = [key for key in FORWARD_INPUTS if with_labels or key != "labels"]
        inputs = [{key: mb[key] for key in keys if key in mb} for mb in microbatches]
        with self.runtime.forward_only():
            model.eval()
            try:
                return forward_outputs(model, self._tensors(inputs), output_fn)
            finally:
                model.train()

    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        *,
        seed: int,
        pad_id: int,
        record_routes: bool = False,
    ) -> list[Any]:
        """Sampled continuations of ``prompts`` (``generation.Generated``: token ids without
        the prompt, and their log-probabilities; with ``record_routes`` each position's experts,
        which needs a model built for ``policy.router_replay``)."""
        from nemo_rl_offload.models.router_replay import replays_routes
        from nemo_rl_offload.policy.generation import sample

        # The KV cache lives only inside this block: allocated for the call, freed after it.
        with self.runtime.forward_only(), self._rollout_quantizers():
            return sample(
                self.model,
                prompts,
                settings,
                pad_id=pad_id,
                vocab_size=self.architecture.vocab_size,
                seed=seed,
                device=self.device,
                engine=self.settings.generation.engine,
                record_routes=record_routes and replays_routes(self.model),
            )

    def phase_peak_gib(self) -> float:
        """The most GPU memory allocated since the last call (or training step), then a new
        count: the driver brackets a phase (sampling, log-probabilities) with two calls. 0.0 on
        CPU workers."""
        if not self.on_gpu:
            return 0.0
        import torch

        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return peak

    # ------------------------------------------------------------------------- state
    def memory_stats(self) -> dict[str, float]:
        if not self.on_gpu:
            return {}
        import torch

        from nemo_rl_offload.models.flops import peak_bf16_flops

        return {
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "gpu_memory_gib": torch.cuda.memory_allocated() / 2**30,
            # What NeMo-RL's model FLOPs utilization divides by (0.0: a GPU not in the table).
            "device_peak_bf16_tflops": peak_bf16_flops(torch.cuda.get_device_name()) / 1e12,
        }

    def save_checkpoint(self, directory: str) -> None:
        """Write this rank's part of the checkpoint in ``directory`` (every rank together):
        weights, optimizer, scheduler, generators and step (``policy.checkpoint``)."""
        from nemo_rl_offload.policy import checkpoint

        with self._parameters_gathered():
            checkpoint.save(
                directory,
                model=self._unwrapped(),
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                step=self.step,
                distributed_optimizer=self._distributed_optimizer,
                on_gpu=self.on_gpu,
                quant_cfg=self.settings.quant_cfg if self.quantized else None,
            )

    @contextlib.contextmanager
    def _parameters_gathered(self) -> Iterator[None]:
        """Every parameter as the last optimizer step left it, for the duration.

        With the distributed optimizer and ``overlap_param_gather`` (the exemplar recipes'
        setting), a step updates each rank's own shard only; Megatron's DDP gathers the other
        shards in the next forward's pre-hooks. Until then this rank's copy of every other
        shard is the weights before the step, so a checkpoint saved right after a step would
        hold them (a resumed run then trained on partly older weights). Megatron's own
        training loop turns the hooks off around a save, which gathers the parameters at once;
        so does this."""
        model = self.model
        if not getattr(model, "use_forward_hook", False):
            yield
            return
        model.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            model.enable_forward_pre_hook()

    def load_checkpoint(self, directory: str, *, weights_only: bool = False) -> int:
        """Load a checkpoint (either format). ``weights_only`` (``init_checkpoint``): the
        weights, into the reference model too; otherwise (resume) the full training state
        into the policy, while the reference keeps the weights it started with."""
        from nemo_rl_offload.policy import checkpoint

        if checkpoint.is_legacy(directory):
            return self._load_legacy(directory, weights_only=weights_only)
        weights, step = checkpoint.load(
            directory,
            model=self._unwrapped(),
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            distributed_optimizer=self._distributed_optimizer,
            on_gpu=self.on_gpu,
            weights_only=weights_only,
        )
        if weights_only:
            self._load_reference(weights)
            return 0
        self.step = step
        return step

    def _load_legacy(self, directory: str, *, weights_only: bool) -> int:
        """A checkpoint of the first format: weights, and for a resume the step, the scheduler
        and the plain optimizer's state it holds (it held none for the distributed one)."""
        from nemo_rl_offload.policy import checkpoint

        state = checkpoint.read_legacy_shard(checkpoint.legacy_shard_path(directory))
        self._unwrapped().load_state_dict(state["model"])
        if self.optimizer is not None:
            # The optimizer's float32 copies of the weights were made when it was built.
            self.optimizer.reload_model_params()
        if weights_only:
            self._load_reference(state["model"])
            return 0
        if self.optimizer is not None and "optimizer" in state:
            if not self._distributed_optimizer:  # that format held the plain optimizer's only
                self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state.get("step", 0))
        return self.step

    def _load_reference(self, weights: dict[str, Any]) -> None:
        if self.reference is not None:
            from megatron.core.utils import unwrap_model

            unwrap_model(self.reference).load_state_dict(weights)

    @property
    def _pipeline_stages(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_world_size()

    @property
    def _distributed_optimizer(self) -> bool:
        return self.optimizer is not None and bool(self.optimizer.config.use_distributed_optimizer)

    def close(self) -> None:
        """Drop the model, its reference copy, optimizer and offload plans so that their
        memory is freed while the process goes on (a second model in one process: tests,
        benchmarks). Megatron's MoE token dispatcher keeps the last step's routing
        probabilities with their autograd graph, whose nodes refer back to the layer: a
        reference cycle through C++ objects that Python's garbage collector cannot break, so
        such graph-holding attributes are cleared first."""
        import gc

        for model in (self.model, self.reference):
            if model is not None:
                _drop_graph_attributes(model)
        if self.graphs is not None:
            self.graphs.release(lambda key: True)
        self.model = self.reference = self.optimizer = self.scheduler = self.runtime = None
        self.graphs = None
        _forget_other_models_moe_metrics()
        gc.collect()
        if self.on_gpu:
            import torch
            from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
                PipelineOffloadManager,
            )

            PipelineOffloadManager.reset_instance()
            gc.collect()
            torch.cuda.empty_cache()

    def _unwrapped(self) -> Any:
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model)
