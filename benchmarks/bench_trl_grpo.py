"""TRL's GRPOTrainer step time and peak memory, for a side-by-side with our GRPO recipe.

The setting of the GRPO step table: random-weight Qwen2.5 (0.5B or 1.5B architecture), one
1024-token prompt per step, G=16 completions of 512 tokens (no early stop), beta=0, loss_type dapo,
gradient checkpointing, bf16. Runs offline: the model is built from a config and the tokenizer is
the bundled tiny BPE one (token ids only matter for shapes). Needs ``trl`` (carried as a wheel).

Usage (GPU machine):
    python benchmarks/bench_trl_grpo.py --model 0.5b --steps 4 --out benchmarks/results/trl_grpo.csv
    python benchmarks/bench_trl_grpo.py --model 0.5b --steps 1 --group 64     # limit probe: ok or OOM
"""

import argparse
import csv
import os
import tempfile
import time

import torch

SIZES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, tie_word_embeddings=True),
}


def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    from logitless.datasets import TINY_TOKENIZER_DIR

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(TINY_TOKENIZER_DIR, "tokenizer.json"))
    tok.pad_token, tok.eos_token = "<|endoftext|>", "<|im_end|>"
    tok.padding_side = "left"
    return tok


def _prompt(tok, length: int) -> str:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(300, 2000, (length,), generator=g).tolist()
    return tok.decode(ids)


class _StepTimer:
    def __init__(self):
        self.times, self.peaks, self._t0 = [], [], None

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                timer._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                torch.cuda.synchronize()
                timer.times.append(time.perf_counter() - timer._t0)
                timer.peaks.append(torch.cuda.max_memory_allocated() / 2**30)

        return _CB()


def run(model_size: str, steps: int, group: int, prompt_len: int, completion_len: int, liger: bool):
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tok = _tokenizer()
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                         **SIZES[model_size])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None  # completions always run to their maximum length
    prompt = _prompt(tok, prompt_len)
    data = Dataset.from_dict({"prompt": [prompt] * (steps + 2)})

    def reward(completions, **kw):
        return [float(len(c) % 7) for c in completions]

    timer = _StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=group, num_generations=group,
            gradient_accumulation_steps=1, max_completion_length=completion_len, beta=0.0,
            loss_type="dapo", gradient_checkpointing=True, bf16=True, max_steps=steps,
            logging_steps=1, report_to=[], save_strategy="no", use_liger_kernel=liger, seed=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tok, callbacks=[timer.callback()])
        trainer.train()
    # the first step includes warm-up; report the median of the rest
    rest = sorted(timer.times[1:]) or timer.times
    return rest[len(rest) // 2], max(timer.peaks[1:] or timer.peaks)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--liger", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import trl

    try:
        step_s, peak = run(a.model, a.steps, a.group, a.prompt_len, a.completion_len, a.liger)
        status, step_s, peak = "ok", round(step_s, 3), round(peak, 2)
    except torch.OutOfMemoryError:  # a limit probe: "does TRL fit this G / completion length?"
        status, step_s, peak = "OOM", None, None
    row = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, trl=trl.__version__,
               model=a.model, group=a.group, prompt_len=a.prompt_len, completion_len=a.completion_len,
               liger=a.liger, status=status, step_s=step_s, peak_gib=peak)
    print(row)
    if a.out:
        new = not os.path.exists(a.out)
        with open(a.out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            if new:
                w.writeheader()
            w.writerow(row)


if __name__ == "__main__":
    main()
