#!/usr/bin/env bash
# GRPO on the 1B recipe with fine-grained offloading (the five dense modules) and rollouts on
# the KV-cached sampler, on one GPU twice (the spread of identical runs) and at data, tensor and
# pipeline parallel 2 on two GPUs of one host (issue 21). DAPO's overlong penalty makes the
# reward follow the response length, so a randomly initialised policy gets a learning signal
# (the math reward alone is zero for it). Writes each run's metrics under $OUT and the
# comparison (benchmarks/two_gpu_grpo.py) to $OUT/two_gpu_grpo.{json,md}.
# Run on the two-GPU machine from the repository root:
#     OUT=DIR [STEPS=4] [RUNS="one_gpu_a one_gpu_b dp2 tp2 pp2"] bash benchmarks/two_gpu_grpo.sh
# (each run takes one to two minutes: split RUNS over calls to fit a 10-minute limit).
set -u
OUT=${OUT:-/tmp/two_gpu_grpo}
STEPS=${STEPS:-4}
RUNS=${RUNS:-one_gpu_a one_gpu_b dp2 tp2 pp2}
source benchmarks/device_setup.sh
O=(grpo.num_prompts_per_step=8 grpo.num_generations_per_prompt=8 "grpo.max_num_steps=$STEPS"
   grpo.val_period=0 grpo.val_at_start=false ++grpo.val_at_end=false
   policy.train_global_batch_size=64 policy.train_micro_batch_size=4 policy.logprob_batch_size=4
   policy.max_total_sequence_length=512 policy.generation.max_new_tokens=256
   ++grpo.reward_shaping.enabled=true ++grpo.reward_shaping.max_response_length=256
   ++grpo.reward_shaping.overlong_buffer_length=256 ++grpo.reward_shaping.overlong_buffer_penalty=1.0
   "policy.megatron_cfg.offload_modules=[attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm]"
   checkpointing.enabled=false)
run() {  # tag overrides...
    local tag=$1; shift
    timeout 300 python3 -m nemo_rl_offload.cli grpo --config examples/configs/grpo_math_1B_megatron_fgo.yaml \
        "${O[@]}" "logger.log_dir=$OUT/$tag" "$@" > "$OUT/$tag.out" 2> "$OUT/$tag.err"
    echo "$tag rc=$?"; grep -E "Error|error:" "$OUT/$tag.err" | grep -v -i warn | tail -3
}
declare -A LAYOUT=(
    [one_gpu_a]="cluster.gpus_per_node=1" [one_gpu_b]="cluster.gpus_per_node=1"
    [dp2]="cluster.gpus_per_node=2"
    [tp2]="cluster.gpus_per_node=2 policy.megatron_cfg.tensor_model_parallel_size=2"
    [pp2]="cluster.gpus_per_node=2 policy.megatron_cfg.pipeline_model_parallel_size=2"
)
for tag in $RUNS; do
    # shellcheck disable=SC2086  # the layout is a list of overrides
    run "$tag" ${LAYOUT[$tag]}
done
python3 benchmarks/two_gpu_grpo.py "$OUT"
