"""Decode GEMMs split along the reduction into cuBLAS batches, the partial sums left to inductor.

At 64 rows cuBLAS runs the decode step's down projection as a split-K GEMM plus its own reduction
kernel (``splitKreduce_kernel``): two launches, the second a full launch gap after the first. The
question here: is a batched GEMM over ``s`` slices of the reduction, written in fp32
(``torch.bmm(..., out_dtype=torch.float32)``), whose ``s`` partials the next inductor kernel sums
(with the residual add and the next norm it runs anyway), faster than that, for each of a layer's
products, and in the MLP as the compiled step runs it?

One CSV (``benchmarks/results/split_gemm_<gpu>.csv``), its kind in ``section``:

* ``product``: one product at ``--rows`` rows, ``F.linear`` (``splits`` 0) or the batched split
  into ``splits`` slices plus the sum cast to bf16, compiled and in a CUDA graph over enough weight
  copies that the weights come from HBM: microseconds per product and the largest error against
  float64 relative to the output's largest value;
* ``chain``: the MLP of ``--layers`` layers (distinct weights), each layer one compiled function
  (norm, gate/up, activation, down, residual add), with the gate/up and down splits given:
  microseconds per layer.

Example (H200):
    PYTHONPATH=components python experiments/probe_split_gemm.py --models 1.5b,0.5b,7b
"""

import argparse
import os
import sys

import torch
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
from bench_decode_attention import time_call  # noqa: E402
from bench_generation import _table, save_rows  # noqa: E402

#: (hidden, intermediate, query width, key/value width) of Qwen2.5's layers
MODELS = {"0.5b": (896, 4864, 896, 128), "1.5b": (1536, 8960, 1536, 256), "7b": (3584, 18944, 3584, 512)}
FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "section", "model", "rows", "product", "splits", "us",
          "rel_err"]
TABLE = ["section", "model", "rows", "product", "splits", "us", "rel_err"]


def split_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """``x @ weight.T`` in fp32: ``splits`` cuBLAS batches over slices of the reduction, summed."""
    rows, k = x.shape
    if splits == 0:
        return F.linear(x, weight)
    ks = k // splits
    a = x.view(rows, splits, ks).transpose(0, 1)
    b = weight.view(weight.shape[0], splits, ks).permute(1, 2, 0)
    return torch.bmm(a, b, out_dtype=torch.float32).sum(0)


def _rms(h, w):
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(h.dtype)


def mlp_layer(h, norm, w_gu, w_down, s_gu, s_down):
    """One layer's MLP block as the decode step runs it: norm, gate/up, activation, down, residual."""
    y = split_linear(_rms(h, norm), w_gu, s_gu)
    gate, up = y.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(h.dtype)
    return h + split_linear(act, w_down, s_down).to(h.dtype)


def splits_of(k: int, choices=(2, 3, 4, 5, 7, 8, 14, 16)):
    """The split counts whose slices are whole 16-byte bf16 rows (``k / s`` a multiple of 8)."""
    return [s for s in choices if k % s == 0 and (k // s) % 8 == 0 and k // s >= 256]


def product_rows(model, rows, device, reps, iters, names=("qkv", "o", "gate_up", "down")):
    hid, inter, qw, kvw = MODELS[model]
    products = {"qkv": (qw + 2 * kvw, hid), "o": (hid, qw), "gate_up": (2 * inter, hid), "down": (hid, inter)}
    out = []
    for name, (n, k) in products.items():
        if name not in names:
            continue
        copies = max(2, -(-(512 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        ref = (x.double() @ ws[0].double().T)
        for s in [0] + splits_of(k):
            fn = torch.compile(lambda x, w, s=s: split_linear(x, w, s).to(torch.bfloat16), fullgraph=True,
                               dynamic=False)
            got = fn(x, ws[0]).double()
            err = ((got - ref).abs().max() / ref.abs().max()).item()

            def call(fn=fn):
                for w in ws:
                    fn(x, w)

            us = time_call(call, device, reps, iters) / copies * 1e6
            out.append(dict(section="product", model=model, rows=rows, product=name, splits=s, us=f"{us:.2f}",
                            rel_err=f"{err:.2e}"))
            print(_table([out[-1]], TABLE).splitlines()[-1], flush=True)
    return out


def chain_rows(model, rows, layers, device, reps, iters, plans):
    hid, inter, _, _ = MODELS[model]
    norms = [1 + 0.1 * torch.randn(hid, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    gate_ups = [torch.randn(2 * inter, hid, device=device, dtype=torch.bfloat16) * hid ** -0.5
                for _ in range(layers)]
    downs = [torch.randn(hid, inter, device=device, dtype=torch.bfloat16) * inter ** -0.5 for _ in range(layers)]
    h0 = torch.randn(rows, hid, device=device, dtype=torch.bfloat16)
    out = []
    base = None
    for s_gu, s_down in plans:
        if (s_gu and s_gu not in splits_of(hid)) or (s_down and s_down not in splits_of(inter)):
            continue
        layer = torch.compile(lambda h, n, g, d, a=s_gu, b=s_down: mlp_layer(h, n, g, d, a, b), fullgraph=True,
                              dynamic=False)

        def fn(h, layer=layer):
            for n, g, d in zip(norms, gate_ups, downs):
                h = layer(h, n, g, d)
            return h

        got = fn(h0).double()
        if base is None:
            base = got
        err = ((got - base).abs().max() / base.abs().max()).item()
        us = time_call(lambda: fn(h0), device, reps, iters) / layers * 1e6
        out.append(dict(section="chain", model=model, rows=rows, product="mlp", splits=f"{s_gu}/{s_down}",
                        us=f"{us:.2f}", rel_err=f"{err:.2e}"))
        print(_table([out[-1]], TABLE).splitlines()[-1], flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1.5b,0.5b,7b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sections", default="product,chain")
    ap.add_argument("--products", default="qkv,o,gate_up,down", help="the products of the product section")
    ap.add_argument("--plans", default="0/0,0/2,0/4,0/5,0/7,0/8,0/14,2/0,2/7,2/8,0/0",
                    help="gate_up/down split counts of the chain section (0: F.linear)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    torch._inductor.config.triton.enable_pdl = True  # as the compiled step runs
    torch._dynamo.config.recompile_limit = 1 << 10  # one compiled function per split count
    rows = []
    for model in args.models.split(","):
        if "product" in args.sections:
            rows += product_rows(model, args.rows, device, args.reps, args.iters, args.products.split(","))
        if "chain" in args.sections:
            plans = [tuple(int(s) for s in plan.split("/")) for plan in args.plans.split(",")]
            rows += chain_rows(model, args.rows, args.layers, device, 1, args.iters, plans)
    save_rows("split_gemm", FIELDS, rows, device, args.out, folder=RESULTS)
    print(_table(rows, TABLE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
