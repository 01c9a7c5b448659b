"""One GRPO step (generation + policy update) of our recipe's code path, per log-prob implementation.

Random-weight models (no download; Qwen2.5 by default, ``--models qwen3_1_7b`` and any other
``logitless.models.MODELS`` key), one prompt of ``--prompt-len`` random tokens, ``--G``
completions of exactly ``--completion-len`` tokens (no stop token can end them early), rewards drawn
at random (the compute does not depend on them), then the update: policy forward + backward over the
G completions in micro-batches with activation checkpointing (``--no-activation-checkpointing``:
without), AdamW step, bf16 weights. For each
model and each log-prob path it reports the time of the generation, of the update and of the whole
step, and the peak CUDA memory of the step (weights and optimizer state included):

- ``chunked``: ``logitless.linear_log_probs(impl="chunked")`` (bounded memory, PyTorch)
- ``triton``:  ``impl="triton"`` (the fused kernels)
- ``full_logits``: ``impl="reference"``, the plain path that materialises the ``[N, V]`` logits, as
  TRL and most RL libraries do
- ``chunked+prompt_once`` / ``triton+prompt_once`` (dense-mask SDPA; ``+prompt_once_flex``:
  FlexAttention block mask, CUDA only; ``+prompt_once_cascade``: cascade attention, the recipes'
  ``prompt_sharing_attention: auto``): the same heads with each group packed as
  ``[prompt | completion 1 | ... | completion G]`` (``logitless.rl.shared_batch``, the recipe's
  ``prompt_sharing: true``): the prompt is run once per group; one micro-batch of the whole group
  (G completions, one packed sequence of prompt + G x completion tokens)

- ``no_head``: the loss is a trivial function of the final hidden states and the head weight (mean
  of squares: both get gradients, no logits exist); the other rows' ``head_update_s`` /
  ``head_update_gib`` are their difference to it (the head's overhead)

``update_tflop`` / ``update_mfu``: the update's model FLOPs and their share of the GPU's peak bf16
FLOP/s over ``update_s`` (``logitless.training.flops``; blank on a GPU outside its table and for
``no_head``, which skips the head the count includes).

Every path runs the head on completion positions only (response-only head). ``--G``,
``--prompt-len`` and ``--completion-len`` take comma lists: every combination is measured.
``--compile`` compiles the policy's layers as the recipes' ``compile: True`` does (torchtune's per-layer
``torch.compile``, after activation checkpointing). ``--profile-update`` runs one more update of each
row under ``torch.profiler`` (CUDA) and writes where its time went (``benchmarks/kernel_breakdown.py``:
GEMMs, attention, our head kernels, fused / eager elementwise, optimizer, copies, idle) to
``--profile-out``, to explain ``update_mfu``.

``--update-only`` skips the sampler (the update's cost does not depend on the sampled token ids:
random completions of exactly ``--completion-len`` tokens stand in for them), which makes the grid
of the GRPO table affordable. Memory columns: ``static_gib`` (weights + optimizer state before the step),
``update_peak_gib`` (peak of the update alone) and ``peak_gib`` (peak of the whole step).

TRL is measured in the same run only when it is importable (``trl``); otherwise the CSV says so.

    python benchmarks/bench_grpo.py                          # GPU: 0.5B and 1.5B, G=16, 1024 + 512
    python benchmarks/bench_grpo.py --search-limits          # + largest G / completion length that fit
    python benchmarks/bench_grpo.py --models tiny --device cpu --G 4 --prompt-len 16 --completion-len 8
    python benchmarks/bench_grpo.py --models qwen3_1_7b --generator fast --impls triton,triton+prompt_once
    python benchmarks/bench_grpo.py --impls chunked,triton,triton+prompt_once,triton+prompt_once_flex
    python benchmarks/bench_grpo.py --update-only --models 0.5b,1.5b,7b --G 8,16 --prompt-len 256,1024 \
        --completion-len 512,2048 --micro-batch-size G --impls no_head,full_logits,chunked,triton,triton+prompt_once
    python benchmarks/bench_grpo.py --update-only --models 1.5b,7b --G 8 --micro-batch-size G \
        --impls triton+prompt_once --profile-update          # + --compile: the same with compiled layers
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_generation module

from logitless.losses.grpo import GRPOLoss  # noqa: E402
from logitless.rl.advantages import group_advantages  # noqa: E402
from logitless.rl.metrics import update_flops  # noqa: E402
from logitless.generation import compiled  # noqa: E402
from logitless.losses._base import as_head_input  # noqa: E402
from logitless.generation import Rollout, generate  # noqa: E402
from logitless.rl.reference import ReferencePolicy  # noqa: E402
from logitless.rl.shared_batch import training_batch  # noqa: E402
from logitless.rl.update import grpo_update  # noqa: E402
from logitless.training.flops import DecoderFlops, mfu, peak_bf16_flops  # noqa: E402
from logitless.training.model import compile_layers  # noqa: E402
from bench_generation import run_metadata  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from kernel_breakdown import CATEGORIES, breakdown, profile_kernels  # noqa: E402

IMPLS = {"chunked": "chunked", "triton": "triton", "full_logits": "reference", "no_head": "no_head"}
SHARING = {"": (False, "sdpa"), "+prompt_once": (True, "sdpa"), "+prompt_once_flex": (True, "flex"),
           "+prompt_once_cascade": (True, "cascade")}


def parse_impl(name: str):
    """``"triton+prompt_once"`` -> ``("triton", True, "sdpa")``: GRPOLoss impl, prompt sharing, its attention."""
    base, plus, suffix = name.partition("+")
    if base not in IMPLS or plus + suffix not in SHARING:
        raise ValueError(f"--impls: unknown {name!r}; choose from {sorted(IMPLS)}, each optionally with "
                         f"{sorted(k for k in SHARING if k)}")
    return (IMPLS[base], *SHARING[plus + suffix])


class NoHeadLoss(GRPOLoss):
    """The update without an LM head: mean of squares of the final hidden states and of the head
    weight, so both still get gradients but no logits exist (the baseline of the head overhead)."""

    def __init__(self, **kwargs):
        super().__init__(impl="chunked", **kwargs)

    def forward(self, outputs, labels, advantages, *, truncated=None, **_):
        head = as_head_input(outputs, type(self).__name__)
        loss = head.hidden.float().pow(2).mean() + head.weight.float().pow(2).mean()
        return loss, {"num_tokens": self.loss_mask(labels, truncated).sum()}

    def log_probs(self, outputs, labels):
        head = as_head_input(outputs, type(self).__name__)
        return head.hidden.float().pow(2).mean(-1).detach()


def make_loss(impl: str, beta: float) -> GRPOLoss:
    if impl == "no_head":
        return NoHeadLoss(temperature=1.0, loss_type="dapo", beta=beta)
    return GRPOLoss(temperature=1.0, impl=impl, loss_type="dapo", beta=beta)


def synthetic_rollout(prompt, G: int, completion_len: int, vocab: int, device, generator) -> Rollout:
    """G random completions of exactly ``completion_len`` tokens for one prompt (no sampler)."""
    prompt_tokens = torch.tensor([prompt] * G, device=device)
    completions = torch.randint(0, vocab - 1, (G, completion_len), generator=generator).to(device)
    return Rollout(prompt_tokens=prompt_tokens, prompt_mask=torch.ones_like(prompt_tokens, dtype=torch.bool),
                   completion_tokens=completions, completion_mask=torch.ones_like(completions, dtype=torch.bool),
                   truncated=torch.ones(G, dtype=torch.bool, device=device),
                   sampler_log_probs=torch.zeros(G, completion_len, device=device), num_generations=G)


#: --models names of the Qwen2.5 rows; any other logitless.models.MODELS key works too (qwen3_1_7b, llama3_2_1b, ...)
QWEN2_5_MODELS = {"tiny": "tiny", "0.5b": "qwen2_5_0_5b", "1.5b": "qwen2_5_1_5b", "7b": "qwen2_5_7b"}


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    from torchtune import training

    from logitless.models import MODELS, named_builder

    key = QWEN2_5_MODELS.get(name, name)
    if key not in MODELS:
        raise ValueError(f"--models: unknown model {name!r}; expected one of {sorted(QWEN2_5_MODELS)} or a "
                         f"logitless.models.MODELS key {sorted(MODELS)}")
    builder = named_builder(key)
    with training.set_default_dtype(dtype), device:
        model = builder()
    with torch.no_grad():  # HF-style init scale: a spread-out sampling distribution
        model.tok_embeddings.weight.normal_(0, 0.02)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gib(nbytes: int) -> float:
    return round(nbytes / 2**30, 3)


def micro_batch_size(setting: str, G: int, shared: bool) -> int:
    """Completions per micro-batch: a whole group for prompt sharing, else ``--micro-batch-size``."""
    return G if shared or setting == "G" else int(setting)


def one_step(model, loss_fn, optimizer, cfg, device, seed, prompt_sharing=False, attention="sdpa", reference=None):
    """One GRPO step at ``cfg`` (G, prompt_len, completion_len, ...); returns times and peaks."""
    vocab = model.tok_embeddings.num_embeddings
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab - 1, (cfg.prompt_len,), generator=g).tolist()
    cuda = device.type == "cuda"
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    if cfg.update_only:
        rollout = synthetic_rollout(prompt, cfg.G, cfg.completion_len, vocab, device, g)
    else:
        gen = torch.Generator(device=device).manual_seed(seed)
        # a stop token outside the vocabulary: every completion has exactly completion_len tokens
        sampler = compiled.generate if cfg.generator == "fast" else generate
        rollout = sampler(model, [prompt], max_new_tokens=cfg.completion_len, stop_tokens=[vocab], pad_id=0,
                          num_generations=cfg.G, temperature=1.0, generator=gen)
    sync(device)
    t1 = time.perf_counter()
    gen_peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rewards = torch.rand(cfg.G, generator=g)
    adv = group_advantages(rewards, cfg.G).to(device)
    batch = training_batch(rollout, prompt_sharing=prompt_sharing, pad_id=0, attention=attention)
    metrics = grpo_update(model, loss_fn, optimizer, batch, adv,
                          micro_batch_size=micro_batch_size(cfg.micro_batch_size, cfg.G, prompt_sharing),
                          clip_grad_norm=1.0, num_iterations=cfg.num_iterations, reference=reference)
    sync(device)
    t2 = time.perf_counter()
    update_peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    assert rollout.completion_tokens.shape[1] == cfg.completion_len
    flops = update_flops(DecoderFlops(model), rollout.prompt_mask.sum(1), rollout.completion_lengths, group_size=cfg.G,
                         prompt_once=prompt_sharing, num_iterations=cfg.num_iterations, reference=reference is not None)
    return dict(generation_s=t1 - t0, update_s=t2 - t1, gen_peak=gen_peak, update_peak=update_peak,
                metrics=metrics, update_flops=flops)


def shapes(args):
    """Every (G, prompt_len, completion_len) of the grid, as a config namespace each."""
    for G in args.G:
        for prompt_len in args.prompt_len:
            for completion_len in args.completion_len:
                yield argparse.Namespace(**{**vars(args), "G": G, "prompt_len": prompt_len,
                                            "completion_len": completion_len})


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(model, optimizer, reference, impl_name, cfg, device):
    """One row: warm-up step, then ``cfg.steps`` measured steps (minimum time, maximum peak)."""
    impl, shared, attention = parse_impl(impl_name)
    row = dict(model=cfg.model, impl=impl_name, compile=cfg.compile,
               activation_checkpointing=cfg.activation_checkpointing, generator="none" if cfg.update_only else cfg.generator,
               G=cfg.G, prompt_len=cfg.prompt_len, completion_len=cfg.completion_len,
               micro_batch_size=micro_batch_size(cfg.micro_batch_size, cfg.G, shared),
               prompt_sharing=shared, beta=cfg.beta, num_iterations=cfg.num_iterations,
               **_run_columns(device))
    try:
        loss_fn = make_loss(impl, cfg.beta)
        loss_fn.set_model_output(model)
        kw = dict(prompt_sharing=shared, attention=attention, reference=reference)
        one_step(model, loss_fn, optimizer, cfg, device, seed=0, **kw)  # warm-up (optimizer state, kernels)
        free(device)
        static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        runs = [one_step(model, loss_fn, optimizer, cfg, device, seed=1 + i, **kw) for i in range(cfg.steps)]
        gen_s, upd_s = min(r["generation_s"] for r in runs), min(r["update_s"] for r in runs)
        fastest = min(runs, key=lambda r: r["update_s"])
        # no_head runs no head, so its FLOPs are not the model's: no MFU for it
        utilisation = None if impl_name == "no_head" else mfu(fastest["update_flops"], upd_s, peak_bf16_flops(device))
        row.update(update_tflop=round(fastest["update_flops"] / 1e12, 3),
                   update_mfu="" if utilisation is None else round(utilisation, 3))
        row.update(status="ok", generation_s=round(gen_s, 4), update_s=round(upd_s, 4),
                   step_s=round(gen_s + upd_s, 4), static_gib=gib(static),
                   update_peak_gib=gib(max(r["update_peak"] for r in runs)),
                   peak_gib=gib(max(max(r["update_peak"], r["gen_peak"]) for r in runs)))
        if cfg.profile_update and device.type == "cuda":
            row["profile"] = profile_update(model, loss_fn, optimizer, cfg, device, fastest["update_flops"], **kw)
    except torch.OutOfMemoryError:
        row.update(status="OOM")
    except Exception as e:  # e.g. triton unavailable on CPU, flex without CUDA
        row.update(status=f"error: {type(e).__name__}: {str(e)[:200]}")
    optimizer.zero_grad(set_to_none=True)
    free(device)
    return row


def profile_update(model, loss_fn, optimizer, cfg, device, flops, **kw):
    """One more update (random completions, as ``--update-only``) under ``torch.profiler``: its wall
    time split by kernel category, in milliseconds, and its MFU over that wall time."""
    update_cfg = argparse.Namespace(**{**vars(cfg), "update_only": True})
    kernels, wall_us = profile_kernels(lambda: one_step(model, loss_fn, optimizer, update_cfg, device, seed=99, **kw),
                                       device)
    split = breakdown(kernels, wall_us)
    out = {c: round(split[c] / 1e3, 2) for c in (*CATEGORIES, "idle")}
    utilisation = mfu(flops, wall_us / 1e6, peak_bf16_flops(device))
    out.update(wall_ms=round(wall_us / 1e3, 2), kernels=len(kernels),
               profiled_mfu="" if utilisation is None else round(utilisation, 3),
               top_kernels="; ".join(f"{name[:60]}={us / 1e3:.1f}" for name, us in split["top"]))
    return out


def add_head_overhead(rows):
    """``head_update_s`` / ``head_update_gib``: each row minus the ``no_head`` row of its shape."""
    base = {(r["G"], r["prompt_len"], r["completion_len"], r["prompt_sharing"]): r
            for r in rows if r["impl"] == "no_head" and r["status"] == "ok"}
    for r in rows:
        b = base.get((r["G"], r["prompt_len"], r["completion_len"], False))
        if b is not None and r["status"] == "ok":
            r["head_update_s"] = round(r["update_s"] - b["update_s"], 4)
            r["head_update_gib"] = round(r["update_peak_gib"] - b["update_peak_gib"], 3)
    return rows


def build_policy(name, args, device, dtype):
    from torchtune import training
    from torchtune.modules import TransformerSelfAttentionLayer

    model = build_model(name, device, dtype)
    if args.activation_checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    if args.compile:  # after activation checkpointing, as the recipes' wrap_model does
        compile_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    reference = ReferencePolicy.frozen_copy(model) if args.beta > 0 else None
    return model, optimizer, reference


def run_model(name, args, device, dtype, writer, profile_writer=None):
    model, optimizer, reference = build_policy(name, args, device, dtype)
    for cfg in shapes(argparse.Namespace(**{**vars(args), "model": name})):
        rows = [measure(model, optimizer, reference, impl_name, cfg, device) for impl_name in args.impls]
        for row in add_head_overhead(rows):
            profile = row.pop("profile", None)
            print({k: v for k, v in row.items() if k not in _RUN_COLUMNS}, flush=True)
            writer.writerow(row)
            if profile is not None and profile_writer is not None:
                print_profile(row, profile)
                profile_writer.writerow({**{k: row[k] for k in PROFILE_KEYS}, **profile})
    del model, optimizer, reference
    free(device)


def fits(model, loss_fn, optimizer, args, device, shared, attention, G, completion_len) -> bool:
    """Whether one GRPO step at ``G`` completions of ``completion_len`` tokens runs without OOM."""
    trial = argparse.Namespace(**{**vars(args), "G": G, "completion_len": completion_len})
    try:
        one_step(model, loss_fn, optimizer, trial, device, seed=7, prompt_sharing=shared, attention=attention)
        return True
    except torch.OutOfMemoryError:
        return False
    except ValueError as e:  # prompt sharing: the packed group is longer than the model's max_seq_len
        if "max_seq_len" not in str(e):
            raise
        return False
    finally:
        optimizer.zero_grad(set_to_none=True)
        free(device)


def largest(ok, start: int, cap: int):
    """Largest value that ``ok`` accepts: doubling from ``start`` (up to ``cap``), then bisection."""
    if not ok(start):
        return None
    lo, hi = start, start * 2
    while hi <= cap and ok(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        return lo
    step = max(start // 8, 1)  # bisect to 1/8 of the start value: enough to compare two paths
    while hi - lo > step:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def search_limits(name, args, device, dtype, writer):
    """Largest G (at the first --completion-len) and completion length (at the first --G) that fit.

    With prompt sharing a group is one packed sequence, so its limit is also the model's
    ``max_seq_len`` (32768 for Qwen2.5): the search stops there.
    """
    model, optimizer, _ = build_policy(name, args, device, dtype)
    cfg = argparse.Namespace(**{**vars(args), "G": args.G[0], "prompt_len": args.prompt_len[0],
                                "completion_len": args.completion_len[0], "model": name})
    for impl_name in args.impls:
        impl, shared, attention = parse_impl(impl_name)
        if impl == "no_head":
            continue
        loss_fn = make_loss(impl, 0.0)
        loss_fn.set_model_output(model)
        g_step = cfg.G if shared else micro_batch_size(cfg.micro_batch_size, cfg.G, False)
        # G must stay a multiple of the micro-batch: search in units of it
        best_units = largest(lambda u: fits(model, loss_fn, optimizer, cfg, device, shared, attention,
                                            u * g_step, cfg.completion_len), max(cfg.G // g_step, 1),
                             args.max_G // g_step)
        best_len = largest(lambda n: fits(model, loss_fn, optimizer, cfg, device, shared, attention, cfg.G, n),
                           cfg.completion_len, args.max_completion_len)
        row = dict(model=name, impl=impl_name, generator="none" if cfg.update_only else cfg.generator,
                   status="limits", G=cfg.G, prompt_len=cfg.prompt_len, completion_len=cfg.completion_len,
                   micro_batch_size=micro_batch_size(cfg.micro_batch_size, cfg.G, shared), prompt_sharing=shared,
                   max_G=None if best_units is None else best_units * g_step, max_completion_len=best_len,
                   **_run_columns(device))
        print({k: v for k, v in row.items() if k not in _RUN_COLUMNS}, flush=True)
        writer.writerow(row)
    del model, optimizer
    free(device)


def int_list(text: str):
    return [int(x) for x in str(text).split(",") if x]


#: The columns of a profile row that name its configuration (the rest is :func:`profile_update`'s).
PROFILE_KEYS = ("model", "impl", "compile", "activation_checkpointing", "G", "prompt_len", "completion_len", "micro_batch_size",
                "update_s", "update_mfu", "device", "torch", "triton", "torchtune", "date")


_RUN_COLUMNS = ("device", "torch", "triton", "torchtune", "date")


def _run_columns(device: torch.device) -> dict:
    """The device, versions and date every CSV row carries."""
    meta = run_metadata(device)
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                torch=meta["torch"], triton=meta["triton"], torchtune=meta["torchtune"], date=meta["date"])


def print_profile(row, profile):
    parts = " + ".join(f"{c} {profile[c]:.1f}" for c in (*CATEGORIES, "idle") if profile[c] >= 0.05)
    print(f"update profile {row['model']} {row['impl']} compile={row['compile']}: {profile['wall_ms']:.1f} ms = "
          f"{parts} (ms; MFU over it {profile['profiled_mfu']})\n    top: {profile['top_kernels']}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="0.5b,1.5b")
    p.add_argument("--impls", default="chunked,triton,full_logits,triton+prompt_once")
    p.add_argument("--G", type=int_list, default=[16], help="completions per prompt (comma list)")
    p.add_argument("--generator", default="eager", choices=("eager", "fast"),
                   help="sampler: generation.eager or generation.compiled (static cache, compiled decode)")
    p.add_argument("--update-only", action="store_true", help="random completions instead of sampling")
    p.add_argument("--prompt-len", type=int_list, default=[1024], help="comma list")
    p.add_argument("--completion-len", type=int_list, default=[512], help="comma list")
    p.add_argument("--micro-batch-size", default="4",
                   help="completions per micro-batch of the expanded paths, or G (one group)")
    p.add_argument("--beta", type=float, default=0.0, help="KL weight: > 0 adds the reference forward")
    p.add_argument("--num-iterations", type=int, default=1, help="> 1 adds the old log-prob forward")
    p.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step (min is kept)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/grpo_step.csv"))
    p.add_argument("--search-limits", action="store_true",
                   help="also find the largest G and completion length that fit (doubling, then bisection)")
    p.add_argument("--max-G", type=int, default=512)
    p.add_argument("--max-completion-len", type=int, default=16384)
    p.add_argument("--compile", action="store_true", help="compile the policy's layers (the recipes' compile: True)")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each layer in the backward (the recipes' enable_activation_checkpointing)")
    p.add_argument("--profile-update", action="store_true",
                   help="profile one more update per row (CUDA): time per kernel category, to --profile-out")
    p.add_argument("--profile-out", default=None,
                   help="CSV of the update profiles (default: --out with _profile before .csv)")
    args = p.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i]
    for i in args.impls:
        try:
            parse_impl(i)
        except ValueError as e:
            p.error(str(e))
    if args.micro_batch_size != "G" and not args.micro_batch_size.isdigit():
        p.error(f"--micro-batch-size must be a positive int or G, got {args.micro_batch_size!r}")
    for G in args.G:
        mbs = micro_batch_size(args.micro_batch_size, G, False)
        if G < 2 or mbs < 1 or G % mbs:
            p.error(f"--G must be >= 2 and divisible by --micro-batch-size, got G={G}, micro_batch_size={mbs}")
    device = torch.device(args.device)
    if args.profile_update and device.type != "cuda":
        p.error(f"--profile-update profiles CUDA kernels; --device is {args.device!r}")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fields = ["model", "impl", "compile", "activation_checkpointing", "generator", "status", "generation_s", "update_s", "update_tflop", "update_mfu",
              "step_s", "head_update_s",
              "static_gib", "update_peak_gib", "peak_gib", "head_update_gib", "max_G", "max_completion_len",
              "G", "prompt_len", "completion_len", "micro_batch_size", "prompt_sharing", "beta",
              "num_iterations", "device", "torch", "triton", "torchtune", "date"]
    profile_out = args.profile_out or str(Path(args.out).with_name(Path(args.out).stem + "_profile.csv"))
    profile_fields = [*PROFILE_KEYS, "wall_ms", *CATEGORIES, "idle", "profiled_mfu", "kernels", "top_kernels"]
    with open(args.out, "w", newline="") as f, \
            (open(profile_out, "w", newline="") if args.profile_update else open(os.devnull, "w")) as pf:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        write_row = writer.writerow
        writer.writerow = lambda row: (write_row(row), f.flush())  # rows survive a timeout
        profile_writer = csv.DictWriter(pf, fieldnames=profile_fields, extrasaction="ignore")
        profile_writer.writeheader()
        for name in [m for m in args.models.split(",") if m]:
            run_model(name, args, device, dtype, writer, profile_writer)
            f.flush()
            if args.search_limits:
                search_limits(name, args, device, dtype, writer)
                f.flush()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
