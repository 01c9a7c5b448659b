"""One GRPO step (generation + policy update) of our recipe's code path, per log-prob implementation.

Random-weight Qwen2.5 models (no download), one prompt of ``--prompt-len`` random tokens, ``--G``
completions of exactly ``--completion-len`` tokens (no stop token can end them early), rewards drawn
at random (the compute does not depend on them), then the update: policy forward + backward over the
G completions in micro-batches with activation checkpointing, AdamW step, bf16 weights. For each
model and each log-prob path it reports the time of the generation, of the update and of the whole
step, and the peak CUDA memory of the step (weights and optimizer state included):

- ``chunked``: ``logitless.linear_log_probs(impl="chunked")`` (bounded memory, PyTorch)
- ``triton``:  ``impl="triton"`` (the fused kernels)
- ``full_logits``: ``impl="torch"``, the plain path that materialises the ``[N, V]`` logits, as
  TRL and most RL libraries do
- ``chunked+prompt_once`` / ``triton+prompt_once`` (``+prompt_once_flex``: FlexAttention block mask,
  CUDA only): the same heads with each group packed as
  ``[prompt | completion 1 | ... | completion G]`` (``logitless.rl.shared_batch``, the recipe's
  ``prompt_sharing: true``): the prompt is run once per group; one micro-batch of the whole group
  (G completions, one packed sequence of prompt + G x completion tokens)

Every path runs the head on completion positions only (response-only head).

TRL is measured in the same run only when it is importable (``trl``); otherwise the CSV says so.

    python benchmarks/bench_grpo.py                          # GPU: 0.5B and 1.5B, G=16, 1024 + 512
    python benchmarks/bench_grpo.py --search-limits          # + largest G / completion length that fit
    python benchmarks/bench_grpo.py --models tiny --device cpu --G 4 --prompt-len 16 --completion-len 8
    python benchmarks/bench_grpo.py --impls chunked,triton,triton+prompt_once,triton+prompt_once_flex
"""

import argparse
import csv
import gc
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "components")]

from logitless.losses.grpo import GRPOLoss  # noqa: E402
from logitless.rl.advantages import group_advantages  # noqa: E402
from logitless.rl import fast_generation  # noqa: E402
from logitless.rl.generation import generate  # noqa: E402
from logitless.rl.reference import ReferencePolicy  # noqa: E402
from logitless.rl.shared_batch import training_batch  # noqa: E402
from logitless.rl.update import grpo_update  # noqa: E402

IMPLS = {"chunked": "chunked", "triton": "triton", "full_logits": "torch"}
SHARING = {"": (False, "sdpa"), "+prompt_once": (True, "sdpa"), "+prompt_once_flex": (True, "flex")}


def parse_impl(name: str):
    """``"triton+prompt_once"`` -> ``("triton", True, "sdpa")``: GRPOLoss impl, prompt sharing, its attention."""
    base, plus, suffix = name.partition("+")
    if base not in IMPLS or plus + suffix not in SHARING:
        raise ValueError(f"--impls: unknown {name!r}; choose from {sorted(IMPLS)}, each optionally with "
                         f"{sorted(k for k in SHARING if k)}")
    return (IMPLS[base], *SHARING[plus + suffix])


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    from torchtune import training

    if name == "tiny":
        from logitless.models import qwen2_5_tiny as builder
    elif name == "0.5b":
        from torchtune.models.qwen2_5 import qwen2_5_0_5b as builder
    elif name == "1.5b":
        from torchtune.models.qwen2_5 import qwen2_5_1_5b_instruct as builder
    else:
        raise ValueError(f"--models: unknown model {name!r} (tiny, 0.5b, 1.5b)")
    with training.set_default_dtype(dtype), device:
        model = builder()
    with torch.no_grad():  # HF-style init scale: a spread-out sampling distribution
        model.tok_embeddings.weight.normal_(0, 0.02)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(model, loss_fn, optimizer, args, device, seed, prompt_sharing=False, attention="sdpa", reference=None):
    vocab = model.tok_embeddings.num_embeddings
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist()
    gen = torch.Generator(device=device).manual_seed(seed)
    sync(device)
    t0 = time.perf_counter()
    # a stop token outside the vocabulary: every completion has exactly completion_len tokens
    sampler = fast_generation.generate if args.generator == "fast" else generate
    rollout = sampler(model, [prompt], max_new_tokens=args.completion_len, stop_tokens=[vocab], pad_id=0,
                      num_generations=args.G, temperature=1.0, generator=gen)
    sync(device)
    t1 = time.perf_counter()
    rewards = torch.rand(args.G, generator=g)
    adv = group_advantages(rewards, args.G).to(device)
    batch = training_batch(rollout, prompt_sharing=prompt_sharing, pad_id=0, attention=attention)
    mbs = args.G if prompt_sharing else args.micro_batch_size
    metrics = grpo_update(model, loss_fn, optimizer, batch, adv, micro_batch_size=mbs, clip_grad_norm=1.0,
                          num_iterations=args.num_iterations, reference=reference)
    sync(device)
    t2 = time.perf_counter()
    assert rollout.completion_tokens.shape[1] == args.completion_len
    return t1 - t0, t2 - t1, metrics


def run_model(name, args, device, dtype, writer):
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    model = build_model(name, device, dtype)
    training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    reference = ReferencePolicy.frozen_copy(model) if args.beta > 0 else None
    for impl_name in args.impls:
        impl, shared, attention = parse_impl(impl_name)
        row = dict(model=name, impl=impl_name, generator=args.generator, G=args.G, prompt_len=args.prompt_len,
                   completion_len=args.completion_len,
                   micro_batch_size=args.G if shared else args.micro_batch_size,
                   prompt_sharing=shared, beta=args.beta, num_iterations=args.num_iterations,
                   device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                   torch=torch.__version__)
        try:
            loss_fn = GRPOLoss(temperature=1.0, impl=impl, loss_type="dapo", beta=args.beta)
            loss_fn.set_model_output(model)
            kw = dict(prompt_sharing=shared, attention=attention, reference=reference)
            one_step(model, loss_fn, optimizer, args, device, seed=0, **kw)  # warm-up (optimizer state, kernels)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times = [one_step(model, loss_fn, optimizer, args, device, seed=1 + i, **kw) for i in range(args.steps)]
            gen_s = min(t[0] for t in times)
            upd_s = min(t[1] for t in times)
            row.update(status="ok", generation_s=round(gen_s, 4), update_s=round(upd_s, 4),
                       step_s=round(gen_s + upd_s, 4),
                       peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
                       if device.type == "cuda" else "")
        except Exception as e:  # e.g. OOM of the full-logits path, triton unavailable on CPU
            row.update(status=f"error: {type(e).__name__}: {str(e)[:200]}")
            optimizer.zero_grad(set_to_none=True)
        print(row, flush=True)
        writer.writerow(row)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del model, optimizer, reference


def fits(model, loss_fn, optimizer, args, device, G, completion_len) -> bool:
    """Whether one GRPO step at ``G`` completions of ``completion_len`` tokens runs without OOM."""
    trial = argparse.Namespace(**{**vars(args), "G": G, "completion_len": completion_len})
    try:
        one_step(model, loss_fn, optimizer, trial, device, seed=7)
        return True
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        return False
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def search_limits(name, args, device, dtype, writer):
    """Largest G (at --completion-len) and completion length (at --G) that fit, doubling until OOM."""
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    model = build_model(name, device, dtype)
    training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    for impl_name in args.impls:
        impl, shared, _ = parse_impl(impl_name)
        if shared:
            continue  # the limit search measures the expanded paths only
        loss_fn = GRPOLoss(temperature=1.0, impl=impl, loss_type="dapo")
        loss_fn.set_model_output(model)
        best_g, g = None, args.G
        while g <= args.max_G and fits(model, loss_fn, optimizer, args, device, g, args.completion_len):
            best_g, g = g, g * 2
        best_l, length = None, args.completion_len
        while length <= args.max_completion_len and fits(model, loss_fn, optimizer, args, device, args.G, length):
            best_l, length = length, length * 2
        row = dict(model=name, impl=impl_name, status=f"limits: max G={best_g} at completion_len={args.completion_len}"
                   f"; max completion_len={best_l} at G={args.G} (doubling, capped at G<={args.max_G}, "
                   f"len<={args.max_completion_len})", G=args.G, prompt_len=args.prompt_len,
                   completion_len=args.completion_len, micro_batch_size=args.micro_batch_size)
        print(row, flush=True)
        writer.writerow(row)
    del model, optimizer


def trl_row(args):
    try:
        import trl  # noqa: F401
    except ImportError:
        return dict(model="all", impl="trl", status="missing: trl is not importable in this environment",
                    G=args.G, prompt_len=args.prompt_len, completion_len=args.completion_len)
    return dict(model="all", impl="trl", status=f"installed (trl {trl.__version__}) but not run by this script: "
                f"use TRL's GRPOTrainer with the same settings", G=args.G)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="0.5b,1.5b")
    p.add_argument("--impls", default="chunked,triton,full_logits,triton+prompt_once")
    p.add_argument("--G", type=int, default=16)
    p.add_argument("--generator", default="eager", choices=("eager", "fast"),
                   help="sampler: rl.generation (eager) or rl.fast_generation (static cache, compiled decode)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--beta", type=float, default=0.0, help="KL weight: > 0 adds the reference forward")
    p.add_argument("--num-iterations", type=int, default=1, help="> 1 adds the old log-prob forward")
    p.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step (min is kept)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/grpo_step.csv"))
    p.add_argument("--search-limits", action="store_true",
                   help="also find the largest G and completion length that fit (doubling until OOM)")
    p.add_argument("--max-G", type=int, default=512)
    p.add_argument("--max-completion-len", type=int, default=16384)
    args = p.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i]
    for i in args.impls:
        try:
            parse_impl(i)
        except ValueError as e:
            p.error(str(e))
    if args.G < 2 or args.G % args.micro_batch_size:
        p.error(f"--G must be >= 2 and divisible by --micro-batch-size, got G={args.G}, "
                f"micro_batch_size={args.micro_batch_size}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fields = ["model", "impl", "generator", "status", "generation_s", "update_s", "step_s", "peak_gib", "G", "prompt_len",
              "completion_len", "micro_batch_size", "prompt_sharing", "beta", "num_iterations", "device", "torch"]
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for name in [m for m in args.models.split(",") if m]:
            run_model(name, args, device, dtype, writer)
            f.flush()
            if args.search_limits:
                search_limits(name, args, device, dtype, writer)
                f.flush()
        row = trl_row(args)
        print(row)
        writer.writerow(row)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
