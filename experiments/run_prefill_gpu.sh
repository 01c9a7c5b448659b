#!/usr/bin/env bash
# Long-prompt prefill on one GPU: the GPU tests, then time and peak memory of
# chunked vs one-forward prefill at 1.5B and 7B, 1 and 4 prompts (x G=16), 8k/16k/32k-token prompts.
# Usage: experiments/run_prefill_gpu.sh OUT_DIR [MODELS]   (the table is printed last)
set -u
out=${1:?output directory}; models=${2:-1.5b,7b}
mkdir -p "$out"
quiet() { grep -v "Warning\|warn\|^  \|Configuration class\|Skipping import"; }
timeout 120 python3 -m pytest -q -x tests/gpu/test_prefill_gpu.py 2>&1 | quiet | tail -n 8
timeout 420 python3 experiments/bench_prefill.py --models "$models" --prompts 1,4 --widths 8192,16384,32768 \
    --chunk-tokens 8192,none --out "$out/prefill.csv" 2>&1 | quiet | tail -n 16
