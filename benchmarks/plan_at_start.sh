#!/usr/bin/env bash
# A GRPO job whose recipe asks for a peak budget instead of offload settings
# (policy.megatron_cfg.offload_plan_budget_gib): the job plans first, then trains with the plan.
# Run on the GPU machine from the repository root: BUDGET=19 OUT=DIR bash benchmarks/plan_at_start.sh
set -u
BUDGET=${BUDGET:-19}
OUT=${OUT:-/tmp/plan_at_start}
source benchmarks/device_setup.sh
O="policy.train_global_batch_size=16 policy.train_micro_batch_size=4 policy.logprob_batch_size=4 grpo.num_prompts_per_step=4 grpo.num_generations_per_prompt=4 grpo.val_period=0 grpo.val_at_start=false policy.generation.max_new_tokens=8 grpo.max_num_steps=3 policy.max_total_sequence_length=1024 policy.make_sequence_length_divisible_by=1024 checkpointing.enabled=false logger.log_dir=$OUT/logs"
timeout 500 python3 -m nemo_rl_offload.cli grpo --config examples/configs/grpo_math_1B_megatron.yaml $O +policy.megatron_cfg.offload_plan_budget_gib=$BUDGET > "$OUT/grpo.out" 2> "$OUT/grpo.err"; echo "grpo rc=$?"
grep -v "PolicyWorker\|^\s*$\|Warning\|warn" "$OUT/grpo.err" | grep -i "plan\|budget\|GiB\|error\|Traceback" | head -30
python3 - "$OUT/logs" <<'PY'
import json, pathlib, sys
for line in (pathlib.Path(sys.argv[1]) / "metrics.jsonl").open():
    r = json.loads(line)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
           if k in ("step", "peak_fwd_bwd_gpu_memory_gib", "offloaded_gib_per_step", "fwd_bwd_time_s")})
PY
