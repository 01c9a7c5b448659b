"""The decode step's MLP at a few rows: cuBLAS against GEMMs that spread every weight row over the SMs.

At 64 rows a decode step's GEMMs read weights: at Qwen2.5-1.5B an H200 could read a layer's MLP
weights (83 MB) in about 19 us, and the compiled step spends about 33 us on them (gate/up 19.5, down
10 + 1.9 for cuBLAS's split-K reduction, the activation 1.8). The question here: does a GEMM that
gives every SM an equal share of the weight rows, or that overlaps the previous kernel's tail
(programmatic dependent launch) and prefetches its weights into L2 before it waits, close that gap?

``balanced_linear_kernel`` gives program ``p`` the weight rows ``[p * ROWS, (p + 1) * ROWS)`` (one
power-of-two block and a smaller one for the rest, so ``ROWS`` need not be a power of two: 132
programs of 136 rows at 1.5B's gate/up instead of cuBLAS's 102 tiles of 176), and optionally a range
of the reduction (split-K: fp32 partials summed by the next kernel, or atomic adds into a zeroed
fp32 buffer). ``gated`` returns ``silu(gate) * up`` from the ``[gate; up]`` weight.

One CSV (``benchmarks/results/decode_mlp_<gpu>.csv``), its kind in ``section``:

* ``product``: one product per row (``gate_up``, ``down``) of ``--rows`` rows, cuBLAS
  (``cublas``; for gate/up also ``cublas+act``, with a one-kernel activation standing in for
  inductor's) and the balanced kernel in a few tilings: microseconds per call in a CUDA graph over
  enough weight copies that the weights come from HBM, the weight bytes' rate (``tb_s``) and the
  largest error against float64 relative to the output's largest value;
* ``chain``: the MLP of ``--layers`` layers (distinct weights) as the decode step runs it: gate/up,
  activation, down, residual add. ``cublas`` (with the stand-in activation and add kernels), then
  the balanced kernels (gated gate/up, split-K down with partials or atomics), with programmatic
  launches (``pdl``) and with an L2 prefetch of the weights before the wait (``prefetch``):
  microseconds per layer.

Example (H200):
    PYTHONPATH=components python experiments/bench_decode_mlp.py --models 1.5b,0.5b,7b
    PYTHONPATH=components python experiments/bench_decode_mlp.py --device cpu --models tiny --rows 5 --layers 2 \\
        --reps 1  # smoke (TRITON_INTERPRET=1)
"""

import argparse
import itertools
import math
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
from bench_decode_attention import _ints, time_call  # noqa: E402
from bench_generation import _table, comma_choices, results_csv, run_metadata  # noqa: E402
from bench_sft import append_rows  # noqa: E402

#: (hidden, intermediate) of the MLP: Qwen2.5's, and a tiny odd one for the CPU smoke test
MODELS = {"0.5b": (896, 4864), "1.5b": (1536, 8960), "7b": (3584, 18944), "tiny": (40, 72)}
FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "section", "model", "rows", "product", "variant", "us",
          "tb_s", "rel_err"]
TABLE = ["section", "model", "rows", "product", "variant", "us", "tb_s", "rel_err"]


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def program_rows(p, ROWS, N, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program ``p``'s weight rows ``[p * ROWS, min(N, (p + 1) * ROWS))`` as a ``BLOCK_A`` and a
    ``BLOCK_B`` block, with their masks."""
    r0 = p * ROWS
    r_end = tl.minimum(N, r0 + ROWS)
    ra = r0 + tl.arange(0, BLOCK_A)
    rb = r0 + BLOCK_A + tl.arange(0, BLOCK_B)
    return ra, rb, ra < r_end, rb < r_end


@triton.jit
def balanced_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, ROWS, KB, stride_xm, stride_wn, stride_os, stride_om,
                           GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr,
                           PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Grid ``(cdiv(N, ROWS), SPLITS)``: ``x @ W[rows].T`` over the ``k`` blocks
    ``[split * KB // SPLITS, (split + 1) * KB // SPLITS)``, the rows as a ``BLOCK_A`` and a
    ``BLOCK_B`` block; out ``(SPLITS, M, N)`` (``ATOMIC``: added into ``(1, M, N)`` fp32)."""
    pn = tl.program_id(0)
    pk = tl.program_id(1)
    ra, rb, oka, okb = program_rows(pn, ROWS, N, BLOCK_A, BLOCK_B)
    kb0 = pk * KB // SPLITS
    kb1 = (pk + 1) * KB // SPLITS
    m = tl.arange(0, BLOCK_M)
    okm = m < M
    ks = tl.arange(0, BLOCK_K)
    up = N.to(tl.int64) * stride_wn  # the up rows follow the gate rows
    wa_ptrs = w_ptr + ra[:, None].to(tl.int64) * stride_wn + ks[None, :]
    wb_ptrs = w_ptr + rb[:, None].to(tl.int64) * stride_wn + ks[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + ks[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:  # the weights depend on no earlier kernel: one address per 128-byte line
        for kb in range(kb0, kb1):
            _prefetch_l2(w_ptr + ra.to(tl.int64) * stride_wn + kb * BLOCK_K)
            _prefetch_l2(w_ptr + rb.to(tl.int64) * stride_wn + kb * BLOCK_K)
            if GATED:
                _prefetch_l2(w_ptr + up + ra.to(tl.int64) * stride_wn + kb * BLOCK_K)
                _prefetch_l2(w_ptr + up + rb.to(tl.int64) * stride_wn + kb * BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc_a = tl.zeros((BLOCK_A, BLOCK_M), tl.float32)
    acc_b = tl.zeros((BLOCK_B, BLOCK_M), tl.float32)
    acc_ua = tl.zeros((BLOCK_A, BLOCK_M), tl.float32)
    acc_ub = tl.zeros((BLOCK_B, BLOCK_M), tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * BLOCK_K
        if EVEN_K:  # no mask along the rows' contiguous dimension: the loads stay vectorised
            xt = tl.trans(tl.load(x_ptrs + k0, mask=okm[:, None], other=0.0))
            wa = tl.load(wa_ptrs + k0, mask=oka[:, None], other=0.0)
            wb = tl.load(wb_ptrs + k0, mask=okb[:, None], other=0.0)
        else:
            okk = (k0 + ks) < K
            xt = tl.trans(tl.load(x_ptrs + k0, mask=okm[:, None] & okk[None, :], other=0.0))
            wa = tl.load(wa_ptrs + k0, mask=oka[:, None] & okk[None, :], other=0.0)
            wb = tl.load(wb_ptrs + k0, mask=okb[:, None] & okk[None, :], other=0.0)
        acc_a = tl.dot(wa, xt, acc_a)
        acc_b = tl.dot(wb, xt, acc_b)
        if GATED:
            if EVEN_K:
                ua = tl.load(wa_ptrs + up + k0, mask=oka[:, None], other=0.0)
                ub = tl.load(wb_ptrs + up + k0, mask=okb[:, None], other=0.0)
            else:
                ua = tl.load(wa_ptrs + up + k0, mask=oka[:, None] & okk[None, :], other=0.0)
                ub = tl.load(wb_ptrs + up + k0, mask=okb[:, None] & okk[None, :], other=0.0)
            acc_ua = tl.dot(ua, xt, acc_ua)
            acc_ub = tl.dot(ub, xt, acc_ub)
    if GATED:
        acc_a = acc_a / (1.0 + tl.exp(-acc_a)) * acc_ua
        acc_b = acc_b / (1.0 + tl.exp(-acc_b)) * acc_ub
    base = out_ptr if ATOMIC else out_ptr + pk * stride_os
    oa = base + m[None, :] * stride_om + ra[:, None]
    ob = base + m[None, :] * stride_om + rb[:, None]
    if ATOMIC:
        tl.atomic_add(oa, acc_a, mask=okm[None, :] & oka[:, None], sem="relaxed")
        tl.atomic_add(ob, acc_b, mask=okm[None, :] & okb[:, None], sem="relaxed")
    else:
        tl.store(oa, acc_a.to(out_ptr.dtype.element_ty), mask=okm[None, :] & oka[:, None])
        tl.store(ob, acc_b.to(out_ptr.dtype.element_ty), mask=okm[None, :] & okb[:, None])


@triton.jit
def _act_kernel(y_ptr, out_ptr, N, BLOCK: tl.constexpr):
    # silu(y[:, :N]) * y[:, N:], one kernel as inductor fuses it in the compiled step
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < N
    g = tl.load(y_ptr + r * 2 * N + c, mask=ok).to(tl.float32)
    u = tl.load(y_ptr + r * 2 * N + N + c, mask=ok).to(tl.float32)
    tl.store(out_ptr + r * N + c, (g / (1 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_kernel(h_ptr, y_ptr, out_ptr, N, S, stride_s, BLOCK: tl.constexpr):
    # out = h + sum_s y[s]: the residual add, summing split-K partials as inductor would fuse it
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < N
    acc = tl.load(h_ptr + r * N + c, mask=ok).to(tl.float32)
    for s in range(S):
        acc += tl.load(y_ptr + s * stride_s + r * N + c, mask=ok).to(tl.float32)
    tl.store(out_ptr + r * N + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


def row_blocks(rows: int):
    """The two row blocks a program of ``rows`` weight rows loads: the largest power of two at most
    ``rows`` (at least 16) and the next power of two (at least 16) of the rest."""
    a = max(16, 1 << int(math.floor(math.log2(rows))))
    return a, max(16, triton.next_power_of_2(max(1, rows - a)))


def balanced_linear(x, w, out, programs, splits=1, gated=False, atomic=False, warps=4, stages=4, block_k=64,
                    pdl=False, prefetch=False):
    """``x @ w.T`` (gated: ``silu(x @ w[:N].T) * (x @ w[N:].T)``) by :func:`balanced_linear_kernel`.

    Args:
        x (Tensor): ``(M, K)`` rows, ``M <= 128``, contiguous rows.
        w (Tensor): ``(N, K)`` weight (``(2N, K)``, gate rows first, when ``gated``), contiguous rows.
        out (Tensor): ``(splits, M, N)`` (``atomic``: ``(1, M, N)`` fp32, zeroed by the caller).
        programs (int): about this many row ranges of ``ceil(N / programs)`` rows each.
        splits (int): ranges of the reduction; each writes (or, ``atomic``, adds) its partial sums.
        gated, atomic (bool): as above.
        warps, stages, block_k (int): the launch's warps, pipeline stages and reduction block.
        pdl (bool): a programmatic dependent launch (sm_90): waits for the previous kernel after
            letting the next one launch (and, ``prefetch``, after prefetching its weights into L2).
        prefetch (bool): with ``pdl``, prefetch the program's weight rows into L2 before the wait.

    Returns:
        Tensor: ``out``.

    Example:
        >>> act = balanced_linear(h, w_gate_up, torch.empty(1, 64, 8960, **like), 132, gated=True)[0]
    """
    m, k = x.shape
    n = w.shape[0] // (2 if gated else 1)
    rows = triton.cdiv(n, programs)
    a, b = row_blocks(rows)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    balanced_linear_kernel[(triton.cdiv(n, rows), splits)](
        x, w, out, m, n, k, rows, triton.cdiv(k, block_k), x.stride(0), w.stride(0), out.stride(0), out.stride(1),
        GATED=gated, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_A=a, BLOCK_B=b, BLOCK_K=block_k,
        SPLITS=splits, ATOMIC=atomic, EVEN_K=k % block_k == 0, PDL=pdl, PREFETCH=prefetch, num_warps=warps,
        num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return out


def _act(y, out):
    n = out.shape[1]
    _act_kernel[(y.shape[0], triton.cdiv(n, 1024))](y, out, n, BLOCK=1024)


def _add(h, y, out, splits):
    n = h.shape[1]
    _add_kernel[(h.shape[0], triton.cdiv(n, 1024))](h, y, out, n, splits, y.stride(0), BLOCK=1024)


def _rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _down_split(n_out: int, sms: int):
    """(programs over the rows, splits of the reduction) for the down projection: 128-row blocks, the
    reduction split so that the programs fill the SMs once."""
    programs = triton.cdiv(n_out, 128)
    return programs, max(1, sms // programs)


def product_rows(model, m, device, sms, reps, iters):
    """The ``product`` section for one model and row count."""
    hidden, inter = MODELS[model]
    rows = []
    for product, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        copies = 1 if device.type != "cuda" else max(3, math.ceil(200e6 / (n * k * 2)))  # past the L2
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        ws = [(torch.randn(n, k, device=device) / math.sqrt(k)).to(dtype) for _ in range(copies)]
        x = torch.randn(m, k, device=device).to(dtype)
        ref = x.double() @ ws[0].double().T
        gate, up = ref.chunk(2, dim=-1)
        act_ref = F.silu(gate) * up
        variants = {"cublas": (lambda w: torch.mm(x, w.T), ref)}
        if product == "gate_up":
            y, act = x.new_empty(m, n), x.new_empty(m, n // 2)

            def cublas_act(w):
                torch.mm(x, w.T, out=y)
                _act(y, act)
                return act
            variants["cublas+act"] = (cublas_act, act_ref)
            for programs in (sms, 2 * sms):
                for warps, stages in ((4, 4), (4, 6)):
                    for gated in (False, True):
                        out = x.new_empty(1, m, n // 2 if gated else n)
                        name = f"{'gated' if gated else 'plain'} programs={programs} warps={warps} stages={stages}"
                        variants[name] = (lambda w, o=out, p=programs, g=gated, wa=warps, s=stages:
                                          balanced_linear(x, w, o, p, gated=g, warps=wa, stages=s)[0],
                                          act_ref if gated else ref)
        else:
            programs, splits = _down_split(n, sms)
            for atomic in (False, True):
                if atomic and device.type != "cuda":
                    continue  # the interpreter's atomics on masked 2-D blocks crash (triton 3.x)
                for warps, stages in ((4, 4), (4, 6)):
                    buf = torch.zeros(1 if atomic else splits, m, n, device=device, dtype=torch.float32)

                    def run(w, buf=buf, atomic=atomic, wa=warps, s=stages):
                        if atomic:
                            buf.zero_()
                        balanced_linear(x, w, buf, programs, splits, atomic=atomic, warps=wa, stages=s)
                        return buf.sum(0)  # the partials' sum, a kernel of its own here
                    name = f"split{splits} {'atomic' if atomic else 'partials'} warps={warps} stages={stages}"
                    variants[name] = (run, ref)
        for name, (fn, want) in variants.items():
            try:
                err = _rel_err(fn(ws[0]), want)
            except triton.runtime.errors.OutOfResources as e:  # a tiling too large for the GPU
                print(f"{model} {product} {name}: skipped, {e}", flush=True)
                continue
            weights = itertools.cycle(ws)  # each call reads the next copy, so none is in the L2
            us = time_call(lambda fn=fn: fn(next(weights)), device, reps * copies, iters) * 1e6
            rows.append(dict(section="product", model=model, rows=m, product=product, variant=name, us=round(us, 2),
                             tb_s=round(n * k * x.element_size() / us / 1e6, 3), rel_err=f"{err:.2e}"))
            print(_table(rows[-1:], TABLE).splitlines()[-1], flush=True)
    return rows


def chain_weights(layers, hidden, inter, device, dtype):
    """Per layer, a ``[gate; up]`` weight ``(2 * inter, hidden)`` and a down weight ``(hidden, inter)``."""
    wgu = [(torch.randn(2 * inter, hidden, device=device) / math.sqrt(hidden)).to(dtype) for _ in range(layers)]
    # small down weights keep the residual stream of many layers bounded, so errors stay comparable
    wd = [(0.3 * torch.randn(hidden, inter, device=device) / math.sqrt(inter)).to(dtype) for _ in range(layers)]
    return wgu, wd


def chain_reference(h0, wgu, wd):
    """The MLP chain ``h += down(silu(gate(h)) * up(h))`` over the layers, in float64."""
    ref = h0.double()
    for gu, d in zip(wgu, wd):
        gate, up = (ref @ gu.double().T).chunk(2, dim=-1)
        ref = ref + (F.silu(gate) * up) @ d.double().T
    return ref


def cublas_chain(h0, wgu, wd, hs):
    """The chain as the decode step runs it: cuBLAS gate/up, one activation kernel, cuBLAS down and
    one add kernel per layer, the residuals in ``hs`` (``layers + 1`` buffers). Returns the call."""
    m = h0.shape[0]
    y, act = h0.new_empty(m, wgu[0].shape[0]), h0.new_empty(m, wgu[0].shape[0] // 2)

    def run():
        hs[0].copy_(h0)
        for i in range(len(wgu)):
            torch.mm(hs[i], wgu[i].T, out=y)
            _act(y, act)
            _add(hs[i], torch.mm(act, wd[i].T).unsqueeze(0), hs[i + 1], 1)
        return hs[-1]
    return run


def chain_rows(model, m, layers, device, sms, reps, iters):
    """The ``chain`` section: ``layers`` MLPs with residual adds, per-layer microseconds."""
    hidden, inter = MODELS[model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wgu, wd = chain_weights(layers, hidden, inter, device, dtype)
    h0 = torch.randn(m, hidden, device=device).to(dtype)
    hs = [h0.new_empty(m, hidden) for _ in range(layers + 1)]
    act = h0.new_empty(m, inter)
    programs, splits = _down_split(hidden, sms)
    a, b = row_blocks(triton.cdiv(inter, sms))
    # the gated product's best measured depth (6 stages at 1.5B), within 200 KiB of shared memory
    gate_up_stages = min(6, 200 * 1024 // ((2 * (a + b) + max(16, triton.next_power_of_2(m))) * 64 * 2))
    partials = torch.empty(splits, m, hidden, device=device, dtype=torch.float32)
    summed = torch.zeros(1, m, hidden, device=device, dtype=torch.float32)
    ref = chain_reference(h0, wgu, wd)

    def balanced(atomic, pdl, prefetch_gate_up, prefetch_down):
        def run():
            hs[0].copy_(h0)
            for i in range(layers):
                balanced_linear(hs[i], wgu[i], act.unsqueeze(0), sms, gated=True, stages=gate_up_stages, pdl=pdl,
                                prefetch=prefetch_gate_up)
                if atomic:
                    summed.zero_()
                balanced_linear(act, wd[i], summed if atomic else partials, programs, splits, atomic=atomic,
                                pdl=pdl, prefetch=prefetch_down)
                _add(hs[i], summed if atomic else partials, hs[i + 1], 1 if atomic else splits)
            return hs[layers]
        return run

    variants = {"cublas": cublas_chain(h0, wgu, wd, hs)}
    cuda = device.type == "cuda"
    for atomic in (False, True) if cuda else (False,):
        kind = "atomic" if atomic else "partials"
        variants[f"balanced {kind}"] = balanced(atomic, False, False, False)
        if cuda:
            variants[f"balanced {kind} pdl"] = balanced(atomic, True, False, False)
            variants[f"balanced {kind} pdl prefetch(down)"] = balanced(atomic, True, False, True)
            variants[f"balanced {kind} pdl prefetch(gate_up, down)"] = balanced(atomic, True, True, True)
    rows = []
    for name, fn in variants.items():
        err = _rel_err(fn(), ref)
        us = time_call(fn, device, reps, iters) * 1e6 / layers
        wbytes = 3 * hidden * inter * h0.element_size()
        rows.append(dict(section="chain", model=model, rows=m, product=f"mlp x{layers}", variant=name,
                         us=round(us, 2), tb_s=round(wbytes / us / 1e6, 3), rel_err=f"{err:.2e}"))
        print(_table(rows[-1:], TABLE).splitlines()[-1], flush=True)
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1.5b,0.5b,7b", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--rows", default="64", help="comma list of row counts (at most 128)")
    ap.add_argument("--layers", type=int, default=28, help="layers of the chain section")
    ap.add_argument("--sections", default="product,chain")
    ap.add_argument("--reps", type=int, default=5, help="calls per CUDA graph (per weight copy)")
    ap.add_argument("--iters", type=int, default=20, help="graph replays timed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="CSV to append to (default experiments/results/decode_mlp_<gpu>.csv)")
    args = ap.parse_args(argv)
    args.models = comma_choices(ap, "--models", args.models, MODELS)
    args.sections = comma_choices(ap, "--sections", args.sections, ("product", "chain"))
    try:
        args.rows = _ints(args.rows)
    except ValueError:
        ap.error(f"--rows: expected a comma list of integers, got {args.rows!r}")
    for flag, values in (("--rows", args.rows), ("--layers", [args.layers]), ("--reps", [args.reps]),
                         ("--iters", [args.iters])):
        bad = [v for v in values if v < 1 or (flag == "--rows" and v > 128)]
        if bad:
            ap.error(f"{flag}: expected {'1 to 128' if flag == '--rows' else 'a positive integer'}, got {bad[0]}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu (with TRITON_INTERPRET=1) for the smoke run", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    meta = run_metadata(device)
    rows = []
    for model in args.models:
        for m in args.rows:
            if "product" in args.sections:
                rows += product_rows(model, m, device, sms, args.reps, args.iters)
            if "chain" in args.sections:
                rows += chain_rows(model, m, args.layers, device, sms, args.reps, args.iters)
    rows = [{**meta, **r} for r in rows]
    out = Path(args.out or results_csv("decode_mlp", meta["gpu"], RESULTS))
    append_rows(out, FIELDS, rows)
    print(f"\n{_table(rows, TABLE)}\nappended {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
