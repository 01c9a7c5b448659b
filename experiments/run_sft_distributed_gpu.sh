#!/usr/bin/env bash
# full_sft_distributed (FSDP2, 2 GPUs) against full_sft_single_device on the same global batch:
# per-step losses side by side, for the tiny config (bundled checkpoint) and for Qwen2.5-0.5B
# (random weights, synthetic data). Usage: bash experiments/run_sft_distributed_gpu.sh OUT_DIR
set -uo pipefail
out=${1:?usage: run_sft_distributed_gpu.sh OUT_DIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
random05=(model_init=random tokenizer._component_=logitless.datasets.synthetic_tokenizer tokenizer.vocab_size=151936
          dataset._component_=logitless.datasets.synthetic_dataset dataset.seq_len=2048 dataset.num_samples=64)
run_pair() {  # name config extra-args...
    local name=$1 cfg=$2; shift 2
    rm -rf /tmp/sft_$name  # a new run refuses a non-empty output_dir
    python3 -m full_sft_single_device --config "$cfg" "$@" batch_size=4 gradient_accumulation_steps=2 \
        max_steps=6 save_every_n_steps=1000 output_dir=/tmp/sft_$name/single > "$out/${name}_single.log" 2>&1
    echo "$name single rc=$?"
    torchrun --standalone --nproc_per_node 2 -m full_sft_distributed --config "$cfg" "$@" batch_size=2 \
        gradient_accumulation_steps=2 max_steps=6 save_every_n_steps=1000 output_dir=/tmp/sft_$name/dist \
        > "$out/${name}_dist.log" 2>&1
    echo "$name dist rc=$?"
    for kind in single dist; do
        cat /tmp/sft_$name/$kind/logs/*.txt > "$out/${name}_${kind}_metrics.txt" 2>/dev/null
        echo "$name $kind losses: $(grep -o 'loss:[^ ]*' "$out/${name}_${kind}_metrics.txt" | cut -d: -f2 | tr '\n' ' ')"
    done
}
run_pair tiny configs/tiny_full.yaml device=cuda dtype=fp32
run_pair qwen05b configs/qwen2_5_0_5b_full.yaml "${random05[@]}" loss._component_=logitless.losses.LinearCrossEntropyLoss
for f in "$out"/*_dist.log; do grep -m3 -i "error\|Traceback" "$f"; done
