#!/usr/bin/env bash
# GRPO on one GPU starting from a local Hugging Face directory (a random ~1B Llama with a
# character tokenizer, written by examples/make_hf_model.py), with all five dense modules
# offloaded; then the checkpoint is exported back and loaded with transformers.
# Run on the GPU machine from the repository root (../shared/device/README.md): OUT=DIR bash benchmarks/grpo_from_hf_dir.sh
set -u
OUT=${OUT:-/tmp/grpo_from_hf_dir}
WORK=$(mktemp -d)  # the model, checkpoint and export (GBs): not under $OUT
source benchmarks/device_setup.sh
python3 -c "import transformers, safetensors; print('transformers', transformers.__version__)"
python3 examples/make_hf_model.py --out $WORK/hf1b --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192 --dtype bfloat16 2>&1 | tail -1
O="policy.model_name=$WORK/hf1b policy.train_global_batch_size=16 policy.train_micro_batch_size=4 policy.logprob_batch_size=4 grpo.num_prompts_per_step=4 grpo.num_generations_per_prompt=4 grpo.val_period=0 grpo.val_at_start=false policy.generation.max_new_tokens=8 grpo.max_num_steps=3 policy.make_sequence_length_divisible_by=1024 policy.max_total_sequence_length=1024 checkpointing.checkpoint_dir=$WORK/ckpt logger.log_dir=$OUT/grpo_logs"
timeout 300 python3 -m nemo_rl_offload.cli grpo --config examples/configs/grpo_math_1B_megatron_fgo.yaml $O 'policy.megatron_cfg.offload_modules=[attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm]' > $OUT/grpo.out 2> $OUT/grpo.err; echo grpo rc=$?
grep -v "^ *$" $OUT/grpo.out | tail -5; grep -i "error\|Traceback" $OUT/grpo.err | head -5
timeout 120 python3 -m nemo_rl_offload.cli export-hf --config examples/configs/grpo_math_1B_megatron_fgo.yaml --checkpoint $WORK/ckpt --out $WORK/export $O; echo export rc=$?
EXPORT=$WORK/export timeout 120 python3 - <<'PY'
import os, torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained(os.environ["EXPORT"], dtype=torch.bfloat16).cuda()
t = transformers.AutoTokenizer.from_pretrained(os.environ["EXPORT"])
ids = torch.tensor([t.encode("12+7=")]).cuda()
print("exported model loads; logits", tuple(m(ids).logits.shape), "params", sum(p.numel() for p in m.parameters()))
PY
