"""Sampling throughput against other libraries: torchtune's and HF's `generate` and ours, tokens/s.

For each model (torchtune Qwen2.5 architectures, random bf16 weights) and prompt length, P prompts
x G completions each (N = P x G rows) of exactly ``--new-tokens`` tokens (no stop token can fire),
sampled at temperature 1 from the full vocabulary, with:

* ``torchtune``: ``torchtune.generation.generate`` with its KV cache (prompts repeated G times; it
  keeps fp32 ``[N, T, V]`` logits);
* ``eager``: ``logitless.generation.eager.generate`` (KV cache, last-position logits only);
* ``fast_nocompile``: ``logitless.generation.compiled`` without compile (prefill once per group,
  static caches) - attributes the gain between the shared prefill and the compiled step;
* ``fast``: ``logitless.generation.compiled`` with the compiled decode step (CUDA graphs);
* ``fast_ungrouped`` (not in the default list): ``fast`` with torchtune's own attention, which
  copies K/V once per query head (isolates the grouped-attention gain);
* ``hf``: HF transformers ``generate`` (``num_return_sequences=G``, its default dynamic cache) on a
  random-init ``Qwen2ForCausalLM`` of the same architecture, when ``transformers`` is importable.

Time = one call, prefill included, after a short warm-up call of each generator (the compile of
``fast`` happens in its warm-up and is reported as ``compile_s``). The fast sampler keeps one cache
length per model (longest prompt + new tokens), as a GRPO run configures it, so each model
compiles once. Rows go to a CSV (with GPU name and versions) and a table is printed last.

Example (H200, about 5 minutes):
    PYTHONPATH=components python benchmarks/bench_generation_libraries.py
    PYTHONPATH=components python benchmarks/bench_generation_libraries.py --quick      # ~1.5 minutes
"""

import argparse
import csv
import datetime
import gc
import os
import platform
import re
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling bench_generation module
from bench_generation import _version, build_dotted  # noqa: E402

BACKENDS = ["torchtune", "eager", "fast_nocompile", "fast", "hf"]  # the default run
EXTRA = ["fast_ungrouped"]  # on request (--backends): one more compile per model
MODELS = {  # name: torchtune builder
    "qwen2.5-0.5b": "torchtune.models.qwen2_5.qwen2_5_0_5b",
    "qwen2.5-1.5b": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
    "tiny": "logitless.models.qwen2_5_tiny",  # CPU smoke test of this script
}
FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "transformers", "model", "backend", "prompts",
          "G", "rows", "prompt_len", "new_tokens", "seconds", "tokens_per_s", "speedup_vs_torchtune",
          "peak_gib", "compile_s", "generated", "status"]


def _hf_model(tt_model, device):
    """A random-init HF ``Qwen2ForCausalLM`` with the torchtune model's architecture."""
    import transformers
    from torchtune.modules import TiedLinear

    layer = tt_model.layers[0]
    config = transformers.Qwen2Config(
        vocab_size=tt_model.tok_embeddings.num_embeddings, hidden_size=tt_model.tok_embeddings.embedding_dim,
        intermediate_size=layer.mlp.w1.out_features, num_hidden_layers=len(tt_model.layers),
        num_attention_heads=layer.attn.num_heads, num_key_value_heads=layer.attn.num_kv_heads,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=isinstance(tt_model.output, TiedLinear), use_sliding_window=False)
    dtype = next(tt_model.parameters()).dtype
    def build():
        try:  # transformers >= 4.56 names it dtype, older versions torch_dtype
            return transformers.Qwen2ForCausalLM._from_config(config, dtype=dtype)
        except TypeError:
            return transformers.Qwen2ForCausalLM._from_config(config, torch_dtype=dtype)

    try:
        with device:  # initialise on the GPU: a CPU init of 1.5B random weights takes a while
            model = build()
    except Exception as exc:  # some versions refuse a device context: build on CPU, then move
        print(f"hf: init under the device context failed ({type(exc).__name__}); building on CPU", flush=True)
        model = build()
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None  # never stop early
    model.generation_config.pad_token_id = 0
    return model


def _run(backend, model, hf, prompts, groups, new_tokens, fast, seed):
    """Runs one generator; returns the number of new tokens per row it produced."""
    from logitless.generation.eager import generate as eager_generate

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(max_new_tokens=new_tokens, stop_tokens=[-1], pad_id=0, num_generations=groups,
              temperature=1.0, generator=gen)  # stop id -1 is never sampled: no early stop
    if backend == "eager":
        return eager_generate(model, prompts, **kw).completion_tokens.shape[1]
    if backend in fast:
        return fast[backend](model, prompts, **kw).completion_tokens.shape[1]
    batch = torch.tensor(prompts, device=device)
    if backend == "torchtune":
        from torchtune.generation import generate as tt_generate
        from torchtune.modules.common_utils import local_kv_cache

        batch = batch.repeat_interleave(groups, dim=0)
        with local_kv_cache(model, batch_size=batch.shape[0], device=device, dtype=batch_dtype(model),
                            decoder_max_seq_len=batch.shape[1] + new_tokens):
            out, _ = tt_generate(model, batch, max_generated_tokens=new_tokens, pad_id=0, temperature=1.0,
                                 rng=gen)
        return out.shape[1] - batch.shape[1]
    if backend == "hf":
        out = hf.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=True,
                          temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, num_return_sequences=groups, pad_token_id=0)
        return out.shape[1] - batch.shape[1]
    raise ValueError(f"backend: unknown {backend!r}, expected one of {BACKENDS + EXTRA}")


def _agreement(model, sampler, prompts, groups, new_tokens=32):
    """Greedy tokens of the compiled fast sampler against the eager one (a GPU check of the
    CUDA-graph path): share of identical rows and mean length of the common prefix."""
    from logitless.generation.eager import generate as eager_generate

    kw = dict(max_new_tokens=new_tokens, stop_tokens=[-1], pad_id=0, num_generations=groups, temperature=0)
    a = eager_generate(model, prompts, **kw).completion_tokens
    b = sampler(model, prompts, **kw).completion_tokens
    differ = (a != b).long()
    prefix = torch.where(differ.any(1), differ.argmax(1), torch.full_like(differ[:, 0], new_tokens))
    return (f"greedy vs eager: {float((prefix == new_tokens).float().mean()):.0%} rows identical over "
            f"{new_tokens} tokens, mean common prefix {float(prefix.float().mean()):.1f}")


def _kept_gib(sampler):
    """GiB of the cache and step buffers a CompiledSampler keeps between calls."""
    state = sampler._state or {}
    tensors = [t for c in state.get("caches", []) for t in (c.k_cache, c.v_cache)]
    tensors += [state[k] for k in ("tokens", "input_pos", "key_valid", "weight") if state.get(k) is not None]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30


def batch_dtype(model):
    return next(model.parameters()).dtype


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device):
    """(seconds, result, peak GiB above what was allocated before)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else float("nan")
    return seconds, result, peak


def bench_model(name, args, device, writer, rows):
    """All prompt lengths and backends for one model."""
    from logitless.generation.compiled import CompiledSampler

    model = build_dotted(MODELS[name], device)
    vocab = model.tok_embeddings.num_embeddings
    hf = None
    if "hf" in args.backends:
        try:
            hf = _hf_model(model, device)
        except Exception as exc:  # transformers missing or incompatible: reported in the table
            print(f"[{name}] hf skipped: {type(exc).__name__}: {exc}", flush=True)
    cache_len = max(args.prompt_lens) + args.new_tokens
    fast = {"fast": CompiledSampler(compile=True, backend=args.compile_backend, max_cache_len=cache_len),
            "fast_nocompile": CompiledSampler(compile=False, max_cache_len=cache_len),
            "fast_ungrouped": CompiledSampler(compile=True, backend=args.compile_backend, max_cache_len=cache_len,
                                              grouped_attention=False)}
    rng = torch.Generator().manual_seed(0)
    for plen in args.prompt_lens:
        prompts = torch.randint(1, vocab, (args.prompts, plen), generator=rng).tolist()  # no pad id 0
        base = None
        for backend in args.backends:
            row = dict(model=name, backend=backend, prompts=args.prompts, G=args.groups,
                       rows=args.prompts * args.groups, prompt_len=plen, new_tokens=args.new_tokens,
                       compile_s="", status="ok")
            if backend == "hf" and hf is None:
                row.update(status="transformers unavailable")
                writer(row), rows.append(row)
                continue
            try:
                # warm-up: allocator, cuBLAS handles; for "fast" the compile and CUDA graph capture
                # (same rows and cache length as the timed call, so the same graph)
                warm, _, _ = _timed(lambda: _run(backend, model, hf, prompts, args.groups, 4, fast, 1), device)
                if backend in ("fast", "fast_ungrouped"):
                    row["compile_s"] = round(warm, 1)
                seconds, made, peak = _timed(
                    lambda: _run(backend, model, hf, prompts, args.groups, args.new_tokens, fast, 2), device)
                if backend in fast:  # a kept cache was allocated before the timed call
                    peak += _kept_gib(fast[backend])
                tps = row["rows"] * made / seconds
                base = tps if backend == "torchtune" else base
                row.update(seconds=round(seconds, 3), tokens_per_s=round(tps, 1), generated=made,
                           peak_gib=round(peak, 2),
                           speedup_vs_torchtune=round(tps / base, 2) if base else "")
                if made != args.new_tokens:
                    row["status"] = f"stopped early ({made} tokens)"
            except torch.cuda.OutOfMemoryError:
                row.update(status="OOM")
            except Exception as exc:  # one failing generator must not hide the others' numbers
                traceback.print_exc()
                row.update(status=f"error: {type(exc).__name__}: {str(exc)[:120]}")
            print(f"[{name} P={args.prompts} G={args.groups} prompt={plen}] {backend:>14}: "
                  f"{row.get('tokens_per_s', '-')} tok/s  {row.get('seconds', '-')} s  {row['status']}",
                  flush=True)
            writer(row), rows.append(row)
            gc.collect()
        if plen == args.prompt_lens[0] and "fast" in args.backends:
            try:  # same rows and cache length as the timed runs: no new compile
                note = _agreement(model, fast["fast"], prompts, args.groups, min(32, args.new_tokens))
            except Exception as exc:  # a failed check is reported, not fatal
                note = f"check failed: {type(exc).__name__}: {str(exc)[:120]}"
            print(f"[{name} prompt={plen}] {note}", flush=True)
            row = dict(model=name, backend="check_fast_vs_eager", prompts=args.prompts, G=args.groups,
                       rows=args.prompts * args.groups, prompt_len=plen, new_tokens=min(32, args.new_tokens),
                       status=note)
            writer(row), rows.append(row)
    for sampler in fast.values():
        sampler.release()
    del model, hf, fast
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _gpu_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _table(rows):
    cols = ["model", "prompt_len", "backend", "tokens_per_s", "speedup_vs_torchtune", "seconds", "peak_gib",
            "compile_s", "status"]
    width = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b", help=f"comma list of {list(MODELS)}")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--prompt-lens", default="256,1024")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts P (rows = P x G)")
    ap.add_argument("--groups", type=int, default=16, help="completions per prompt G")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="0.5B only, prompt 256, 128 new tokens")
    ap.add_argument("--out", default=None, help="CSV path (default benchmarks/results/generation_<gpu>.csv)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.prompt_lens, args.new_tokens = "qwen2.5-0.5b", "256", 128
    args.models = args.models.split(",")
    args.backends = args.backends.split(",")
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    for name in args.models:
        if name not in MODELS:
            ap.error(f"--models: unknown {name!r}, expected some of {list(MODELS)}")
    for name in args.backends:
        if name not in BACKENDS + EXTRA:
            ap.error(f"--backends: unknown {name!r}, expected some of {BACKENDS + EXTRA}")
    device = torch.device(args.device)
    gpu = _gpu_name(device)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"generation_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_')}.csv")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    triton = _version("triton")
    common = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), gpu=gpu,
                  torch=torch.__version__, triton=triton, torchtune=_version("torchtune"),
                  transformers=_version("transformers"))
    new_file = not os.path.exists(out)
    with open(out, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        if new_file:
            w.writeheader()

        def writer(row):
            w.writerow({**common, **row})
            fh.flush()

        rows = []
        t0 = time.perf_counter()
        for name in args.models:
            bench_model(name, args, device, writer, rows)
    print(f"\n{gpu} | torch {torch.__version__} | triton {triton} | torchtune {common['torchtune']} | "
          f"transformers {common['transformers']} | total {time.perf_counter() - t0:.0f} s | csv {out}")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
