"""Forward-only head (``impl="triton"``): time against the size of the logits tiles, on a GPU.

The forward walks (row block x V slab) tiles of logits through cuBLAS and the Triton statistics
kernels (``ops/triton/head.py``). Larger tiles make larger, faster GEMMs but cost workspace: the
no-grad pass keeps under 0.1 GiB extra (the memory target), the pass followed by a backward may use the
backward's own 224 MiB. For each head shape, workspace (MiB) and row-block cap, this prints the
error of log-probs / entropy against float64 (a row sample; plain PyTorch's beside it) and the
time in units of one bf16 ``torch.matmul`` of (N x H) by (H x V) measured back to back in the same
rep (median of per-rep ratios: the clocks drift under load).

    PYTHONPATH=components python experiments/sweep_forward_workspace.py --shapes qwen7b,qwen05b \
        --out experiments/results/forward_workspace_h200.csv

H200, torch 2.11 (``experiments/results/forward_workspace_h200.csv``): 80 MiB (the no-grad
default) 1.16 GEMMs at the 7B head and 1.50 at the 0.5B head; 160 MiB 1.13 / 1.41.
"""

import argparse
import csv
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_head import rel  # noqa: E402  (the same error measure as the head benchmark)
from logitless.ops.triton import head  # noqa: E402

SHAPES = {"qwen7b": (8192, 3584, 152064), "llama8b": (8192, 4096, 128256),
          "qwen05b": (16384, 896, 151936), "long": (32768, 3584, 152064)}
WORKSPACES_MIB = (16, 32, 48, 80, 160, 224)
BLOCK_ROWS = (1024, 2048, 4096)


def _time(fn, gemm, reps):
    ratios, times = [], []
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record(); gemm(); ev[1].record()  # noqa: E702
        ev[2].record(); fn(); ev[3].record()  # noqa: E702
        torch.cuda.synchronize()
        g, t = ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])
        ratios.append(t / g)
        times.append(t)
    return statistics.median(times), statistics.median(ratios)


def _reference(h, w, y, inv_t, rows):
    z = (h[rows].double() @ w.double().t()) * inv_t
    lse = z.logsumexp(-1)
    p = (z - lse[:, None]).exp()
    return z.gather(1, y[rows][:, None]).squeeze(1) - lse, lse - (p * z).sum(-1)


def sweep(name, reps, temperature):
    """Rows of the table for one head shape."""
    n, hid, vocab = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hid, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hid, device="cuda", generator=g) * (2 / hid**0.5)).bfloat16()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    inv_t = 1.0 / temperature
    rows = torch.randperm(n, device="cuda", generator=g)[:512]
    ref_lp, ref_ent = _reference(h, w, y, inv_t, rows)
    plain_lp = ((h[rows] @ w.t()).float() * inv_t).log_softmax(-1).gather(1, y[rows][:, None]).squeeze(1)
    plain_err = rel(plain_lp, ref_lp)
    out = torch.empty(n, vocab, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: torch.matmul(h, w.t(), out=out)  # noqa: E731
    table = []
    for ws in WORKSPACES_MIB:
        for block_rows in BLOCK_ROWS:
            saved = head.MAX_BLOCK_ROWS, head.FORWARD_WORKSPACE_BYTES
            head.MAX_BLOCK_ROWS, head.FORWARD_WORKSPACE_BYTES = block_rows, ws << 20
            fn = lambda: head._forward(h, w, y, None, -100, inv_t, for_backward=False)  # noqa: E731
            try:
                lp, ent, _ = fn()
                err = max(rel(lp[rows], ref_lp), rel(ent[rows], ref_ent))
                for _ in range(3):
                    fn(); gemm()  # noqa: E702
                torch.cuda.synchronize()
                ms, ratio = _time(fn, gemm, reps)
            finally:
                head.MAX_BLOCK_ROWS, head.FORWARD_WORKSPACE_BYTES = saved
            table.append(dict(shape=name, workspace_mib=ws, block_rows=block_rows, ms=round(ms, 3),
                              gemms=round(ratio, 3), err=f"{err:.2e}", plain_err=f"{plain_err:.2e}"))
            print(table[-1], flush=True)
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen7b,qwen05b")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    table = []
    for name in args.shapes.split(","):
        table += sweep(name, args.reps, args.temperature)
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    if args.out:
        with open(args.out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=["gpu", "torch", "triton"] + list(table[0]))
            wr.writeheader()
            for r in table:
                wr.writerow(dict(gpu=dev, torch=torch.__version__, triton=triton.__version__, **r))
    print(f"\n{dev}, torch {torch.__version__}")
    print(f"{'shape':8} {'MiB':>4} {'rows':>5} {'ms':>8} {'GEMMs':>6} {'err':>9} {'plain':>9}")
    for r in table:
        print(f"{r['shape']:8} {r['workspace_mib']:>4} {r['block_rows']:>5} {r['ms']:>8} {r['gemms']:>6} "
              f"{r['err']:>9} {r['plain_err']:>9}")


if __name__ == "__main__":
    main()
