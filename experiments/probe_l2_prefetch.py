"""Probe: do a decode layer's output and MLP GEMMs (64 rows, cuBLAS) run faster when the latency-bound
window before them (the attention, stood in for by ``torch.cuda._sleep``) prefetches their weights into L2?

Each "layer" is one of 12 weight copies (so the weights come from HBM): an optional prefetch kernel over
a share of its weights, the window, then ``o = a @ Wo.T``, the residual add, ``gate/up``, ``silu * up`` and
``down``, captured in one CUDA graph. The same graph without the GEMMs gives the prefetch + window floor;
``gemms_us`` is the difference. Prefetches: ``bulk`` = one ``cp.async.bulk.prefetch.L2`` per chunk,
``line`` = one ``prefetch.global.L2::evict_last`` per 128-byte line. Shares: a whole matrix, the first
``frac`` of every row (the start of every tile's K loop), or the first ``frac`` of every KiB.

Usage (a CUDA GPU of compute capability 9.0+)::

    python experiments/probe_l2_prefetch.py experiments/results/decode_l2_prefetch_h200.csv
"""

import csv
import datetime
import itertools
import sys

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

MODELS = {"0.5b": (896, 4864), "1.5b": (1536, 8960)}  # hidden, intermediate
ROWS, COPIES = 64, 12


@triton.jit
def bulk_prefetch_kernel(base_ptr, n_chunks, chunk_bytes, stride_bytes, sink_ptr, BLOCK: tl.constexpr):
    """Chunk ``c`` (``chunk_bytes`` at ``base + c * stride_bytes``) into L2 with one bulk prefetch."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_chunks
    addr = base_ptr + tl.where(ok, i, 0).to(tl.int64) * stride_bytes
    size = tl.where(ok, chunk_bytes, 16) + 0 * i
    r = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + i, r, mask=r != 0)  # never stores: keeps the asm alive


@triton.jit
def line_prefetch_kernel(base_ptr, n_chunks, chunk_bytes, stride_bytes, sink_ptr, LINES: tl.constexpr,
                         BLOCK: tl.constexpr):
    """The same chunks, one 128-byte line per lane."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = k // LINES
    j = k % LINES
    ok = (c < n_chunks) & (j * 128 < chunk_bytes)
    addr = base_ptr + tl.where(ok, c.to(tl.int64) * stride_bytes + j * 128, 0)
    r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [addr], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + k, r, mask=r != 0)


def prefetch(kind, weight, frac, how, sink):
    """Prefetches the share ``frac`` of ``weight`` (``how``: "rows" or "kib") with kernel ``kind``."""
    n, k = weight.shape
    if frac >= 1.0:
        n_chunks, chunk, stride = weight.numel() * 2 // 16384, 16384, 16384
    elif how == "rows":
        n_chunks, chunk, stride = n, int(frac * k * 2), k * 2
    else:
        n_chunks, chunk, stride = weight.numel() * 2 // 1024, int(frac * 1024), 1024
    chunk = max(16, chunk // 16 * 16)
    base = weight.view(-1).view(torch.uint8)
    if kind == "bulk":
        bulk_prefetch_kernel[(triton.cdiv(n_chunks, 128),)](base, n_chunks, chunk, stride, sink, BLOCK=128)
    else:
        lines = triton.cdiv(chunk, 128)
        line_prefetch_kernel[(triton.cdiv(n_chunks * lines, 512),)](base, n_chunks, chunk, stride, sink,
                                                                     LINES=lines, BLOCK=512)


def main(out):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sink = torch.zeros(1 << 24, dtype=torch.int32, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        torch.cuda._sleep(20000)
    end.record()
    torch.cuda.synchronize()
    cycles_per_us = 20000 * 100 / (start.elapsed_time(end) * 1000)
    common = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(dev),
                  torch=torch.__version__, triton=triton.__version__)
    rows = []
    for model, (hid, inter) in MODELS.items():
        weights = {"o": [torch.randn(hid, hid, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)],
                   "gu": [torch.randn(2 * inter, hid, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)],
                   "d": [torch.randn(hid, inter, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]}
        a, res = (torch.randn(ROWS, hid, device=dev, dtype=torch.bfloat16) for _ in range(2))
        o, gu, d = ("o", 1.0, "rows"), lambda f: ("gu", f, "rows"), ("d", 0.25, "kib")
        variants = {"none": [], "o": [o], "o+gu25": [o, gu(0.25)], "o+gu40": [o, gu(0.4)], "o+gu60": [o, gu(0.6)],
                    "o+gu100": [o, gu(1.0)], "o+gu40+d25seg": [o, gu(0.4), d]}
        if model == "0.5b":  # the whole layer fits the L2
            variants["o+gu100+d100"] = [o, gu(1.0), ("d", 1.0, "rows")]

        def chain(spec, kind, window_us, gemms):
            for i in range(COPIES):
                for name, frac, how in spec:
                    prefetch(kind, weights[name][i], frac, how, sink)
                torch.cuda._sleep(int(window_us * cycles_per_us))
                if gemms:
                    x = F.linear(a, weights["o"][i]) + res
                    h = F.linear(x, weights["gu"][i])
                    F.linear(F.silu(h[:, :inter]) * h[:, inter:], weights["d"][i])

        graphs = {}
        side = torch.cuda.Stream()
        for (name, spec), kind, window, gemms in itertools.product(variants.items(), ("bulk", "line"), (13.0, 6.0),
                                                                    (True, False)):
            if name == "none" and kind == "line":
                continue
            with torch.cuda.stream(side):
                chain(spec, kind, window, gemms)  # compile and warm up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(spec, kind, window, gemms)
            graphs[(name, kind, window, gemms)] = graph
        times = {key: [] for key in graphs}
        for _ in range(3):
            for key, graph in graphs.items():
                graph.replay()
                torch.cuda.synchronize()
                start.record()
                for _ in range(20):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                times[key].append(start.elapsed_time(end) * 1000 / 20 / COPIES)
        for (name, kind, window, gemms), ts in times.items():
            if gemms:
                floor = min(times[(name, kind, window, False)])
                rows.append(dict(common, model=model, variant=name, kind=kind, window_us=window,
                                 layer_us=round(min(ts), 2), prefetch_and_window_us=round(floor, 2),
                                 gemms_us=round(min(ts) - floor, 2)))
        del weights, graphs
        torch.cuda.empty_cache()
    with open(out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(*(r[k] for k in ("model", "variant", "kind", "window_us", "layer_us", "prefetch_and_window_us",
                                "gemms_us")))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode_l2_prefetch.csv")
