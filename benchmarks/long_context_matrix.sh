#!/usr/bin/env bash
# The long-context matrix of issue 20 (docs/offloading.md, "Choosing a plan at long context"):
# the 3B shape (the llama-1b preset with 28 layers, hidden 3072, ffn 8192, 24 heads, 8 query
# groups) on the 1B Megatron recipe's policy (bf16, distributed optimizer), 2 micro-batches of
# one sequence, at each of SEQS tokens per micro-batch: no offload, full recompute (with and
# without its layer inputs offloaded), the cheap selective recompute (norms, activation) alone
# and beside attention offload, the MLP's recompute beside it (default_cases). A case that does
# not fit is a row with its out-of-memory sizes. With GPUS=2 the lengths run side by side, one
# GPU each (round robin).
# Run on the GPU machine from the repository root:
#     OUT=DIR [SEQS="8192 16384 32768"] [CASES=a,b,...] [CASES_16384=c,d,...] [STEPS=5] [GPUS=1] [FIRST_GPU=0] \
#         [LIMIT=seconds per length] [STANDING_START=1] bash benchmarks/long_context_matrix.sh
# STANDING_START=1 waits for the GPU before each step (offload_benchmark.py --standing-start).
# CASES_<N> gives the cases at N tokens, CASES those of every length without one (a plan that
# cannot fit at a length need not be run there; default_cases below otherwise). Writes
# DIR/seq<N>/ (the benchmark's JSON and markdown table per length, and each case's record as it
# finishes in a .cases.jsonl, kept when LIMIT cuts the length short).
set -u
OUT=${OUT:-/tmp/long_context_matrix}
SEQS=${SEQS:-8192 16384 32768}
STEPS=${STEPS:-5}
GPUS=${GPUS:-1}
# The cases of each length (CASES_<N>, else CASES, else these): the plan kinds that were
# fastest at each budget in the measured matrix and the ones the planner's model, calibrated by
# it, puts on the frontier (benchmarks/results/2026-11-25_h100x2_long_context_3b.md).
default_cases() {
    case $1 in
        8192) echo "recompute_full,fgo_all5,fgo_all5_graph_inflight_4,recompute_cheap,fgo:core_attn__rc:layernorm+mlp_act,fgo:attn_norm+core_attn__rc:layernorm+mlp_act,fgo:attn_norm+core_attn+mlp_norm__rc:layernorm+mlp_act,fgo_norm_inputs_attn+recompute_cheap,fgo:core_attn__rc:layernorm+mlp,recompute_full+layer_input" ;;
        16384) echo "recompute_full,recompute_cheap,fgo:core_attn__rc:layernorm+mlp_act__frac:0.5,fgo:core_attn__rc:layernorm+mlp_act,fgo:attn_norm+core_attn__rc:layernorm+mlp_act,fgo:attn_norm+core_attn__rc:layernorm+mlp,recompute_full+layer_input" ;;
        32768) echo "recompute_full,fgo:core_attn__rc:layernorm+mlp,fgo:attn_norm+core_attn__rc:layernorm+mlp,fgo:attn_norm+core_attn+mlp_norm__rc:layernorm+mlp,recompute_full+layer_input" ;;
        *) echo "recompute_full,recompute_full+layer_input,recompute_cheap,fgo:attn_norm+core_attn__rc:layernorm+mlp_act,fgo:attn_norm+core_attn__rc:layernorm+mlp" ;;
    esac
}
source benchmarks/device_setup.sh
SHAPE=(num_layers=28 hidden_size=3072 ffn_hidden_size=8192 num_attention_heads=24 num_query_groups=8)
# The CUDA allocator's expandable segments (NeMo-RL's recipes set them the same way): offloaded
# and reloaded activations of many sizes otherwise leave GiBs reserved but unusable, and plans
# that fit by their bytes run out of memory. ALLOC= runs with the allocator's default.
ALLOC=${ALLOC-expandable_segments:True}
OVERRIDES=()
[ -n "$ALLOC" ] && OVERRIDES+=("--recipe-override=policy.megatron_cfg.env_vars={PYTORCH_CUDA_ALLOC_CONF: \"$ALLOC\"}")
for field in "${SHAPE[@]}"; do
    OVERRIDES+=("--recipe-override=++policy.megatron_cfg.model_overrides.$field")
done
lane=0
for seq in $SEQS; do
    (
        export CUDA_VISIBLE_DEVICES=$(( lane + ${FIRST_GPU:-0} ))
        cases_here=CASES_$seq
        timeout "${LIMIT:-86400}" python3 benchmarks/offload_benchmark.py --model llama-1b \
            --recipe examples/configs/grpo_math_1B_megatron.yaml "${OVERRIDES[@]}" \
            --seq "$seq" --microbatches 2 --steps "$STEPS" \
            --cases "${!cases_here:-${CASES:-$(default_cases "$seq")}}" \
            ${STANDING_START:+--standing-start} --out "$OUT/seq$seq" > "$OUT/seq$seq.log" 2>&1
        echo "seq $seq rc=$? (GPU $CUDA_VISIBLE_DEVICES)"
    ) &
    lane=$(( (lane + 1) % GPUS ))
    if [ "$lane" -eq 0 ]; then wait; fi
done
wait
for seq in $SEQS; do cat "$OUT/seq$seq"/*.md 2>/dev/null; done
