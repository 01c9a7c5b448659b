#!/usr/bin/env bash
# The Triton head GEMMs (LOGITLESS_HEAD_GEMM=triton) on one GPU, one stage per
# device call (each at most 570 s): their tests, the block-size sweep at one shape, cuBLAS vs Triton
# GEMMs side by side (triton vs triton_hgemm, triton_fused vs triton_fused_hgemm), the profile split.
# Usage: experiments/run_head_gemm_gpu.sh OUT_DIR tests|sweep SHAPE|compare|profile   (table printed last)
# HGEMM_BLOCKS=stats=MxNxKxGxWxSxWS,dlogits=...,dw=... sets the sweep's winners for compare and profile.
set -u
out=${1:?output directory}; stage=${2:?stage: tests, sweep SHAPE, compare or profile}
mkdir -p "$out"
export PYTHONPATH=components${PYTHONPATH:+:$PYTHONPATH}
quiet() { grep -v "Warning\|warn\|^  \|Configuration class\|Skipping import"; }
bench="python3 benchmarks/bench_head.py --ignore-frac 0.1 ${HGEMM_BLOCKS:+--hgemm-blocks $HGEMM_BLOCKS}"
case "$stage" in
tests)
    timeout 560 python3 -m pytest -q tests/gpu/test_head_gemm_gpu.py tests/ops/test_head_gemm.py \
        "tests/ops/test_head_accuracy.py::test_head_gemm_within_plain_pytorch" 2>&1 | quiet | tail -n 12 ;;
sweep)
    shape=${3:?shape: qwen7b or qwen05b}
    timeout 560 $bench --hgemm-sweep "$shape" --out "$out/head_gemm_sweep_$shape.csv" > "$out/sweep_$shape.log" 2>&1
    tail -n 60 "$out/sweep_$shape.log" ;;
compare)
    timeout 560 $bench --shapes qwen7b,qwen05b --modes fwd,ce,logp,obj \
        --impls compile,triton,triton_hgemm,triton_fused,triton_fused_hgemm --compile-shapes qwen7b,qwen05b \
        --out "$out/head_gemm.csv" > "$out/compare.log" 2>&1
    quiet < "$out/compare.log" | tail -n 45 ;;
profile)
    timeout 560 $bench --profile qwen7b,qwen05b --out "$out/head_gemm_profile.csv" > "$out/profile.log" 2>&1
    grep -v "^    idle" "$out/profile.log" | tail -n 70 ;;
*)
    echo "unknown stage $stage: tests, sweep SHAPE, compare or profile" >&2; exit 2 ;;
esac
