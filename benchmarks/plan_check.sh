#!/usr/bin/env bash
# The planner on the 1B dense recipe at one sequence length, for budgets of 90%, 75% and 60% of
# the no-offload peak. To compare its choices with a table of the same step (4 micro-batches of
# 1 sequence), run in the same session (it does not fit in one 10-minute device command with
# this script):
#   python3 benchmarks/offload_benchmark.py --model llama-1b --seq $SEQ \
#     --recipe examples/configs/grpo_math_1B_megatron.yaml \
#     --recipe-override=policy.megatron_cfg.optimizer.use_distributed_optimizer=false \
#     --cases fgo_attn_pair,fgo_attn_qkv,fgo_norms,fgo_attention_block,fgo_all5,recompute_full,fgo:CHOICE
# Run on the GPU machine from the repository root: SEQ=8192 OUT=DIR bash benchmarks/plan_check.sh
# CONFIG (a recipe, e.g. the graphed examples/configs/grpo_math_1B_megatron_fgo_graphs.yaml),
# FRACTIONS (budgets as fractions of the no-offload peak), NAME (the output's name) and LIMIT
# (seconds) change what it plans.
set -u
SEQ=${SEQ:-8192}
OUT=${OUT:-/tmp/plan_check}
CONFIG=${CONFIG:-examples/configs/grpo_math_1B_megatron.yaml}
FRACTIONS=${FRACTIONS:-0.9,0.75,0.6}
NAME=${NAME:-plan_llama-1b_seq$SEQ}
source benchmarks/device_setup.sh
timeout "${LIMIT:-560}" python3 -m nemo_rl_offload.cli plan --config "$CONFIG" \
  --budget-fraction "$FRACTIONS" --steps 4 --json "$OUT/$NAME.json" \
  policy.max_total_sequence_length=$SEQ policy.make_sequence_length_divisible_by=$SEQ \
  policy.train_global_batch_size=4 policy.train_micro_batch_size=1 \
  policy.megatron_cfg.optimizer.use_distributed_optimizer=false \
  > "$OUT/$NAME.txt" 2> "$OUT/$NAME.err"
echo "plan rc=$?"; cat "$OUT/$NAME.txt"; grep -i "traceback\|error" "$OUT/$NAME.err" | head -5
