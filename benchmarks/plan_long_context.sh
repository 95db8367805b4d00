#!/usr/bin/env bash
# The planner on the long-context matrix's step (benchmarks/long_context_matrix.sh): the 3B
# shape on the 1B Megatron recipe's policy, 2 micro-batches of one sequence of SEQ tokens, so
# that its plans and predictions compare with the matrix's table of the same length (issue
# 20: the plan within 5% of the fastest measured, its peak prediction within 5%).
# Run on the GPU machine from the repository root:
#     SEQ=8192 FRACTIONS=0.9,0.75,0.6 OUT=DIR bash benchmarks/plan_long_context.sh
#     SEQ=16384 BUDGETS=76 OUT=DIR bash benchmarks/plan_long_context.sh
# BUDGETS (GiB, comma-separated) or FRACTIONS (of the no-offload peak, measured or predicted);
# TRIALS (candidates to measure per budget, default 3), LIMIT (seconds, default 560), GPU (the
# CUDA device, default 0; with TP=2, GPU=0,1), TP (tensor parallel size, default 1: above it the
# step runs on TP GPUs with sequence parallelism, issue 21's 32k plan at tensor parallel 2).
# Writes DIR/plan_3b_seq<SEQ>[_tp<TP>].{txt,json,err}.
set -u
SEQ=${SEQ:-8192}
OUT=${OUT:-/tmp/plan_long_context}
TP=${TP:-1}
NAME=plan_3b_seq$SEQ
LAYOUT=()
GPUS=0
if [ "$TP" -gt 1 ]; then
    NAME=${NAME}_tp$TP
    LAYOUT=(cluster.gpus_per_node=$TP policy.megatron_cfg.tensor_model_parallel_size=$TP
            policy.megatron_cfg.sequence_parallel=true)
    GPUS=$(seq -s, 0 $(( TP - 1 )))
fi
source benchmarks/device_setup.sh
if [ -n "${BUDGETS:-}" ]; then budget=(--budget-gib "$BUDGETS"); else budget=(--budget-fraction "${FRACTIONS:-0.9,0.75,0.6}"); fi
M=++policy.megatron_cfg.model_overrides
CUDA_VISIBLE_DEVICES=${GPU:-$GPUS} timeout "${LIMIT:-560}" python3 -m nemo_rl_offload.cli plan \
  --config examples/configs/grpo_math_1B_megatron.yaml "${budget[@]}" \
  --steps 4 --max-trials "${TRIALS:-3}" --json "$OUT/$NAME.json" \
  policy.max_total_sequence_length=$SEQ policy.make_sequence_length_divisible_by=$SEQ \
  policy.train_global_batch_size=2 policy.train_micro_batch_size=1 policy.logprob_batch_size=1 \
  $M.num_layers=28 $M.hidden_size=3072 $M.ffn_hidden_size=8192 $M.num_attention_heads=24 \
  $M.num_query_groups=8 "${LAYOUT[@]}" \
  > "$OUT/$NAME.txt" 2> "$OUT/$NAME.err"
echo "plan seq $SEQ rc=$?"; cat "$OUT/$NAME.txt"; grep -i "traceback\|error" "$OUT/$NAME.err" | head -5
