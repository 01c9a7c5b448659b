"""Decode against the memory-bandwidth roofline: what a GRPO rollout costs per step and per token.

For each model (torchtune Qwen2.5 builders, logitless's Qwen3-1.7B; random bf16 weights), row count
(P prompts x G=16), prompt length and number of new tokens, every sampler samples the same prompts twice:

* ``uniform``: no stop token can fire, every row decodes ``new_tokens`` tokens. Reported per decode
  step: the time (total minus a one-token call's prefill, over ``new_tokens - 1`` steps), the bytes
  a step must read (every weight once, the head included and a tied embedding counted once; the KV
  cache rows actually filled, averaged over the steps), the time those bytes take at the copy
  bandwidth measured in the same run (``roofline_ms``) and the achieved fraction of it.
* ``mix``: a realistic spread of completion lengths: a set of stop tokens holding about
  ``2.82 / new_tokens`` of the probability mass stops each row at a geometric length whose mean
  (capped at ``new_tokens``) is about a third of the maximum; tokens/s counts generated tokens only.

``--decode-attention sdpa,split_k`` runs ``compiled`` and ``unfused`` once per decode attention
(``CompiledSampler(decode_attention=...)``; the CSV's ``decode_attention`` column says which).

Samplers: ``compiled`` (``logitless.generation.CompiledSampler`` with ``fused_projections="shared"``,
as ``configs/qwen_grpo.yaml`` builds it; the class's default is ``False``) and
``baseline`` (the same class with the options that reproduce the sampler before compaction and
in-graph sampling: every row decodes until the longest finishes, sampling runs eagerly). ``unfused``
(``compiled`` with ``fused_projections=False``: separate q/k/v and gate/up GEMMs) and ``eager``
(the reference sampler) are available on request.

``--profile`` runs one configuration under ``torch.profiler`` and prints the top kernels by device
time, the device-busy share of the decode loop (the rest is launch gaps and host work) and the host
syncs; on CUDA also one decode step's kernel time and launches per category and per kernel
(:func:`step_breakdown`).

Example (H200):
    PYTHONPATH=components python benchmarks/bench_generation.py --models 0.5b,1.5b,7b --rows 16,64 \\
        --new-tokens 512,2048
    PYTHONPATH=components python benchmarks/bench_generation.py --models 1.5b --rows 64 --new-tokens 512 \\
        --profile
    PYTHONPATH=components python benchmarks/bench_generation.py --models 0.5b,1.5b --rows 16,64 --new-tokens 512 \\
        --decode-attention sdpa,split_k
    PYTHONPATH=components python benchmarks/bench_generation.py --models qwen3_1_7b --rows 16,64 --new-tokens 512
    PYTHONPATH=components python benchmarks/bench_generation.py --models tiny --device cpu --no-compile  # smoke
"""

import argparse
import contextlib
import csv
import dataclasses
import datetime
import gc
import inspect
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling bench_sft, kernel_breakdown
from bench_sft import _add_columns, append_rows  # noqa: E402

MODELS = {  # name: torchtune builder
    "0.5b": "torchtune.models.qwen2_5.qwen2_5_0_5b",
    "1.5b": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
    "7b": "torchtune.models.qwen2_5.qwen2_5_7b_instruct",
    "qwen3_1_7b": "logitless.models.qwen3_1_7b",
    "tiny": "logitless.models.qwen2_5_tiny",  # CPU smoke test of this script
    "qwen3_tiny": "logitless.models.qwen3_tiny",
}
SAMPLERS = ("compiled", "unfused", "baseline", "eager")
ATTENTIONS = ("sdpa", "split_k")  # CompiledSampler(decode_attention=...)
MIXES = ("uniform", "mix")
#: x with (1 - exp(-x)) / x = 1/3: a per-step stop probability of x / new_tokens gives completions
#: whose mean length, capped at new_tokens, is a third of it.
MIX_RATE = 2.821
FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "model", "sampler", "decode_attention", "options", "mix",
          "prompts", "G", "rows",
          "prompt_len", "new_tokens", "seconds", "prefill_s", "generated", "mean_len", "tokens_per_s",
          "step_ms", "step_gb", "copy_gbps", "roofline_ms", "roofline_frac", "shared_prompt", "step_gb_shared",
          "roofline_shared_ms", "roofline_shared_frac", "compile_s", "status"]
GROUP = 16


def _version(name):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed: report it, do not fail
        return "missing"


def build_model(name, device):
    """A model of the named builder (``MODELS``) with random weights (bf16 on CUDA, fp32 on CPU)."""
    return build_dotted(MODELS[name], device)


def build_dotted(dotted, device, seed=0):
    """A model of the torchtune builder at dotted path ``dotted``, random weights drawn from ``seed``
    (the same in every run: the mix's completion lengths follow the model), eval mode, frozen."""
    import importlib

    from torchtune.training import set_default_dtype

    module, attr = dotted.rsplit(".", 1)
    builder = getattr(importlib.import_module(module), attr)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with set_default_dtype(dtype), device, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model = builder()
    with torch.no_grad():  # nn.Embedding's N(0, 1) -> std 0.02 as HF initialises it (bf16-safe)
        model.tok_embeddings.weight.mul_(0.02)
    return model.eval().requires_grad_(False)


def copy_bandwidth(device, gib=1.0, repeats=10):
    """Bytes per second of a device-to-device copy (read + write), measured now."""
    if device.type != "cuda":
        return float("nan")
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del src, dst
    return 2 * n * 2 * repeats / seconds


def step_bytes(model, rows, prompt_len, new_tokens, group=1):
    """Bytes one decode step must read, averaged over the ``new_tokens - 1`` steps.

    Every weight once (a tied embedding is the head's weight, read once; an untied embedding table
    is only gathered at ``rows`` entries), plus the filled part of the KV cache: the prompt and the
    tokens generated so far, for every row, layer, K and V; with ``group`` > 1 the prompt's entries
    once per group of ``group`` rows (a sampler that reads a shared prompt once).
    """
    from torchtune.modules import MultiHeadAttention, TiedLinear

    seen, weights = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            weights += p.numel() * p.element_size()
    emb = model.tok_embeddings.weight
    if not isinstance(model.output, TiedLinear):
        weights -= emb.numel() * emb.element_size() - rows * emb.shape[1] * emb.element_size()
    attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    per_token = sum(2 * a.num_kv_heads * a.head_dim for a in attns) * emb.element_size()
    # column t holds prompt_len + t entries, t = 1 .. new - 1
    return weights + per_token * (-(-rows // group) * prompt_len + rows * new_tokens / 2)


def mix_stop_tokens(vocab, new_tokens, seed=0):
    """Stop-token ids holding about ``MIX_RATE / new_tokens`` of a near-uniform distribution."""
    count = max(1, round(MIX_RATE * vocab / new_tokens))
    perm = torch.randperm(vocab - 1, generator=torch.Generator().manual_seed(seed)) + 1  # never pad 0
    return perm[:count].tolist()


def parse_options(text):
    """``"a=1,b=None,c=False"`` -> ``{"a": 1, "b": None, "c": False}`` (Python literals)."""
    import ast

    options = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = ast.literal_eval(value.strip())
    return options


def make_samplers(names, compile, cache_len, options=None, attentions=("sdpa",)):
    """``(sampler name, decode attention) -> callable`` with the eager sampler's signature.

    ``options`` go to ``compiled`` and ``unfused``, which are built once per decode attention in
    ``attentions``; ``baseline`` attends with SDPA, ``eager`` with torchtune's layers (``-``).
    """
    from logitless.generation import CompiledSampler, generate

    try:  # the options a CompiledSampler takes (an older checkout: its keyword arguments)
        from logitless.generation import CompiledSamplerConfig

        accepted = {f.name for f in dataclasses.fields(CompiledSamplerConfig)}
    except ImportError:
        accepted = inspect.signature(CompiledSampler).parameters
    # what reproduces the sampler before compaction and in-graph draws, where this version has them
    baseline = {k: v for k, v in dict(compaction=False, draws="generator", attention_window=None).items()
                if k in accepted}
    out = {}
    for name in names:
        for attention in attentions if name in ("compiled", "unfused") else ("sdpa" if name == "baseline" else "-",):
            chosen = {"decode_attention": attention} if "decode_attention" in accepted else {}
            if name == "compiled":
                out[name, attention] = CompiledSampler(compile=compile, max_cache_len=cache_len,
                                                       **{"fused_projections": "shared", **(options or {}), **chosen})
            elif name == "unfused":  # the compiled sampler with the layers' own projections
                out[name, attention] = CompiledSampler(compile=compile, max_cache_len=cache_len,
                                                       **{**(options or {}), **chosen, "fused_projections": False})
            elif name == "baseline":
                out[name, attention] = CompiledSampler(compile=compile, max_cache_len=cache_len, **baseline)
            elif name == "eager":
                out[name, attention] = generate
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    """(seconds, result) of one call."""
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - t0, result


def sample(sampler, model, prompts, new_tokens, stops, seed):
    device = next(model.parameters()).device
    from logitless.generation import prompt_generators

    gens = prompt_generators(seed, 0, range(len(prompts)), device)
    return sampler(model, prompts, max_new_tokens=new_tokens, stop_tokens=stops, pad_id=0,
                   num_generations=GROUP, temperature=1.0, generator=gens)


def bench_config(model, name, sampler_name, sampler, rows, prompt_len, new_tokens, device, bandwidth,
                 attention="sdpa"):
    """Uniform and mixed lengths for one sampler and shape; returns CSV rows."""
    vocab = model.tok_embeddings.num_embeddings
    prompts = torch.randint(1, vocab, (rows // GROUP, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    base = dict(model=name, sampler=sampler_name, decode_attention=attention, prompts=len(prompts), G=GROUP,
                rows=rows, prompt_len=prompt_len, new_tokens=new_tokens, status="ok")
    out = []
    never = [vocab]  # outside the vocabulary: never sampled
    # compile and capture every graph the timed calls use (batch buckets, attention windows): a
    # training run pays this once
    compile_s, _ = timed(lambda: sample(sampler, model, prompts, 4, never, 1), device)
    for stops in (never, mix_stop_tokens(vocab, new_tokens)):
        sample(sampler, model, prompts, new_tokens, stops, 1)
    prefill_s, _ = timed(lambda: sample(sampler, model, prompts, 1, never, 1), device)
    fused = getattr(getattr(sampler, "_state", None), "fused", None)  # DecodeBuffers, kept between calls
    if fused is not None:
        print(f"[{name}] {sampler_name}: concatenated projections hold {fused.nbytes / 2**30:.2f} GiB", flush=True)
    for mix in MIXES:
        row = dict(base, mix=mix, compile_s=round(compile_s, 1) if mix == "uniform" else "")
        try:
            stops = never if mix == "uniform" else mix_stop_tokens(vocab, new_tokens)
            seconds, ro = timed(lambda: sample(sampler, model, prompts, new_tokens, stops, 2), device)
            lengths = ro.completion_lengths.float()
            generated = int(lengths.sum())
            row.update(seconds=round(seconds, 4), prefill_s=round(prefill_s, 4), generated=generated,
                       mean_len=round(float(lengths.mean()), 1), tokens_per_s=round(generated / seconds, 1))
            if mix == "uniform" and new_tokens > 1:
                step = (seconds - prefill_s) / (new_tokens - 1)
                nbytes = step_bytes(model, rows, prompt_len, new_tokens)
                roof = nbytes / bandwidth
                row.update(step_ms=round(step * 1e3, 3), step_gb=round(nbytes / 1e9, 3),
                           copy_gbps=round(bandwidth / 1e9, 1), roofline_ms=round(roof * 1e3, 3),
                           roofline_frac=round(roof / step, 3) if step > 0 else "")
                # what a sampler reading each group's prompt once must read (the fraction above
                # counts every row's copy, as the roofline does)
                shared = step_bytes(model, rows, prompt_len, new_tokens, GROUP) / bandwidth
                row.update(step_gb_shared=round(shared * bandwidth / 1e9, 3), roofline_shared_ms=round(shared * 1e3, 3),
                           roofline_shared_frac=round(shared / step, 3) if step > 0 else "")
            uses = getattr(sampler, "uses_shared_prompt", None)
            row.update(shared_prompt=int(bool(uses and uses(model, device, GROUP, prompt_len))))
        except torch.cuda.OutOfMemoryError:
            row.update(status="OOM")
        except Exception as exc:  # one failing configuration must not hide the others' numbers
            traceback.print_exc()
            row.update(status=f"error: {type(exc).__name__}: {str(exc)[:120]}")
        from torch._dynamo.utils import counters

        print(f"[{name} rows={rows} new={new_tokens} {mix:>7}] {sampler_name:>9} {attention:>7}: "
              f"{row.get('tokens_per_s', '-')} tok/s "
              f"step {row.get('step_ms', '-')} ms roofline {row.get('roofline_frac', '-')} mean_len "
              f"{row.get('mean_len', '-')} {row['status']} (graphs compiled so far "
              f"{counters['stats']['unique_graphs']}, cudagraph skips {counters['inductor']['cudagraph_skips']})",
              flush=True)
        out.append(row)
    return out


def profile(model, sampler, rows, prompt_len, new_tokens, device, top=20):
    """Top kernels by device time and the device-busy share of one sampling call."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    vocab = model.tok_embeddings.num_embeddings
    prompts = torch.randint(1, vocab, (rows // GROUP, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    for stops in ([vocab], mix_stop_tokens(vocab, new_tokens)):  # compile and capture outside the trace
        sample(sampler, model, prompts, new_tokens, stops, 1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        seconds, _ = timed(lambda: sample(sampler, model, prompts, new_tokens, [vocab], 2), device)
    events = prof.key_averages()
    attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=top, max_name_column_width=80), flush=True)
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                      "aten::item", "aten::_local_scalar_dense"))
    print(f"profile: {seconds * 1e3:.1f} ms for {rows} rows x {new_tokens} tokens; kernels busy {busy * 1e3:.1f} ms "
          f"({busy / seconds:.0%}); host syncs/item calls {syncs}; per step {seconds / new_tokens * 1e3:.3f} ms "
          f"(sorted by {sort}; {attr})", flush=True)
    if device.type == "cuda" and new_tokens > 1:
        print(step_breakdown_table(step_breakdown(model, sampler, prompts, new_tokens, device)), flush=True)


def step_breakdown(model, sampler, prompts, new_tokens, device, top=12):
    """Where one decode step's time goes: kernel time and launches per category and per kernel name.

    Profiles a ``new_tokens`` call and a one-token call (the same prefill) and divides their
    difference by ``new_tokens - 1``, as the step time is measured (``benchmarks/kernel_breakdown.py``
    names the categories; ``idle`` is the step's wall time the kernels leave uncovered).

    Returns:
        dict: ``{"us": {category: us per step, "busy", "idle", "wall"}, "launches": {category: per step},
        "top": [(kernel name, us per step, launches per step), ...]}``.
    """
    from kernel_breakdown import CATEGORIES, breakdown, profile_kernels

    never = [model.tok_embeddings.num_embeddings]
    calls = [profile_kernels(lambda n=n: sample(sampler, model, prompts, n, never, 2), device)
             for n in (new_tokens, 1)]
    (long_k, long_wall), (short_k, short_wall) = calls
    steps = new_tokens - 1
    a, b = breakdown(long_k, long_wall), breakdown(short_k, short_wall)
    us = {c: (a[c] - b[c]) / steps for c in CATEGORIES + ("busy",)}
    us["wall"] = (long_wall - short_wall) / steps
    # with programmatic launches a kernel's span starts before the one it waits for ends, so spans
    # overlap and may even cover more than the wall (profiler and event clocks differ): no idle then
    us["idle"] = max(0.0, us["wall"] - us["busy"])
    per_name = {}
    for sign, kernels in ((1, long_k), (-1, short_k)):
        for name, start, end in kernels:
            t, n = per_name.get(name, (0.0, 0))
            per_name[name] = (t + sign * (end - start), n + sign)
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"us": us, "launches": {c: (a["launches"][c] - b["launches"][c]) / steps for c in CATEGORIES},
            "top": [(name, t / steps, n / steps) for name, (t, n) in ranked]}


def step_breakdown_table(split):
    """Markdown tables of :func:`step_breakdown`: categories, then the top kernels."""
    us = split["us"]
    spans = sum(us[cat] for cat in split["launches"])
    lines = [f"decode step: {us['wall']:.1f} us wall, {us['busy']:.1f} busy, {us['idle']:.1f} idle"
             + (f" (kernel spans sum to {spans:.1f} us: they overlap, as programmatic launches make them)"
                if spans > us["busy"] + 1.0 or us["busy"] > us["wall"] else ""),
             "", "| category | us / step | launches / step | us / launch |", "|---|---:|---:|---:|"]
    for cat, launches in split["launches"].items():
        if launches > 0:
            t = split["us"][cat]
            lines.append(f"| {cat} | {t:.1f} | {launches:.1f} | {t / launches:.2f} |")
    lines += ["", "| kernel | us / step | launches / step |", "|---|---:|---:|"]
    lines += [f"| {name[:90]} | {t:.1f} | {n:.1f} |" for name, t, n in split["top"]]
    return "\n".join(lines)


def _gpu_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def run_metadata(device):
    """The CSV columns every results row starts with: date (UTC), GPU and the versions that matter."""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gpu=_gpu_name(device), torch=torch.__version__, triton=_version("triton"),
                torchtune=_version("torchtune"))


def results_csv(stem, gpu, folder=None):
    """``<folder>/<stem>_<gpu name>.csv``; the folder defaults to benchmarks/results."""
    name = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    folder = folder or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    return os.path.join(folder, f"{stem}_{name}.csv")


def save_rows(stem, fields, rows, device, out=None, folder=None, **meta):
    """Appends ``rows`` (dicts), each after the run's :func:`run_metadata` and ``meta``, to ``out``
    or to :func:`results_csv` ``(stem, gpu, folder)``."""
    head = dict(run_metadata(device), **meta)
    append_rows(Path(out or results_csv(stem, head["gpu"], folder)), fields, [dict(head, **r) for r in rows])


TABLE_COLUMNS = ["model", "rows", "new_tokens", "mix", "sampler", "decode_attention", "tokens_per_s", "mean_len",
                 "step_ms", "roofline_ms", "roofline_frac", "shared_prompt", "roofline_shared_frac", "compile_s", "status"]


def _table(rows, cols=TABLE_COLUMNS):
    width = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _ints(text):
    return [int(x) for x in text.split(",")]


def comma_choices(ap, flag, text, allowed):
    """The names of the comma list ``text`` given to ``flag``, each one of ``allowed`` (else the
    parser's error naming the flag, the name and the choices)."""
    names = text.split(",")
    for name in names:
        if name not in allowed:
            ap.error(f"{flag}: unknown {name!r}, expected some of {list(allowed)}")
    return names


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="0.5b,1.5b,7b", help=f"comma list of {list(MODELS)}")
    ap.add_argument("--samplers", default="compiled,baseline", help=f"comma list of {list(SAMPLERS)}")
    ap.add_argument("--rows", type=_ints, default=[16, 64], help="rows per call, multiples of G=16")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=_ints, default=[512, 2048])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true", help="uncompiled samplers (CPU smoke test)")
    ap.add_argument("--decode-attention", default="sdpa", help=f"comma list of {list(ATTENTIONS)}: 'compiled' and "
                    "'unfused' run once per decode attention")
    ap.add_argument("--compiled-options", default="", help="CompiledSampler options of 'compiled', "
                    "e.g. graph_sampling=False,attention_window=None")
    ap.add_argument("--gemm-backends", default=None,
                    help="inductor's max_autotune_gemm_backends (e.g. TRITON: its GEMM templates, programmatic "
                    "launches, instead of cuBLAS) for a compiled mode that autotunes, e.g. with "
                    "--compiled-options mode='max-autotune'")
    ap.add_argument("--profile", action="store_true", help="profile the first model, rows and new_tokens only")
    ap.add_argument("--out", default=None, help="CSV path (default benchmarks/results/generation_roofline_<gpu>.csv)")
    args = ap.parse_args(argv)
    args.decode_attention = comma_choices(ap, "--decode-attention", args.decode_attention, ATTENTIONS)
    try:
        args.compiled_options = parse_options(args.compiled_options)
    except (ValueError, SyntaxError):
        ap.error(f"--compiled-options: expected key=value pairs of Python literals, got {args.compiled_options!r}")
    if "decode_attention" in args.compiled_options:
        ap.error("--compiled-options: choose the decode attention with --decode-attention")
    args.models = comma_choices(ap, "--models", args.models, MODELS)
    args.samplers = comma_choices(ap, "--samplers", args.samplers, SAMPLERS)
    for r in args.rows:
        if r < GROUP or r % GROUP:
            ap.error(f"--rows: {r} is not a positive multiple of G={GROUP}")
    return args


def main(argv=None):
    args = parse_args(argv)
    backends = args.gemm_backends
    with torch._inductor.config.patch(max_autotune_gemm_backends=backends) if backends else contextlib.nullcontext():
        return run(args)


def run(args):
    """The benchmark of :func:`parse_args`'s ``args``."""
    device = torch.device(args.device)
    options = [f"{k}={v}" for k, v in args.compiled_options.items()]
    if args.gemm_backends:
        options.append(f"gemm_backends={args.gemm_backends}")
    common = dict(run_metadata(device), options=" ".join(options))
    gpu = common["gpu"]
    compile = not args.no_compile
    cache_len = args.prompt_len + max(args.new_tokens)
    if args.profile:
        model = build_model(args.models[0], device)
        for (name, attention), sampler in make_samplers(args.samplers, compile, cache_len, args.compiled_options,
                                                        args.decode_attention).items():
            print(f"== profile {name} ({attention}): {args.models[0]} rows={args.rows[0]} new={args.new_tokens[0]}",
                  flush=True)
            profile(model, sampler, args.rows[0], args.prompt_len, args.new_tokens[0], device)
        return 0
    out = args.out or results_csv("generation_roofline", gpu)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = []
    fields = _add_columns(Path(out), FIELDS)  # an older file gains the new columns first
    new_file = not os.path.exists(out)
    with open(out, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        if new_file:
            w.writeheader()
        t0 = time.perf_counter()
        for name in args.models:
            model = build_model(name, device)
            samplers = make_samplers(args.samplers, compile, cache_len, args.compiled_options, args.decode_attention)
            for n in args.rows:
                for new in args.new_tokens:
                    for (sname, attention), sampler in samplers.items():
                        for row in bench_config(model, name, sname, sampler, n, args.prompt_len, new, device,
                                                bandwidth, attention):
                            w.writerow({**common, **row})
                            fh.flush()
                            rows.append(row)
            for sampler in samplers.values():
                getattr(sampler, "release", lambda: None)()
            del model, samplers
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{gpu} | torch {torch.__version__} | triton {common['triton']} | torchtune {common['torchtune']} | "
          f"copy {bandwidth / 1e9:.0f} GB/s | total {time.perf_counter() - t0:.0f} s | csv {out}")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
