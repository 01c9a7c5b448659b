#!/usr/bin/env bash
# The GRPO measurements of the closing notes, on one GPU (H200), in sections that fit one device call
# each (every command under a timeout). PYTHONPATH must hold components/ and recipes/.
#   config : configs/qwen_grpo.yaml (Qwen2.5-1.5B-Instruct architecture, random weights, synthetic
#            prompts), two steps with each log-prob path: chunked, fused (triton), full logits (reference)
#   step   : bench_grpo.py whole steps (fast sampler + update), G=16, 1024-token prompt, 512-token
#            completions, every path incl. prompt once; then TRL's GRPOTrainer at the same setting
#   grid   : bench_grpo.py --update-only over 0.5B/1.5B/7B x G {8,16} x prompt {256,1024} x
#            completion {512,2048}, one group per micro-batch
#   generation : bench_generation_libraries.py, 4 prompts x G=16, 1024 + 512 (sampler tokens/s against torchtune's and HF generate)
#   limits : largest G and completion length that fit, ours (update-only search) and TRL (probes)
#   rollout_recipe : configs/qwen_grpo.yaml, 3 steps each: decode attention sdpa vs split_k, then
#            split_k with the layers compiled for the update (compile=true): the step targets
#   update_profile : bench_grpo.py --update-only --profile-update at 1.5B and 7B (G=8, 1024 + 512,
#            prompt once), eager then compiled layers: where the update's time goes
#   cascade : bench_grpo.py --update-only at 1.5B and 7B (G=8, 1024 + 512, one group, compiled layers):
#            cascade attention against the dense mask, with and without activation checkpointing, profiled
#   qwen_grpo : configs/qwen_grpo.yaml as shipped, 4 steps, then with activation checkpointing and
#            micro-batches of 8 (its small-GPU setting): the step targets
#   longgroup : the qwen_grpo recipe with 2 groups of G=16, 1024-token prompts and 1024-token
#            completions (17408 packed tokens a group, past the dense-mask limit): prompt_sharing
#            auto (cascade attention now; flex when its results were taken) against expanded
#            (prompt_sharing=false), 3 steps each
# Usage: bash experiments/run_grpo_gpu.sh OUT_DIR SECTION...
set -uo pipefail
out=${1:?usage: run_grpo_gpu.sh OUT_DIR SECTION...}
shift
mkdir -p "$out"
bench() { timeout "$1" python3 benchmarks/bench_grpo.py "${@:2}" 2>&1 | grep -v -i warn | tail -n 40; }
trl() { timeout "$1" python3 benchmarks/bench_trl_grpo.py "${@:2}" --out "$out/trl_grpo.csv" 2>&1 | tail -n 1; }
# recipe TAG SECONDS OVERRIDE...: configs/qwen_grpo.yaml on random weights and synthetic prompts, its log
# in $out/grpo_TAG.log, its metrics in $out/grpo_TAG_metrics.txt; prints the exit status
recipe() {
    local tag=$1 limit=$2 dir=/tmp/logitless_grpo_$1
    shift 2
    rm -rf "$dir"
    timeout "$limit" python3 -m grpo_single_device --config configs/qwen_grpo.yaml \
        model_init=random tokenizer._component_=logitless.datasets.synthetic_tokenizer \
        dataset._component_=logitless.rl.prompts.synthetic_prompt_dataset eval_every_n_steps=null \
        save_every_n_steps=1000 output_dir="$dir" "$@" > "$out/grpo_$tag.log" 2>&1
    echo "$tag rc=$?"
    cat "$dir"/logs/*.txt > "$out/grpo_${tag}_metrics.txt" 2>/dev/null
}
# metrics TAG FIELDS: the logged fields matching the regex FIELDS, one line per step
metrics() {
    grep -h -o "Step [0-9]* |.*" "$out/grpo_$1_metrics.txt" | tr '|' '\n' | grep -E "^Step|$2" | tr '\n' ' ' \
        | sed 's/Step/\nStep/g'
    echo
}

for section in "$@"; do
case $section in
config)
    for impl in chunked triton reference; do
        recipe "config_$impl" 170 max_steps=2 loss.impl=$impl
        metrics "config_$impl" "step_time_s|peak|tokens_per_second|time/"
    done ;;
step)
    bench 330 --models 0.5b,1.5b --generator fast --steps 2 \
        --impls no_head,chunked,triton,full_logits,triton+prompt_once,triton+prompt_once_flex \
        --out "$out/grpo_step.csv"
    trl 120 --model 0.5b --steps 3
    trl 150 --model 1.5b --steps 3 ;;
grid)
    bench 560 --update-only --models ${GRID_MODELS:-0.5b,1.5b,7b} --G 8,16 --prompt-len 256,1024 --completion-len 512,2048 \
        --micro-batch-size G --steps 1 --impls no_head,full_logits,chunked,triton,triton+prompt_once \
        --out "$out/grpo_update_grid_$(echo ${GRID_MODELS:-all} | tr , _).csv" ;;
limits)
    bench 200 --update-only --models 0.5b --G 16 --prompt-len 1024 --completion-len 512 \
        --micro-batch-size G --steps 1 --impls chunked,triton,triton+prompt_once --search-limits \
        --max-G 1024 --max-completion-len 32768 --out "$out/grpo_limits.csv"
    trl 150 --model 0.5b --steps 1 --group 256
    trl 190 --model 0.5b --steps 1 --completion-len 4096 ;;
longgroup)
    for mode in auto false; do
        recipe "longgroup_$mode" 280 dataset.prompt_len=1024 max_steps=3 prompts_per_step=2 num_generations=16 \
            micro_batch_size=16 generation.max_new_tokens=1024 prompt_sharing=$mode
        metrics "longgroup_$mode" "prompt_sharing|step_time_s|time/|peak_memory_alloc"
    done ;;
rollout_recipe)
    recipe rollout_sdpa 180 max_steps=3 generation.decode_attention=sdpa
    recipe rollout_split_k 180 max_steps=3 generation.decode_attention=split_k
    recipe rollout_split_k_compiled 180 max_steps=3 generation.decode_attention=split_k compile=true
    for tag in rollout_sdpa rollout_split_k rollout_split_k_compiled; do
        echo "$tag"; metrics "$tag" "step_time_s|time/|update_mfu|peak_memory_alloc"
    done ;;
update_profile)
    for flag in "" --compile; do
        name=${flag#--}
        bench 270 --update-only --models 1.5b,7b --G 8 --prompt-len 1024 --completion-len 512 --micro-batch-size G \
            --steps 1 --impls triton+prompt_once --profile-update $flag \
            --out "$out/grpo_update_${name:-eager}.csv"
    done ;;
cascade)
    for ac in activation-checkpointing no-activation-checkpointing; do
        bench 130 --update-only --models 1.5b,7b --G 8 --prompt-len 1024 --completion-len 512 --micro-batch-size G \
            --steps 2 --impls triton+prompt_once_cascade,triton+prompt_once --profile-update --compile --$ac \
            --out "$out/grpo_update_cascade_$ac.csv"
    done ;;
qwen_grpo)
    recipe qwen_grpo 150 max_steps=4
    recipe qwen_grpo_ac 150 max_steps=4 enable_activation_checkpointing=true micro_batch_size=8
    for tag in qwen_grpo qwen_grpo_ac; do
        echo "$tag"; metrics "$tag" "step_time_s|time/|update_mfu|peak_memory_alloc"
    done ;;
generation)
    timeout 260 python3 benchmarks/bench_generation_libraries.py --models qwen2.5-0.5b,qwen2.5-1.5b --prompt-lens 1024 \
        --new-tokens 512 --prompts 4 --groups 16 --out "$out/generation.csv" 2>&1 | tail -n 14 ;;
*) echo "unknown section $section" ;;
esac
done
