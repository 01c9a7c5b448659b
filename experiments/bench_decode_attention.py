"""Decode attention alone: time per layer against the bytes it must read, SDPA over a window vs split-K.

One new query token per row attends to a static bf16 cache of ``--cache-len`` columns of which the
first ``n`` are filled (``--filled``), at Qwen2.5 attention shapes (``0.5b``: 14 query / 2 K/V heads,
head_dim 64; ``1.5b``: 12 / 2 / 128; ``7b``: 28 / 4 / 128). The rows (``--rows``) are the first rows
of a 64-row cache, as a compacted batch bucket of the compiled sampler sees them; every row has a
few columns of left padding. Methods:

* ``sdpa_window``: the compiled sampler's default (``decode_attention="sdpa"``): the query heads of
  a K/V head folded into SDPA's query axis, a boolean mask, over the filled length rounded up to
  ``--window`` columns (its ``attention_window``);
* ``sdpa_full``: the same over the whole cache (``attention_window=None``);
* ``split_k``: :func:`logitless.generation.kernels.decode_attention` (``decode_attention="split_k"``), with the
  automatic split length, and with each of ``--split-lens`` when given (times each of ``--block-ns``,
  ``--warps``, ``--stages`` and ``--programmatic``: a sweep of the launch parameters; the kernel's
  defaults where none is given). The CSV records the parameters each run resolved to.

On CUDA each method is timed as a CUDA graph of ``--reps`` calls, replayed (the sampler replays its
captured step, so launch gaps do not count). ``bytes`` is what the step must read: the filled keys
and values of the rows (``rows x kv_heads x n x head_dim x 2 x 2`` bytes), the query and the output;
``of_copy_bw`` is that at the device-to-device copy bandwidth measured in the same run, divided by
the time. ``max_diff`` is the largest absolute difference from ``sdpa_full``'s output.

Example (H200):
    PYTHONPATH=components python experiments/bench_decode_attention.py --models 0.5b,1.5b,7b --rows 8,16,64 \\
        --filled 1024,2048,3584
    PYTHONPATH=components python experiments/bench_decode_attention.py --models tiny --device cpu  # smoke
"""

import argparse
import datetime
import importlib
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
from bench_generation import (_gpu_name, _table, _version, comma_choices, copy_bandwidth,  # noqa: E402
                              results_csv)
from bench_sft import append_rows  # noqa: E402

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128), "tiny": (6, 2, 16)}
METHODS = ("sdpa_window", "sdpa_full", "split_k", "split_k_shared")
CACHE_ROWS = 64
FIELDS = ["date", "gpu", "torch", "triton", "model", "rows", "cache_len", "filled", "method", "split_len",
          "resolved_split_len", "block_n", "num_warps", "num_stages", "programmatic", "prompt_len", "group",
          "prefix_split_len", "prefix_block_n", "prefix_warps", "us",
          "bytes", "copy_gbps", "roofline_us", "of_copy_bw", "max_diff", "status"]


def make_inputs(model, rows, cache_len, device, dtype, prompt_len=0, group=1):
    """q ``(rows, Hq, D)``, K/V caches ``(rows, Hkv, L, D)`` (views of 64-row caches) and the key mask;
    with ``prompt_len``, the first ``prompt_len`` columns (keys, values, mask) equal within each
    group of ``group`` consecutive rows, as the sampler's caches hold a group's prompt."""
    hq, hkv, dim = SHAPES[model]
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, hq, dim, generator=g, device=device).to(dtype)
    k = torch.randn(max(rows, CACHE_ROWS), hkv, cache_len, dim, generator=g, device=device).to(dtype)
    v = torch.randn_like(k)
    valid = torch.ones(max(rows, CACHE_ROWS), cache_len, dtype=torch.bool, device=device)
    for row in range(valid.shape[0]):
        valid[row, :row % 7] = False  # a little left padding per row
    if prompt_len:
        leader = torch.arange(valid.shape[0], device=device) // group * group
        for t in (k, v):
            t[:, :, :prompt_len] = t[leader, :, :prompt_len].clone()
        valid[:, :prompt_len] = valid[leader, :prompt_len].clone()
    return q, k[:rows], v[:rows], valid[:rows]


def shared_prefix(model, rows, prompt_len, group, device):
    """The :class:`~logitless.generation.kernels.decode_attention.SharedPrefix` of ``rows // group`` groups
    (each cut into segments of :func:`~logitless.generation.kernels.decode_attention.prefix_rows` rows)."""
    from logitless.generation.kernels.decode_attention import SharedPrefix, group_segments, prefix_rows

    hq, hkv, _ = SHAPES[model]
    per = prefix_rows(hq // hkv, group)
    start, seg_rows = group_segments(torch.arange(rows, device=device), group, per, -(-rows // group))
    return SharedPrefix(torch.tensor([prompt_len], device=device), start, seg_rows,
                        torch.tensor([rows], device=device), per)


def _kernel_module():
    # the launch planning, whose constants the op reads at each call
    return importlib.import_module("logitless.generation.kernels.decode_attention.plan")


def sdpa_step(q, k, v, valid, n_filled, window):
    """The sampler's SDPA decode attention over the first ``window`` columns (``n_filled`` on the device)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    k, v = k.narrow(2, 0, window), v.narrow(2, 0, window)
    mask = valid.narrow(1, 0, window) & (torch.arange(window, device=q.device) < n_filled)
    mask = mask[:, None, None].expand(b, 1, hq // hkv, window)
    return F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), k, v, attn_mask=mask).reshape(b, hq, d)


def methods(args, cache_len, filled, prefix=None):
    """``(method, launch parameters, callable(q, k, v, valid, n_filled))`` of one configuration;
    split-K once per (split length: ``auto`` and ``--split-lens``) x ``--block-ns`` x ``--warps`` x
    ``--stages`` x ``--programmatic`` (None: the kernel's default); ``split_k_shared`` (with
    ``prefix``, a SharedPrefix) once per ``--prefix-split-lens`` x ``--prefix-block-ns`` x
    ``--prefix-warps`` (these two set the module's constants) x split length of the rows' own
    columns (``auto`` and ``--split-lens``)."""
    from logitless.generation.kernels.decode_attention import decode_attention
    module = _kernel_module()

    window = min(cache_len, -(-filled // args.window) * args.window)
    out = []
    for name in args.methods:
        if name == "sdpa_window":
            out.append((name, {}, lambda q, k, v, m, n, w=window: sdpa_step(q, k, v, m, n, w)))
        elif name == "sdpa_full":
            out.append((name, {}, lambda q, k, v, m, n: sdpa_step(q, k, v, m, n, cache_len)))
        elif name == "split_k_shared":
            if prefix is None:
                continue
            for split, block_n, warps, row_split in itertools.product(
                    [None] + args.prefix_split_lens, args.prefix_block_ns or [module.PREFIX_BLOCK_N],
                    args.prefix_warps or [module.PREFIX_NUM_WARPS], [None] + args.split_lens):
                launch = dict(prefix_split_len=split, prefix_block_n=block_n, prefix_warps=warps,
                              split_len="auto" if row_split is None else row_split)

                def call(q, k, v, m, n, split=split, block_n=block_n, warps=warps, row_split=row_split):
                    module.PREFIX_BLOCK_N, module.PREFIX_NUM_WARPS = block_n, warps
                    return decode_attention(q, k, v, m, n, shared_prefix=prefix, prefix_split_len=split,
                                            split_len=row_split)

                out.append((name, launch, call))
        else:
            for split, block_n, warps, stages, programmatic in itertools.product(
                    [None] + args.split_lens, args.block_ns or [None], args.warps or [None], args.stages or [None],
                    args.programmatic):
                if split is not None and block_n is not None:
                    block_n = min(split, block_n)
                launch = dict(split_len=split, block_n=block_n, num_warps=warps, num_stages=stages,
                              programmatic_launch=bool(programmatic))
                out.append((name, launch, lambda q, k, v, m, n, kw=launch: decode_attention(q, k, v, m, n, **kw)))
    return out


def time_call(fn, device, reps, iters):
    """Seconds per call: a CUDA graph of ``reps`` calls replayed ``iters`` times (CUDA), else a loop."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and warm the allocator outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (iters * reps)


def resolved_launch(launch, rows, kv_heads, cache_len, filled, device):
    """The launch parameters split-K runs with: those given, the kernel's defaults for the rest
    (:func:`logitless.generation.kernels.decode_attention.resolve_launch`).

    Returns:
        dict: ``split_len`` (``"auto"`` or the one given), ``resolved_split_len`` (with ``"auto"``
        the split the kernels choose at ``filled`` columns: :func:`fill_split_len`), ``block_n``,
        ``num_warps``, ``num_stages`` and ``programmatic`` (0/1, as asked; the kernel uses it where the
        GPU supports it).
    """
    module = _kernel_module()
    split = launch["split_len"]
    resolved = module.resolve_launch(rows, kv_heads, cache_len, device, split or 0, launch["block_n"] or 0,
                                     launch["num_warps"] or 0, launch["num_stages"] or 0)
    chosen = resolved.split_len
    if resolved.max_split_len > resolved.split_len:
        chosen = module.fill_split_len(filled, rows * kv_heads, module.sm_count(device), resolved.split_len,
                                       resolved.max_split_len)
    return dict(split_len="auto" if split is None else split, resolved_split_len=chosen, block_n=resolved.block_n,
                num_warps=resolved.num_warps, num_stages=resolved.num_stages,
                programmatic=int(launch["programmatic_launch"]))


def bench(args):
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device)
    common = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  gpu=_gpu_name(device), torch=torch.__version__, triton=_version("triton"))
    rows_out = []
    for model in args.models:
        hq, hkv, dim = SHAPES[model]
        for rows in args.rows:
            q, k, v, valid = make_inputs(model, rows, args.cache_len, device, dtype, args.prompt_len, args.group)
            prefix = shared_prefix(model, rows, args.prompt_len, args.group, device) if args.prompt_len else None
            module = _kernel_module()
            defaults = module.PREFIX_BLOCK_N, module.PREFIX_NUM_WARPS
            for filled in args.filled:
                n_filled = torch.tensor([filled], device=device)
                kv_row = hkv * dim * 2 * k.element_size()  # bytes of one cache column of one row
                nbytes = rows * kv_row * filled + 2 * rows * hq * dim * q.element_size()
                reference = sdpa_step(q, k, v, valid, n_filled, args.cache_len).float()
                for name, launch, fn in methods(args, args.cache_len, filled, prefix):
                    row = dict(common, model=model, rows=rows, cache_len=args.cache_len, filled=filled, method=name,
                               bytes=nbytes, status="ok")
                    if name == "split_k":
                        row.update(resolved_launch(launch, rows, hkv, args.cache_len, filled, device))
                    if name == "split_k_shared":  # the prompt read once per group
                        split = 0 if launch["split_len"] == "auto" else launch["split_len"]
                        shared = (rows - -(-rows // args.group)) * kv_row * min(args.prompt_len, filled)
                        resolved = module.resolve_launch(rows, hkv, args.cache_len, device, split, shared_prompt=True)[0]
                        row.update(launch, prompt_len=args.prompt_len, group=args.group, bytes=nbytes - shared,
                                   resolved_split_len=resolved)
                    try:
                        diff = (fn(q, k, v, valid, n_filled).float() - reference).abs().max().item()
                        seconds = time_call(lambda: fn(q, k, v, valid, n_filled), device, args.reps, args.iters)
                        roof = row["bytes"] / bandwidth
                        row.update(us=round(seconds * 1e6, 2), max_diff=f"{diff:.2e}",
                                   copy_gbps=round(bandwidth / 1e9, 1), roofline_us=round(roof * 1e6, 2),
                                   of_copy_bw="" if math.isnan(roof) else round(roof / seconds, 3))
                    except Exception as exc:  # one failing configuration must not hide the others' numbers
                        row.update(status=f"error: {type(exc).__name__}: {str(exc)[:120]}")
                    module.PREFIX_BLOCK_N, module.PREFIX_NUM_WARPS = defaults
                    tag = " ".join(f"{k}={row[k]}" for k in ("split_len", "resolved_split_len", "block_n", "num_warps",
                                                             "num_stages", "programmatic", "prefix_split_len",
                                                             "prefix_block_n", "prefix_warps") if k in row)
                    print(f"[{model} rows={rows} filled={filled}] {name:>11} {tag}: {row.get('us', '-')} us "
                          f"({row.get('of_copy_bw', '-')} of copy bw) max_diff {row.get('max_diff', '-')} "
                          f"{row['status']}", flush=True)
                    rows_out.append(row)
    return rows_out, bandwidth


TABLE_COLUMNS = ["model", "rows", "filled", "method", "split_len", "resolved_split_len", "block_n", "num_warps",
                 "num_stages", "programmatic", "prompt_len", "prefix_split_len", "prefix_block_n", "prefix_warps", "us",
                 "roofline_us", "of_copy_bw", "max_diff", "status"]


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="0.5b,1.5b,7b", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--rows", type=_ints, default=[8, 16, 64])
    ap.add_argument("--filled", type=_ints, default=[1024, 2048, 3584], help="filled columns of the cache")
    ap.add_argument("--cache-len", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256, help="sdpa_window's attention_window")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {list(METHODS)}")
    ap.add_argument("--split-lens", type=_ints, default=[], help="split_k split lengths to time besides 'auto'")
    ap.add_argument("--block-ns", type=_ints, default=[],
                    help="split_k columns per inner block (capped at the split; default: the kernel's)")
    ap.add_argument("--warps", type=_ints, default=[], help="split_k warps per program (default: the kernel's)")
    ap.add_argument("--stages", type=_ints, default=[], help="split_k pipeline stages (default: the kernel's)")
    ap.add_argument("--programmatic", type=_ints, default=[1],
                    help="split_k programmatic dependent launch, 1 and/or 0 (used where the GPU has it)")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="split_k_shared: the first columns shared by each group of --group rows (0: not run)")
    ap.add_argument("--group", type=int, default=16, help="rows per prompt (split_k_shared)")
    ap.add_argument("--prefix-split-lens", type=_ints, default=[], help="split_k_shared prefix split lengths "
                    "besides 'auto'")
    ap.add_argument("--prefix-block-ns", type=_ints, default=[], help="split_k_shared prefix kernel block columns")
    ap.add_argument("--prefix-warps", type=_ints, default=[], help="split_k_shared prefix kernel warps")
    ap.add_argument("--reps", type=int, default=20, help="calls per captured CUDA graph")
    ap.add_argument("--iters", type=int, default=20, help="graph replays timed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="CSV path (default experiments/results/decode_attention_<gpu>.csv)")
    args = ap.parse_args(argv)
    args.models = comma_choices(ap, "--models", args.models, SHAPES)
    args.methods = comma_choices(ap, "--methods", args.methods, METHODS)
    if not args.programmatic or set(args.programmatic) - {0, 1}:
        ap.error(f"--programmatic: expected 1 and/or 0, got {args.programmatic}")
    for n in args.filled:
        if not 1 <= n <= args.cache_len:
            ap.error(f"--filled: {n} is not in [1, --cache-len={args.cache_len}]")
    return args


def main(argv=None):
    args = parse_args(argv)
    gpu = _gpu_name(torch.device(args.device))
    out = args.out or results_csv("decode_attention", gpu, RESULTS)
    rows, bandwidth = bench(args)
    append_rows(Path(out), FIELDS, rows)
    print(f"\n{gpu} | torch {torch.__version__} | triton {_version('triton')} | copy {bandwidth / 1e9:.0f} GB/s | "
          f"cache {args.cache_len} columns | csv {out}")
    print(_table(rows, TABLE_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
