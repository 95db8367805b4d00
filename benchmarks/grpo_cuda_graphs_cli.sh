#!/usr/bin/env bash
# GRPO through the CLI (Ray worker) with full-iteration CUDA graphs and fine-grained offloading
# (RECIPE, default examples/configs/grpo_math_1B_megatron_fgo_graphs.yaml; the MoE one is
# examples/configs/grpo_moe_1B_megatron_fgo_graphs.yaml), one length bucket so the step shape
# recurs: steps 1-2 eager, step 3 captured, later steps replayed. Then the same recipe without
# the max-inflight cap, which validate must refuse before anything starts.
# Run on the GPU machine from the repository root: OUT=DIR [RECIPE=PATH] bash benchmarks/grpo_cuda_graphs_cli.sh
set -u
OUT=${OUT:-/tmp/grpo_cuda_graphs_cli}
source benchmarks/device_setup.sh
RECIPE=${RECIPE:-examples/configs/grpo_math_1B_megatron_fgo_graphs.yaml}
O="policy.train_global_batch_size=16 policy.train_micro_batch_size=4 policy.logprob_batch_size=4 grpo.num_prompts_per_step=4 grpo.num_generations_per_prompt=4 grpo.val_period=0 grpo.val_at_start=false policy.generation.max_new_tokens=8 grpo.max_num_steps=6 policy.max_total_sequence_length=1024 +policy.megatron_cfg.offload_sequence_length_buckets=[1024] checkpointing.enabled=false logger.log_dir=$OUT/logs"
timeout 400 python3 -m nemo_rl_offload.cli grpo --config $RECIPE $O > $OUT/grpo.out 2> $OUT/grpo.err; echo "grpo rc=$?"
grep -i "traceback\|error" $OUT/grpo.err | head -5
python3 - "$OUT/logs" <<'PY'
import json, pathlib, sys
rows = [json.loads(l) for p in pathlib.Path(sys.argv[1]).rglob("*.jsonl") for l in p.open()]
rows = [r for r in rows if "train/cuda_graph_replayed" in r or "cuda_graph_replayed" in json.dumps(r)]
for r in rows:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
           if any(s in k for s in ("step", "cuda_graph", "peak_activation", "offloaded_gib_per_step", "fwd_bwd", "loss"))})
PY
timeout 120 python3 -m nemo_rl_offload.cli validate --config $RECIPE '~policy.megatron_cfg.fine_grained_offloading_max_inflight_offloads' > $OUT/validate.out 2>&1; echo "validate without the cap rc=$?"; cat $OUT/validate.out | tail -3
