#!/usr/bin/env bash
# The GRPO measurements of the closing notes, in one GPU session (H200):
#   1. configs/qwen_grpo.yaml (Qwen2.5-1.5B-Instruct architecture, random weights, synthetic prompts)
#      for two steps with each log-prob path: chunked, fused (triton), full logits (torch);
#   2. benchmarks/bench_grpo.py: one GRPO step at G=16, 1024-token prompt, 512-token completions;
#   3. benchmarks/bench_trl_grpo.py: TRL's GRPOTrainer at the same setting, when trl is importable.
# Usage: bash benchmarks/run_grpo_gpu.sh OUT_DIR
set -uo pipefail
out=${1:?usage: run_grpo_gpu.sh OUT_DIR}
mkdir -p "$out"
for impl in chunked triton torch; do
    dir=/tmp/logitless_grpo_$impl
    rm -rf "$dir"
    timeout 170 python3 -m grpo_single_device --config configs/qwen_grpo.yaml \
        model_init=random tokenizer._component_=logitless.data.synthetic_tokenizer \
        dataset._component_=logitless.rl.data.synthetic_prompt_dataset eval_every_n_steps=null \
        max_steps=2 save_every_n_steps=1000 output_dir="$dir" loss.impl=$impl > "$out/grpo_config_$impl.log" 2>&1
    echo "config run impl=$impl rc=$?"
    tail -n 3 "$out/grpo_config_$impl.log"
    cat "$dir"/logs/*.txt > "$out/grpo_config_${impl}_metrics.txt" 2>/dev/null
    grep -h -o "Step 2 |.*" "$out/grpo_config_${impl}_metrics.txt" | tr '|' '\n' | grep -E "step_time_s|peak|tokens_per_second|time/" | tr '\n' ' '
    echo
done
timeout 200 python3 benchmarks/bench_grpo.py --models 0.5b,1.5b --generator fast --steps 1 \
    --out "$out/grpo_step.csv" 2>&1 | grep -v Warning | tail -n 8
timeout 150 python3 benchmarks/bench_trl_grpo.py --model 0.5b --steps 3 --out "$out/trl_grpo.csv" 2>&1 | tail -n 3
