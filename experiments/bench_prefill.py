"""Long-prompt prefill: time and peak GPU memory, chunked (``prefill_chunk_tokens``) against one forward.

For each model (torchtune Qwen2.5 builders, random bf16 weights), prompt count P (each prompt's
group of G=16 completions shares one prefill, as the compiled sampler runs it) and prompt width W,
two measurements per chunk setting:

* ``prefill``: :func:`logitless.generation.prefill.prefill` of the P prompts into a P-row KV cache of
  width W (what ``CompiledSampler`` does before copying the cache into the group's rows):
  ``prefill_s`` and ``prefill_extra_gib``, the peak allocated above the weights and that cache (the
  forwards' working memory: activations, MLP intermediate, masks, attention workspace);
  ``prompt_cache_gib`` is the cache itself.
* ``call``: a whole ``CompiledSampler`` call with ``max_new_tokens=1`` (prefill, the cache copied into
  the P x G decode rows, one token drawn): ``call_s`` and ``call_peak_gib`` above the weights.

A setting that runs out of memory is reported as ``OOM`` and the grid goes on.

Example (H200):
    PYTHONPATH=components python experiments/bench_prefill.py --models 1.5b,7b --prompts 1,4 \\
        --widths 8192,16384,32768 --chunk-tokens 8192,none
    PYTHONPATH=components python experiments/bench_prefill.py --models tiny --device cpu --widths 64,256  # smoke
"""

import argparse
import csv
import gc
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
from bench_generation import GROUP, MODELS, _table, build_model, results_csv, run_metadata, timed  # noqa: E402

FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "model", "prompts", "G", "rows", "prompt_len",
          "chunk_tokens", "prefill_s", "prefill_extra_gib", "prompt_cache_gib", "call_s", "call_peak_gib", "status"]
GIB = 2**30


def _reset_peak(device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_above(device, base):
    if base is None:
        return ""
    return round((torch.cuda.max_memory_allocated(device) - base) / GIB, 3)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prompts_of(model, count, width):
    vocab = model.tok_embeddings.num_embeddings
    return torch.randint(1, vocab, (count, width), generator=torch.Generator().manual_seed(0)).tolist()


def measure_prefill(model, prompts, chunk_tokens, device):
    """Seconds, peak GiB above weights + prompt cache, and that cache's GiB of one prefill, timed
    after an untimed one of the same shape (per-shape kernel selection and allocator growth would
    otherwise land on whichever setting runs first)."""
    from torchtune.modules.common_utils import local_kv_cache

    from logitless.generation.prefill import prefill
    from logitless.generation.result import left_pad

    tokens, prompt_mask = left_pad(prompts, 0, device)
    positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)
    dtype = next(model.parameters()).dtype
    with torch.no_grad(), local_kv_cache(model, batch_size=tokens.shape[0], device=device, dtype=dtype,
                                         decoder_max_seq_len=tokens.shape[1]):
        cache = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("k_cache", "v_cache")))
        def run():
            return prefill(model, tokens, input_pos=positions, prompt_mask=prompt_mask, chunk_tokens=chunk_tokens)

        run()
        model.reset_caches()  # the timed prefill writes from column 0 again
        base = _reset_peak(device)
        seconds, _ = timed(run, device)
        extra = _peak_above(device, base)
    return seconds, extra, round(cache / GIB, 3)


def measure_call(model, prompts, chunk_tokens, device):
    """Seconds and peak GiB above the weights of a one-token ``CompiledSampler`` call, timed after an
    untimed one."""
    from logitless.generation import CompiledSampler

    sampler = CompiledSampler(compile=False, keep_cache=False, prefill_chunk_tokens=chunk_tokens)
    def call():
        return sampler(model, prompts, max_new_tokens=1, stop_tokens=[0], pad_id=0, num_generations=GROUP,
                       temperature=1.0)

    call()
    base = _reset_peak(device)
    seconds, _ = timed(call, device)
    return seconds, _peak_above(device, base)


def bench(model, name, count, width, chunk_tokens, device):
    prompts = prompts_of(model, count, width)
    row = dict(model=name, prompts=count, G=GROUP, rows=count * GROUP, prompt_len=width,
               chunk_tokens="none" if chunk_tokens is None else chunk_tokens, status="ok")
    for what, fn in (("prefill", measure_prefill), ("call", measure_call)):
        try:
            result = fn(model, prompts, chunk_tokens, device)
            if what == "prefill":
                row.update(prefill_s=round(result[0], 4), prefill_extra_gib=result[1], prompt_cache_gib=result[2])
            else:
                row.update(call_s=round(result[0], 4), call_peak_gib=result[1])
        except torch.cuda.OutOfMemoryError:
            row[f"{what}_s"] = "OOM"
            row["status"] = "OOM" if row["status"] == "ok" else row["status"]
        except Exception as exc:  # one failing setting must not hide the others' numbers
            traceback.print_exc()
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
        _free(device)
    print(f"[{name} P={count} W={width} chunk={row['chunk_tokens']}] prefill {row.get('prefill_s', '-')} s "
          f"+{row.get('prefill_extra_gib', '-')} GiB (cache {row.get('prompt_cache_gib', '-')} GiB); call "
          f"{row.get('call_s', '-')} s peak {row.get('call_peak_gib', '-')} GiB; {row['status']}", flush=True)
    return row


TABLE_COLUMNS = ["model", "prompts", "rows", "prompt_len", "chunk_tokens", "prefill_s", "prefill_extra_gib",
                 "prompt_cache_gib", "call_s", "call_peak_gib", "status"]


def _ints(text):
    return [int(x) for x in text.split(",")]


def _chunks(text):
    return [None if x.strip().lower() in ("none", "null") else int(x) for x in text.split(",")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="1.5b,7b", help=f"comma list of {list(MODELS)}")
    ap.add_argument("--prompts", type=_ints, default=[1, 4], help="distinct prompts (groups of G=16) per call")
    ap.add_argument("--widths", type=_ints, default=[8192, 16384, 32768], help="prompt widths in tokens")
    ap.add_argument("--chunk-tokens", type=_chunks, default=[8192, None],
                    help="prefill_chunk_tokens settings; 'none' = one forward")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="CSV path (default experiments/results/prefill_<gpu>.csv)")
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    for name in args.models:
        if name not in MODELS:
            ap.error(f"--models: unknown {name!r}, expected some of {list(MODELS)}")
    for n in args.prompts + args.widths:
        if n < 1:
            ap.error(f"--prompts/--widths: expected positive ints, got {n}")
    for c in args.chunk_tokens:
        if c is not None and c < 1:
            ap.error(f"--chunk-tokens: expected ints >= 1 or 'none', got {c}")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    common = run_metadata(device)
    gpu = common["gpu"]
    out = args.out or results_csv("prefill", gpu, RESULTS)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    rows = []
    new_file = not os.path.exists(out)
    t0 = time.perf_counter()
    with open(out, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        if new_file:
            w.writeheader()
        for name in args.models:
            model = build_model(name, device)
            measure_prefill(model, prompts_of(model, 1, 256), None, device)  # kernels' first-call setup
            for count in args.prompts:
                for width in args.widths:
                    for chunk_tokens in args.chunk_tokens:
                        row = bench(model, name, count, width, chunk_tokens, device)
                        w.writerow({**common, **row})
                        fh.flush()
                        rows.append(row)
            del model
            _free(device)
    print(f"\n{gpu} | torch {torch.__version__} | triton {common['triton']} | torchtune {common['torchtune']} | "
          f"total {time.perf_counter() - t0:.0f} s | csv {out}")
    print(_table(rows, TABLE_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
