"""Does one persistent kernel per MLP beat cuBLAS's chain of launches at decode sizes?

At 64 rows the decode step's MLP (gate/up, activation, down, residual add) is four or five launches
of which each pays a fixed 5-6 us (``bench_decode_mlp.py``: 19.9 us a layer at Qwen2.5-0.5B for
26 MB of weights, 6 us of HBM time). Here the whole block is one launch of one program per SM:

1. ``act[:, rows] = silu(h @ Wg[rows].T) * (h @ Wu[rows].T)`` for the program's share of the
   intermediate columns;
2. a grid barrier (an atomic counter; the program's down-projection weights are prefetched into L2
   before it waits);
3. ``part[s, :, cols] = act[:, span s] @ Wd[cols, span s].T`` for (column block, span) items;
4. ``out = h + sum_s part[s]``: after a second barrier, spread over every program (``fixup=False``),
   or by the last program of each column block to finish its span (``fixup=True``: an arrival count
   per block, no second barrier), summed in span order either way, so the result does not depend on
   which program finishes last.

Off CUDA (the Triton interpreter runs programs one after another, so a barrier would never open) the
three phases run as three launches of the same kernel.

Example (H200):
    PYTHONPATH=components python experiments/probe_persistent_mlp.py --models 0.5b,1.5b
    TRITON_INTERPRET=1 PYTHONPATH=components python experiments/probe_persistent_mlp.py --device cpu \\
        --models tiny --rows 5 --layers 2  # smoke
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
from bench_decode_attention import time_call  # noqa: E402
from bench_decode_mlp import (MODELS, _prefetch_l2, _rel_err, chain_reference, chain_weights,  # noqa: E402
                              cublas_chain, program_rows, row_blocks)
from bench_generation import _table, comma_choices, results_csv, run_metadata  # noqa: E402
from bench_sft import append_rows  # noqa: E402

PHASES = ("gate_up_us", "prefetch_us", "barrier_us", "down_us", "reduce_us", "launch_us")
FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "model", "rows", "layers", "variant", "us_per_layer",
          "tb_s", "rel_err", *PHASES]
TABLE = ["model", "rows", "variant", "us_per_layer", "tb_s", "rel_err"]
#: a second barrier or the fixup, the L2 prefetch at each point, the weights from the L2, a deeper pipeline
DEFAULT_VARIANTS = ("fixup=0;fixup=1;fixup=1,prefetch=0;fixup=1,prefetch=2;fixup=1,prefetch=3;"
                    "fixup=1,prefetch=0,hot=1;fixup=1,prefetch=0,stages=6")


@triton.jit
def _grid_sync(counter_ptr, target):
    # every program's writes before the barrier are visible to every program after it
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stamp(clock_ptr, i, TIMING: tl.constexpr):
    if TIMING:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(clock_ptr + i, t)


@triton.jit
def _prefetch_down(wd_ptr, pid, n_items, NPROG, SPANS, KB_D, INTER, cols_n, BLOCK_N: tl.constexpr,
                   BLOCK_KD: tl.constexpr):
    for item in range(pid, n_items, NPROG):
        cols = (item // SPANS) * BLOCK_N + cols_n
        s = item % SPANS
        for kb in range(s * KB_D // SPANS, (s + 1) * KB_D // SPANS):
            _prefetch_l2(wd_ptr + cols.to(tl.int64) * INTER + kb * BLOCK_KD)


@triton.jit
def _prefetch_gate_up(wgu_ptr, pid, GU_ROWS, INTER, D, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    ra, rb, oka, okb = program_rows(pid, GU_ROWS, INTER, BLOCK_A, BLOCK_B)
    ra = tl.where(oka, ra, pid * GU_ROWS).to(tl.int64)  # masked lanes prefetch the first row again
    rb = tl.where(okb, rb, pid * GU_ROWS).to(tl.int64)
    up = INTER.to(tl.int64) * D
    for k0 in range(0, D, BLOCK_K):
        _prefetch_l2(wgu_ptr + ra * D + k0)
        _prefetch_l2(wgu_ptr + rb * D + k0)
        _prefetch_l2(wgu_ptr + up + ra * D + k0)
        _prefetch_l2(wgu_ptr + up + rb * D + k0)


@triton.jit
def persistent_mlp_kernel(h_ptr, wgu_ptr, wd_ptr, wgu_next_ptr, act_ptr, part_ptr, out_ptr, sync_ptr, clock_ptr,
                          M, D, INTER, GU_ROWS, N_BLOCKS, SPANS, KB_D, NPROG, TIMING: tl.constexpr,
                          PHASE: tl.constexpr, FIXUP: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_KD: tl.constexpr, BLOCK_E: tl.constexpr):
    """One MLP block (``PHASE`` 0: all of it, with grid barriers; 1, 2, 3: one phase, as its own
    launch). ``h``, ``out``: ``(M, D)``; ``wgu``: ``(2 * INTER, D)`` gate rows first; ``wd``:
    ``(D, INTER)``; ``act``: ``(M, INTER)``; ``part``: ``(SPANS, M, D)`` fp32; ``sync``: int32
    counters, zero at the launch (``[0]``, ``[1]``: the barriers, ``[2:]``: arrivals per block)."""
    pid = tl.program_id(0)
    clock_ptr += pid * 6
    _stamp(clock_ptr, 0, TIMING)
    m = tl.arange(0, BLOCK_M)
    okm = m < M
    n_items = N_BLOCKS * SPANS
    if PHASE == 0 and PREFETCH >= 2:
        _prefetch_down(wd_ptr, pid, n_items, NPROG, SPANS, KB_D, INTER, tl.arange(0, BLOCK_N), BLOCK_N, BLOCK_KD)
    if PHASE == 0 or PHASE == 1:
        ra, rb, oka, okb = program_rows(pid, GU_ROWS, INTER, BLOCK_A, BLOCK_B)
        ks = tl.arange(0, BLOCK_K)
        up = INTER.to(tl.int64) * D
        wa_ptrs = wgu_ptr + ra[:, None].to(tl.int64) * D + ks[None, :]
        wb_ptrs = wgu_ptr + rb[:, None].to(tl.int64) * D + ks[None, :]
        x_ptrs = h_ptr + m[:, None] * D + ks[None, :]
        acc_a = tl.zeros((BLOCK_A, BLOCK_M), tl.float32)
        acc_b = tl.zeros((BLOCK_B, BLOCK_M), tl.float32)
        acc_ua = tl.zeros((BLOCK_A, BLOCK_M), tl.float32)
        acc_ub = tl.zeros((BLOCK_B, BLOCK_M), tl.float32)
        for k0 in range(0, D, BLOCK_K):
            okk = (k0 + ks) < D
            xt = tl.trans(tl.load(x_ptrs + k0, mask=okm[:, None] & okk[None, :], other=0.0))
            wa = tl.load(wa_ptrs + k0, mask=oka[:, None] & okk[None, :], other=0.0)
            wb = tl.load(wb_ptrs + k0, mask=okb[:, None] & okk[None, :], other=0.0)
            ua = tl.load(wa_ptrs + up + k0, mask=oka[:, None] & okk[None, :], other=0.0)
            ub = tl.load(wb_ptrs + up + k0, mask=okb[:, None] & okk[None, :], other=0.0)
            acc_a = tl.dot(wa, xt, acc_a)
            acc_b = tl.dot(wb, xt, acc_b)
            acc_ua = tl.dot(ua, xt, acc_ua)
            acc_ub = tl.dot(ub, xt, acc_ub)
        acc_a = acc_a / (1.0 + tl.exp(-acc_a)) * acc_ua
        acc_b = acc_b / (1.0 + tl.exp(-acc_b)) * acc_ub
        tl.store(act_ptr + m[None, :] * INTER + ra[:, None], acc_a.to(act_ptr.dtype.element_ty),
                 mask=okm[None, :] & oka[:, None])
        tl.store(act_ptr + m[None, :] * INTER + rb[:, None], acc_b.to(act_ptr.dtype.element_ty),
                 mask=okm[None, :] & okb[:, None])
    _stamp(clock_ptr, 1, TIMING)
    cols_n = tl.arange(0, BLOCK_N)
    kd = tl.arange(0, BLOCK_KD)
    if PHASE == 0:
        if PREFETCH == 1:  # the down weights depend on nothing this launch writes
            _prefetch_down(wd_ptr, pid, n_items, NPROG, SPANS, KB_D, INTER, cols_n, BLOCK_N, BLOCK_KD)
        if PREFETCH == 3:  # the next layer's gate/up rows of this program
            _prefetch_gate_up(wgu_next_ptr, pid, GU_ROWS, INTER, D, BLOCK_A, BLOCK_B, BLOCK_K)
        _stamp(clock_ptr, 2, TIMING)
        _grid_sync(sync_ptr, NPROG)
    _stamp(clock_ptr, 3, TIMING)
    if PHASE == 0 or PHASE == 2:
        for item in range(pid, n_items, NPROG):
            blk = item // SPANS
            s = item % SPANS
            cols = blk * BLOCK_N + cols_n
            okc = cols < D
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for kb in range(s * KB_D // SPANS, (s + 1) * KB_D // SPANS):
                k = kb * BLOCK_KD + kd
                okk = k < INTER
                at = tl.trans(tl.load(act_ptr + m[:, None] * INTER + k[None, :], mask=okm[:, None] & okk[None, :],
                                      other=0.0, cache_modifier=".cg"))
                w = tl.load(wd_ptr + cols[:, None].to(tl.int64) * INTER + k[None, :],
                            mask=okc[:, None] & okk[None, :], other=0.0)
                acc = tl.dot(w, at, acc)
            tl.store(part_ptr + s * M * D + m[None, :] * D + cols[:, None], acc, mask=okm[None, :] & okc[:, None])
            if FIXUP:
                tl.debug_barrier()
                arrived = tl.atomic_add(sync_ptr + 2 + blk, 1, sem="acq_rel", scope="gpu")
                if arrived == SPANS - 1:  # the block's last span: sum the spans in order
                    tl.debug_barrier()
                    mask = okm[None, :] & okc[:, None]
                    tot = tl.load(h_ptr + m[None, :] * D + cols[:, None], mask=mask, other=0.0).to(tl.float32)
                    for t in range(SPANS):
                        tot += tl.load(part_ptr + t * M * D + m[None, :] * D + cols[:, None], mask=mask, other=0.0,
                                       cache_modifier=".cg")
                    tl.store(out_ptr + m[None, :] * D + cols[:, None], tot.to(out_ptr.dtype.element_ty), mask=mask)
    _stamp(clock_ptr, 4, TIMING)
    if not FIXUP:
        if PHASE == 0:
            _grid_sync(sync_ptr + 1, NPROG)
        if PHASE == 0 or PHASE == 3:
            e = tl.arange(0, BLOCK_E)
            for e0 in range(pid * BLOCK_E, M * D, NPROG * BLOCK_E):
                ok = e0 + e < M * D
                tot = tl.load(h_ptr + e0 + e, mask=ok, other=0.0).to(tl.float32)
                for t in range(SPANS):
                    tot += tl.load(part_ptr + t * M * D + e0 + e, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + e0 + e, tot.to(out_ptr.dtype.element_ty), mask=ok)
    _stamp(clock_ptr, 5, TIMING)


class PersistentMLP:
    """Buffers and launch plan of :func:`persistent_mlp_kernel` for one (rows, hidden, intermediate).

    Args:
        m, d, inter (int): rows, hidden size, intermediate size.
        device, dtype: of the activations and weights.
        nprog (int): programs, one per SM (every program must be resident at once: the barriers wait
            for all of them).
        block_n (int): output columns of a down-projection item.
        spans (int): reduction spans of the down projection (default: enough items for ``nprog``).
        fixup (bool): the last span of a column block sums the spans (else a second barrier).
        prefetch (int): L2 prefetch of the down weights before the barrier (1) or at the start (2),
            of the next layer's gate/up weights (3), or none (0).
        warps, stages, block_k, block_kd (int): the launch's warps and pipeline stages, the gate/up
            and down reduction blocks.

    Example:
        >>> mlp = PersistentMLP(64, 896, 4864, dev, torch.bfloat16, 132, fixup=True, prefetch=0)
        >>> sync = torch.zeros(mlp.sync_words(), device=dev, dtype=torch.int32)  # zero before each call
        >>> mlp(h, w_gate_up, w_down, out, sync)  # out = h + down(silu(gate(h)) * up(h))
    """

    def __init__(self, m, d, inter, device, dtype, nprog, block_n=64, spans=None, fixup=False, prefetch=1,
                 warps=4, stages=4, block_k=64, block_kd=64):
        self.m, self.d, self.inter, self.nprog = m, d, inter, nprog
        self.gu_rows = triton.cdiv(inter, nprog)
        self.block_a, self.block_b = row_blocks(self.gu_rows)
        self.block_n = min(block_n, max(16, triton.next_power_of_2(d)))
        self.n_blocks = triton.cdiv(d, self.block_n)
        self.kb_d = triton.cdiv(inter, block_kd)
        self.spans = spans or max(1, min(self.kb_d, nprog // self.n_blocks))
        self.fixup, self.prefetch, self.warps, self.stages = fixup, prefetch, warps, stages
        self.block_k, self.block_kd = block_k, block_kd
        self.act = torch.empty(m, inter, device=device, dtype=dtype)
        self.part = torch.empty(self.spans, m, d, device=device, dtype=torch.float32)
        self.persistent = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        self.clock = None  # (nprog, 6) int64 to record each program's phase boundaries (ns)

    def sync_words(self) -> int:
        """Length of the int32 ``sync`` buffer a call takes: two barriers and one count per block."""
        return 2 + self.n_blocks

    def __call__(self, h, wgu, wd, out, sync, wgu_next=None):
        clock = self.clock if self.clock is not None else sync
        args = (h, wgu, wd, wgu if wgu_next is None else wgu_next, self.act, self.part, out, sync, clock, self.m,
                self.d, self.inter, self.gu_rows, self.n_blocks, self.spans, self.kb_d, self.nprog)
        meta = dict(TIMING=self.clock is not None, FIXUP=self.fixup, PREFETCH=self.prefetch,
                    BLOCK_M=max(16, triton.next_power_of_2(self.m)), BLOCK_A=self.block_a, BLOCK_B=self.block_b,
                    BLOCK_K=self.block_k, BLOCK_N=self.block_n, BLOCK_KD=self.block_kd, BLOCK_E=512,
                    num_warps=self.warps, num_stages=self.stages)
        if self.persistent:
            persistent_mlp_kernel[(self.nprog,)](*args, PHASE=0, **meta)
        else:
            for phase in (1, 2) if self.fixup else (1, 2, 3):
                persistent_mlp_kernel[(self.nprog,)](*args, PHASE=phase, **meta)
        return out


def variant_options(name: str) -> dict:
    """``"fixup=1,prefetch=0"`` -> ``{"fixup": True, "prefetch": 0}`` (``fixup``, ``hot``: flags)."""
    options = {}
    for item in filter(None, name.split(",")):
        key, _, value = item.partition("=")
        if key not in ("fixup", "hot", "prefetch", "block_n", "spans", "warps", "stages", "block_k", "block_kd"):
            raise ValueError(f"--variants: unknown option {key!r} in {name!r}")
        options[key] = value == "1" if key in ("fixup", "hot") else int(value)
    return options


def chain(model, m, layers, device, sms, reps, iters, variants):
    """The MLP of ``layers`` layers (distinct weights) by cuBLAS and by each persistent variant:
    microseconds per layer and the error against float64."""
    hidden, inter = MODELS[model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wgu, wd = chain_weights(layers, hidden, inter, device, dtype)
    h0 = torch.randn(m, hidden, device=device).to(dtype)
    hs = [h0.new_empty(m, hidden) for _ in range(layers + 1)]
    ref = chain_reference(h0, wgu, wd)

    def persistent(hot=False, **kw):
        mlp = PersistentMLP(m, hidden, inter, device, dtype, sms, **kw)
        sync = torch.zeros(layers, mlp.sync_words(), device=device, dtype=torch.int32)

        def run():
            sync.zero_()
            hs[0].copy_(h0)
            for i in range(layers):
                j, nxt = (0, 0) if hot else (i, (i + 1) % layers)  # hot: one layer's weights, from the L2
                mlp(hs[i], wgu[j], wd[j], hs[i + 1], sync[i], wgu[nxt])
            return hs[layers]
        run.sync, run.mlp, run.hot = sync, mlp, hot
        return run

    fns = {"cublas": cublas_chain(h0, wgu, wd, hs)}
    fns.update({name: persistent(**variant_options(name)) for name in variants})
    rows = []
    for name, fn in fns.items():
        got = fn()
        err = float("nan") if getattr(fn, "hot", False) else _rel_err(got, ref)
        if hasattr(fn, "sync") and fn.mlp.persistent:  # each program passed each barrier once
            want = 1 if fn.mlp.fixup else 2
            seen = fn.sync[:, :want].cpu()
            if not bool((seen == sms).all()):
                raise RuntimeError(f"{name}: barrier counters {seen.tolist()}, expected {sms} each")
        us = time_call(fn, device, reps, iters) * 1e6 / layers
        wbytes = 3 * hidden * inter * h0.element_size()
        rows.append(dict(model=model, rows=m, layers=layers, variant=name, us_per_layer=round(us, 2),
                         tb_s=round(wbytes / us / 1e6, 3), rel_err=f"{err:.2e}"))
        print(_table(rows[-1:], TABLE).splitlines()[-1], flush=True)
    return rows


def phase_profile(model, m, device, sms, options, layers=24, iters=20):
    """Each phase's length in one launch (the last layer of a chain of ``layers``, launched one after
    another ``iters`` times): medians over the programs and the launches, in microseconds."""
    hidden, inter = MODELS[model]
    mlp = PersistentMLP(m, hidden, inter, device, torch.bfloat16, sms, **options)
    mlp.clock = torch.zeros(sms, 6, device=device, dtype=torch.int64)
    wgu, wd = chain_weights(layers, hidden, inter, device, torch.bfloat16)
    hs = [torch.randn(m, hidden, device=device).to(torch.bfloat16) for _ in range(layers + 1)]
    sync = torch.zeros(layers, mlp.sync_words(), device=device, dtype=torch.int32)
    stamps = []
    for it in range(iters):
        sync.zero_()
        for i in range(layers):
            mlp(hs[i], wgu[i], wd[i], hs[i + 1], sync[i], wgu[(i + 1) % layers])
        if it >= 3:  # past compilation and warm-up
            stamps.append(mlp.clock.double() / 1e3)
    c = torch.stack(stamps)  # (launches, programs, 6) us
    lengths = (c[:, :, 1:] - c[:, :, :-1]).flatten(0, 1).median(dim=0).values
    whole = (c[:, :, 5].amax(1) - c[:, :, 0].amin(1)).median()
    return {**{n: round(v.item(), 2) for n, v in zip(PHASES[:-1], lengths)}, PHASES[-1]: round(whole.item(), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--rows", default="64")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="';'-separated persistent variants, each a ','-separated list of key=value options "
                         "(fixup, prefetch 0-3, hot, block_n, spans, warps, stages, block_k, block_kd)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--phases", action="store_true", help="also time each phase inside a launch (CUDA)")
    args = ap.parse_args(argv)
    models = comma_choices(ap, "--models", args.models, MODELS)
    variants = args.variants.split(";")
    try:
        for name in variants:
            variant_options(name)
    except ValueError as e:
        ap.error(str(e))
    device = torch.device(args.device)
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    meta = run_metadata(device)
    rows = []
    for model in models:
        for m in [int(r) for r in args.rows.split(",")]:
            rows += chain(model, m, args.layers, device, sms, args.reps, args.iters, variants)
    if args.phases and device.type == "cuda":
        for row in rows:
            if row["variant"] == "cublas":
                continue
            options = variant_options(row["variant"])
            # hot rows: one layer's weights from the L2; the phase profile reads every layer's
            if not options.pop("hot", False):
                row.update(phase_profile(row["model"], row["rows"], device, sms, options))
    rows = [{**meta, **r} for r in rows]
    if device.type == "cuda" or args.out:
        out = Path(args.out or results_csv("persistent_mlp", meta["gpu"], RESULTS))
        append_rows(out, FIELDS, rows)
        print(f"appended {len(rows)} rows to {out}")
    print(_table(rows, TABLE + (list(PHASES) if args.phases else [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
