#!/usr/bin/env bash
# grpo_distributed (FSDP2, 2 GPUs) against grpo_single_device, in one GPU session (about 4 minutes):
#   1. configs/tiny_grpo.yaml in fp32 (bundled checkpoint; beta > 0 and two iterations, so the
#      frozen reference and the old log-probs take part), 6 steps each way: reward/mean, loss, kl,
#      grad_norm per step side by side, with the largest relative difference of each. The two runs
#      sample the same completions (one random stream per prompt), so the differences are rounding.
#      `tiny` runs both with the eager sampler; `tiny_copy` with the fast sampler (compiled), which
#      the distributed run drives through its rollout copy (generation.rollout_copy: auto).
#   2. `qwen`: configs/qwen_grpo.yaml (Qwen2.5-1.5B-Instruct architecture, random weights, synthetic
#      prompts) for 2 steps on 2 ranks: the default (rollout copy, compiled fast sampler), the fast
#      sampler on the gathered shards (uncompiled: rollout_copy=false) and the eager sampler: step
#      time, generation / update time, tokens/s and peak memory of step 2.
# Usage: bash experiments/run_grpo_distributed_gpu.sh OUT_DIR [tiny] [tiny_copy] [qwen]  (default: all;
#        PYTHONPATH holds components/ and recipes/)
set -uo pipefail
out=${1:?usage: run_grpo_distributed_gpu.sh OUT_DIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1   # deterministic cuBLAS; fp32 matmuls stay fp32 (no TF32)
dist() { timeout "$1" torchrun --standalone --nproc_per_node 2 -m grpo_distributed "${@:2}"; }

tiny_pair() {  # name, extra overrides...: single device then 2 ranks, metrics side by side
    local name=$1; shift
    rm -rf /tmp/grpo_${name}_single /tmp/grpo_${name}_dist
    timeout 150 python3 -m grpo_single_device "${tiny[@]}" "$@" output_dir=/tmp/grpo_${name}_single > "$out/${name}_single.log" 2>&1
    echo "$name single rc=$?"
    dist 200 "${tiny[@]}" "$@" output_dir=/tmp/grpo_${name}_dist > "$out/${name}_dist.log" 2>&1
    echo "$name dist rc=$?"
    cat /tmp/grpo_${name}_single/logs/*.txt > "$out/${name}_single_metrics.txt" 2>/dev/null
    cat /tmp/grpo_${name}_dist/logs/*.txt > "$out/${name}_dist_metrics.txt" 2>/dev/null
    python3 - "$out/${name}_single_metrics.txt" "$out/${name}_dist_metrics.txt" <<'PY'
import sys
from logitless.training import read_disk_log
single, dist = read_disk_log(sys.argv[1]), read_disk_log(sys.argv[2])
for key in ("reward/mean", "loss", "kl", "grad_norm", "entropy", "eval/accuracy"):
    steps = sorted(set(single.get(key, {})) & set(dist.get(key, {})))
    rel = [abs(dist[key][s] - single[key][s]) / max(abs(single[key][s]), 1e-12) for s in steps]
    pairs = " ".join(f"{s}:{single[key][s]:.6g}/{dist[key][s]:.6g}" for s in steps)
    print(f"{key:14s} single/dist {pairs}  max rel diff {max(rel, default=float('nan')):.2e}")
PY
}

tiny=(--config configs/tiny_grpo.yaml device=cuda dtype=fp32 cpu_threads=null max_steps=6 eval_every_n_steps=3
      loss.beta=0.04 num_iterations=2 save_every_n_steps=1000 save_final_checkpoint=false)
sections=${*:2}
sections=${sections:-tiny tiny_copy qwen}
[[ " $sections " == *" tiny "* ]] && tiny_pair tiny generation.backend=eager
[[ " $sections " == *" tiny_copy "* ]] && tiny_pair tiny_copy generation.backend=compiled

qwen=(--config configs/qwen_grpo.yaml model_init=random tokenizer._component_=logitless.datasets.synthetic_tokenizer
      dataset._component_=logitless.rl.prompts.synthetic_prompt_dataset eval_every_n_steps=null max_steps=2
      save_every_n_steps=1000 save_final_checkpoint=false)
run_qwen() {  # name, overrides...
    local name=$1; shift
    dir=/tmp/grpo_qwen_dist_$name
    rm -rf "$dir"
    dist 280 "${qwen[@]}" "$@" output_dir="$dir" > "$out/qwen_dist_$name.log" 2>&1
    echo "qwen 1.5B 2 ranks $name rc=$?"
    cat "$dir"/logs/*.txt > "$out/qwen_dist_${name}_metrics.txt" 2>/dev/null
    grep -h -o "Step 2 |.*" "$out/qwen_dist_${name}_metrics.txt" | tr '|' '\n' | tr ' ' '\n' \
        | grep -E "step_time_s|time/|tokens_per_second|peak_memory|reward/mean:|loss:" | tr '\n' ' '
    echo
}
if [[ " $sections " == *" qwen "* ]]; then
    run_qwen copy_compiled                                                  # the default: rollout copy
    run_qwen gathered_fast generation.backend=compiled generation.rollout_copy=false
    [[ -n "${WITH_EAGER:-}" ]] && run_qwen gathered_eager generation.backend=eager
fi
for f in "$out"/*.log; do grep -m3 -H "Error\|Traceback" "$f"; done
