#!/usr/bin/env bash
# grpo_distributed (FSDP2, 2 GPUs) against grpo_single_device, in one GPU session (about 4 minutes):
#   1. configs/tiny_grpo.yaml in fp32 (bundled checkpoint; beta > 0 and two iterations, so the
#      frozen reference and the old log-probs take part), 6 steps each way: reward/mean, loss, kl,
#      grad_norm per step side by side, with the largest relative difference of each. The two runs
#      sample the same completions (one random stream per prompt), so the differences are rounding.
#   2. configs/qwen_grpo.yaml (Qwen2.5-1.5B-Instruct architecture, random weights, synthetic prompts)
#      for 2 steps on 2 ranks, with the eager sampler and with the fast one (uncompiled under FSDP):
#      step time, generation / update time, tokens/s and peak memory of step 2.
# Usage: bash benchmarks/run_grpo_distributed_gpu.sh OUT_DIR   (PYTHONPATH holds components/ and recipes/)
set -uo pipefail
out=${1:?usage: run_grpo_distributed_gpu.sh OUT_DIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1   # deterministic cuBLAS; fp32 matmuls stay fp32 (no TF32)
dist() { timeout "$1" torchrun --standalone --nproc_per_node 2 -m grpo_distributed "${@:2}"; }

tiny=(--config configs/tiny_grpo.yaml device=cuda dtype=fp32 cpu_threads=null max_steps=6 eval_every_n_steps=3
      generation.backend=eager loss.beta=0.04 num_iterations=2 save_every_n_steps=1000 save_final_checkpoint=false)
rm -rf /tmp/grpo_tiny_single /tmp/grpo_tiny_dist
timeout 150 python3 -m grpo_single_device "${tiny[@]}" output_dir=/tmp/grpo_tiny_single > "$out/tiny_single.log" 2>&1
echo "tiny single rc=$?"
dist 200 "${tiny[@]}" output_dir=/tmp/grpo_tiny_dist > "$out/tiny_dist.log" 2>&1
echo "tiny dist rc=$?"
cat /tmp/grpo_tiny_single/logs/*.txt > "$out/tiny_single_metrics.txt" 2>/dev/null
cat /tmp/grpo_tiny_dist/logs/*.txt > "$out/tiny_dist_metrics.txt" 2>/dev/null
python3 - "$out/tiny_single_metrics.txt" "$out/tiny_dist_metrics.txt" <<'PY'
import sys
from logitless.training import read_disk_log
single, dist = read_disk_log(sys.argv[1]), read_disk_log(sys.argv[2])
for key in ("reward/mean", "loss", "kl", "grad_norm", "entropy", "eval/accuracy"):
    steps = sorted(set(single.get(key, {})) & set(dist.get(key, {})))
    rel = [abs(dist[key][s] - single[key][s]) / max(abs(single[key][s]), 1e-12) for s in steps]
    pairs = " ".join(f"{s}:{single[key][s]:.6g}/{dist[key][s]:.6g}" for s in steps)
    print(f"{key:14s} single/dist {pairs}  max rel diff {max(rel, default=float('nan')):.2e}")
PY

qwen=(--config configs/qwen_grpo.yaml model_init=random tokenizer._component_=logitless.data.synthetic_tokenizer
      dataset._component_=logitless.rl.data.synthetic_prompt_dataset eval_every_n_steps=null max_steps=2
      save_every_n_steps=1000 save_final_checkpoint=false)
for backend in eager fast; do
    dir=/tmp/grpo_qwen_dist_$backend
    rm -rf "$dir"
    dist 200 "${qwen[@]}" generation.backend=$backend output_dir="$dir" > "$out/qwen_dist_$backend.log" 2>&1
    echo "qwen 1.5B 2 ranks backend=$backend rc=$?"
    cat "$dir"/logs/*.txt > "$out/qwen_dist_${backend}_metrics.txt" 2>/dev/null
    grep -h -o "Step 2 |.*" "$out/qwen_dist_${backend}_metrics.txt" | tr '|' '\n' | tr ' ' '\n' \
        | grep -E "step_time_s|time/|tokens_per_second|peak_memory|reward/mean:|loss:" | tr '\n' ' '
    echo
done
for f in "$out"/*.log; do grep -m3 -H "Error\|Traceback" "$f"; done
