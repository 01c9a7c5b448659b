#!/usr/bin/env bash
# usage: scripts/tiny_runs.sh REPO OUTROOT
# Short tiny SFT (full, fused CE, LoRA) and GRPO runs of the checkout REPO, each logging per-step metrics
# under OUTROOT/{full,fused,lora,grpo}/logs; compare two checkouts with scripts/compare_run_metrics.py.
set -e
REPO=$1; OUT=$2; mkdir -p $OUT; cd $REPO
export PYTHONPATH=$REPO/components:$REPO/recipes OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
rm -rf $OUT/full $OUT/lora $OUT/grpo $OUT/fused
tune run full_sft_single_device --config configs/tiny_full.yaml output_dir=$OUT/full max_steps=25 save_every_n_steps=1000 > $OUT/full.log 2>&1
tune run full_sft_single_device --config configs/tiny_full.yaml output_dir=$OUT/fused max_steps=15 save_every_n_steps=1000 loss._component_=logitless.losses.LinearCrossEntropyLoss > $OUT/fused.log 2>&1
tune run lora_sft_single_device --config configs/tiny_lora.yaml output_dir=$OUT/lora max_steps=25 save_every_n_steps=1000 > $OUT/lora.log 2>&1
tune run grpo_single_device --config configs/tiny_grpo.yaml output_dir=$OUT/grpo max_steps=12 > $OUT/grpo.log 2>&1
echo done
