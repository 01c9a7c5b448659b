#!/usr/bin/env bash
# Split-K decode attention on one GPU: its GPU tests, the compiled sampler with
# decode_attention sdpa vs split_k, then the attention-only microbenchmark (its table printed last).
# Usage: [ROWS=16,64] experiments/run_splitk_gpu.sh OUT_DIR [MODELS]   (at most 500 s: one device call; on an
# H200 the tests took 57 s and each (model, rows, attention) sampler run about 100 s with its compilation,
# so ROWS defaults to 64 alone: two runs per model)
set -u
out=${1:?output directory}; models=${2:-1.5b}
mkdir -p "$out"
quiet() { grep -v "Warning\|warn\|^  \|Configuration class\|Skipping import"; }
timeout 100 python3 -m pytest -q -x -p no:logging tests/gpu/test_decode_attention_gpu.py 2>&1 | quiet | tail -n 6
timeout 300 python3 benchmarks/bench_generation.py --models "$models" --rows ${ROWS:-64} --new-tokens 512 --samplers compiled \
    --decode-attention sdpa,split_k --out "$out/generation_roofline.csv" > "$out/generation.log" 2>&1
quiet < "$out/generation.log" | tail -n 11
timeout 100 python3 experiments/bench_decode_attention.py --out "$out/decode_attention.csv" > "$out/attention.log" 2>&1
tail -n 84 "$out/attention.log"
