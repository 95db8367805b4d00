#!/usr/bin/env bash
# GRPO on the 1B recipe with long responses (issue 18): 64 samples per step of up to 1024 new
# tokens (a randomly initialised policy rarely samples its end token, so responses run long),
# rollouts on the KV-cached sampler with decode-step CUDA graphs, fine-grained offloading on.
# Prints each step's phase times (NeMo-RL's timer names), generation throughput and the
# sampler-vs-training log-probability error, and copies metrics.jsonl to $OUT.
# Run on the GPU machine from the repository root: OUT=DIR [STEPS=3] bash benchmarks/grpo_long_responses.sh
set -u
OUT=${OUT:-/tmp/grpo_long_responses}
STEPS=${STEPS:-3}
source benchmarks/device_setup.sh
mkdir -p "$OUT"
O="grpo.num_prompts_per_step=8 grpo.num_generations_per_prompt=8 grpo.max_num_steps=$STEPS grpo.val_period=0 grpo.val_at_start=false ++grpo.val_at_end=false policy.train_global_batch_size=64 policy.train_micro_batch_size=4 policy.logprob_batch_size=4 policy.max_total_sequence_length=1152 policy.generation.max_new_tokens=1024 ++policy.generation.mcore_generation_config.cuda_graph_impl=local ++policy.generation.mcore_generation_config.num_cuda_graphs=4 checkpointing.enabled=false logger.log_dir=$OUT/logs"
timeout 560 python3 -m nemo_rl_offload.cli grpo --config examples/configs/grpo_math_1B_megatron_fgo.yaml $O > "$OUT/grpo.out" 2> "$OUT/grpo.err"; echo "grpo rc=$?"
grep -i "error\|Traceback" "$OUT/grpo.err" | grep -v "Warning\|warn" | head -10
cp "$OUT/logs/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
python3 - "$OUT/logs" <<'PY'
import json, pathlib, sys
keys = ("step", "step_time_s", "timing/train/generation", "timing/train/policy_and_reference_logprobs",
        "timing/train/policy_training", "generation_new_tokens_per_sec_per_gpu",
        "generation_tokens_per_sec_per_gpu", "response_tokens_mean", "token_mult_prob_error",
        "mean_seq_mult_prob_error", "peak_fwd_bwd_gpu_memory_gib", "offloaded_gib_per_step")
for line in (pathlib.Path(sys.argv[1]) / "metrics.jsonl").open():
    r = json.loads(line)
    print({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys if k in r})
PY
