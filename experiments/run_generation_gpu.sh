#!/usr/bin/env bash
# Rollout decode against the roofline on one GPU: the benchmark grid, a profile of the
# compiled sampler, the GPU tests. Usage: experiments/run_generation_gpu.sh OUT_DIR [MODELS] [NEW_TOKENS]
# If the compiled sampler fails on the first model with its defaults, the rest runs with the draws
# sampled after the captured step (graph_sampling=False), and the CSV's options column says so.
set -u
out=${1:?output directory}; models=${2:-0.5b,1.5b,7b}; new=${3:-512}
B=benchmarks/bench_generation.py
quiet() { grep -v "Warning\|warn\|^  \|Configuration class\|Skipping import"; }
first=${models%%,*}; rest=${models#"$first"}; rest=${rest#,}
opts=""
timeout 100 python3 $B --models "$first" --rows 64 --new-tokens "$new" --samplers compiled --out "$out/generation_roofline.csv" \
    > "$out/first.log" 2>&1
quiet < "$out/first.log" | tail -n 6
if grep -q "error:" "$out/first.log"; then
    opts="graph_sampling=False"
    timeout 80 python3 $B --models "$first" --rows 64 --new-tokens "$new" --samplers compiled --compiled-options "$opts" \
        --out "$out/generation_roofline.csv" 2>&1 | quiet | tail -n 4
fi
[ -n "$rest" ] && timeout 150 python3 $B --models "$rest" --rows 64 --new-tokens "$new" --samplers compiled \
    --compiled-options "$opts" --out "$out/generation_roofline.csv" 2>&1 | quiet | tail -n 8
TORCH_LOGS=perf_hints timeout 70 python3 $B --models 1.5b --rows 64 --new-tokens 128 --samplers compiled \
    --compiled-options "$opts" --profile 2>&1 | quiet | cut -c1-100,150-250 | tail -n 28
timeout 240 python3 -m pytest -q -x tests/gpu/test_rollout_gpu.py 2>&1 | quiet | tail -n 8
