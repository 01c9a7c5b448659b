#!/usr/bin/env bash
# The SFT measurements of the closing notes on one GPU (H200), in sections that fit one device call
# each. PYTHONPATH must hold components/ and recipes/. Usage: bash experiments/run_sft_gpu.sh OUT SECTION...
#   recipe : full_sft_single_device on Qwen2.5-0.5B (random weights, synthetic data), 3 steps, fused loss
#   rows   : bench_sft.py, the four rows of the SFT table (0.5B 8x8192 and 2x32768; 7B 4x4096 with plain CE,
#            7B 1x32768), every loss choice against torchtune's chunked CE and the no-head step
#   compiled : the SFT target: 0.5B 8x8192 and 7B 1x32768 with every variant's layers compiled
#            (--compile), our fused head (cuBLAS GEMMs, then LOGITLESS_HEAD_GEMM=triton) against torchtune's
#            chunked CE compiled as its recipes' compile: True compiles it
#   maxbatch : batch-size probes at 8192 tokens, Qwen2.5-0.5B: fused loss and torchtune's chunked CE
set -uo pipefail
out=${1:?usage: run_sft_gpu.sh OUT_DIR SECTION...}
shift
mkdir -p "$out"
sft() { timeout "$1" python3 benchmarks/bench_sft.py "${@:2}" --out "$out/sft_h200.csv" 2>&1 | grep -E "^ *[a-z_]+: " ; }
for section in "$@"; do
case $section in
recipe)
    rm -rf /tmp/sft_recipe  # a new run refuses a non-empty output_dir
    timeout 150 python3 -m full_sft_single_device --config configs/qwen2_5_0_5b_full.yaml model_init=random \
        tokenizer._component_=logitless.datasets.synthetic_tokenizer tokenizer.vocab_size=151936 \
        dataset._component_=logitless.datasets.synthetic_dataset dataset.seq_len=4096 dataset.num_samples=64 \
        loss._component_=logitless.losses.LinearCrossEntropyLoss batch_size=4 max_steps=3 \
        save_every_n_steps=1000 output_dir=/tmp/sft_recipe > "$out/sft_recipe_single.log" 2>&1
    echo "single-device recipe rc=$?"
    cat /tmp/sft_recipe/logs/*.txt > "$out/sft_recipe_single_metrics.txt" 2>/dev/null
    grep -o "Step [0-9]* |.*" "$out/sft_recipe_single_metrics.txt" | cut -c1-200 ;;
rows)
    v=no_head,torchtune_chunked,logitless_chunked,logitless_fused
    sft 150 --model qwen2_5_0_5b --batch 8 --seq 8192 --variants $v
    sft 150 --model qwen2_5_0_5b --batch 2 --seq 32768 --variants $v
    sft 200 --model qwen2_5_7b --batch 4 --seq 4096 --variants $v --plain
    sft 200 --model qwen2_5_7b --batch 1 --seq 32768 --variants $v ;;
compiled)
    v=no_head,torchtune_chunked_compiled,logitless_fused
    sft 200 --model qwen2_5_0_5b --batch 8 --seq 8192 --compile --variants $v
    LOGITLESS_HEAD_GEMM=triton sft 120 --model qwen2_5_0_5b --batch 8 --seq 8192 --compile --variants logitless_fused
    sft 220 --model qwen2_5_7b --batch 1 --seq 32768 --compile --variants $v ;;
maxbatch)  # probes around the batch that memory per sample predicts (doubling from 1 costs ~10x more)
    for b in 128 160; do sft 70 --model qwen2_5_0_5b --batch $b --seq 8192 --steps 1 --warmup 0 --variants logitless_fused; done
    for b in 16 20; do sft 50 --model qwen2_5_0_5b --batch $b --seq 8192 --steps 1 --warmup 0 --variants torchtune_chunked; done ;;
*) echo "unknown section $section" ;;
esac
done
