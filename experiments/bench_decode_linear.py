"""The decode step's linear layers alone: cuBLAS against :func:`decode_linear.decode_linear` (this folder).

For each model's decode products at ``--rows`` rows (Qwen2.5 shapes; ``qkv``: the concatenated
q/k/v projection with its bias, ``o``: the attention output, ``gate_up``: the MLP's concatenated
gate/up projection, ``down``) it times

* ``cublas``: ``F.linear`` (for ``gate_up`` the GEMM alone: the activation is not counted);
* ``cublas_act`` (``gate_up`` only): ``F.linear`` then ``silu(gate) * up``, as the decode step ran it
  before ``decode_linear``, compiled the same way (``torch.compile`` fuses the activation);
* ``triton``: ``decode_linear`` with its default tiling (for ``gate_up`` the activation included),
  and with every tiling of ``--sweep`` (``block_n x block_k x splits x warps x stages``; for
  ``gate_up`` also ``triton_sweep_plain``: gate and up as one product without the activation, so
  that it can split the reduction);
* ``triton_pdl``: the default tiling as programmatic dependent launches (each call may start, and
  read its first weight block, while the one before finishes), as the decode step launches it;
* ``quack`` / ``quack_tuned`` (when ``quack-kernels`` is installed): QuACK's CuTe-DSL Hopper GEMM
  (``quack.gemm_interface.gemm``, its default configuration / its autotuner), which launches as a
  programmatic dependent launch and waits for its predecessor (for ``gate_up`` the GEMM alone).

Each method is a CUDA graph of one call per weight copy, over enough copies (``--min-bytes``) that
the weights come from HBM, not L2, as a step's layers do; the time is per call. ``of_copy_bw`` is the
weight bytes at the device-to-device copy bandwidth measured in the same run, divided by the time.
``max_err`` is the largest absolute difference from float64, ``ref_err`` cuBLAS's.

Example (H200):
    PYTHONPATH=components python experiments/bench_decode_linear.py --models 0.5b,1.5b,7b --rows 16,64
    PYTHONPATH=components python experiments/bench_decode_linear.py --models 1.5b --rows 64 --sweep
"""

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "benchmarks")]  # decode_linear here; the benchmarks' helpers
from bench_decode_attention import _ints, time_call  # noqa: E402
from bench_generation import (_gpu_name, _table, _version, comma_choices, copy_bandwidth,  # noqa: E402
                              results_csv)
from bench_sft import append_rows  # noqa: E402

from logitless._platform import sm_count  # noqa: E402
from decode_linear import DecodeLinearLaunch, decode_linear, decode_linear_launch, decode_linear_reference  # noqa: E402

#: hidden, query heads, K/V heads, head_dim, intermediate (torchtune's Qwen2.5 builders).
MODELS = {"0.5b": (896, 14, 2, 64, 4864), "1.5b": (1536, 12, 2, 128, 8960), "7b": (3584, 28, 4, 128, 18944),
          "tiny": (64, 4, 2, 16, 160)}
PRODUCTS = ("qkv", "o", "gate_up", "down")
METHODS = ("cublas", "cublas_act", "triton", "triton_pdl", "quack", "quack_tuned")
FIELDS = ["date", "gpu", "torch", "triton", "model", "rows", "product", "n", "k", "method", "block_n", "block_k",
          "splits", "num_warps", "num_stages", "us", "bytes", "copy_gbps", "roofline_us", "of_copy_bw", "max_err",
          "ref_err", "status"]


def quack_linear(x, w, bias=None, tuned=False, out=None):
    """``F.linear(x, w, bias)`` through QuACK's CuTe-DSL GEMM (``quack-kernels``, imported here so that
    the benchmarks run without it)."""
    from quack.gemm_interface import gemm

    return gemm(x, w.t(), out=out, bias=bias, tuned=tuned)


def product_shapes(model):
    """``{product: (n, k, gated, bias)}``: ``n`` output columns (gated: per half) of a ``k``-wide input."""
    hidden, heads, kv_heads, head_dim, inter = MODELS[model]
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden, False, True),
            "o": (hidden, heads * head_dim, False, False),
            "gate_up": (inter, hidden, True, False), "down": (hidden, inter, False, False)}


def time_calls(calls, device, reps=10):
    """Seconds per call of ``calls`` (closures, one per weight copy): one graph of each call once, replayed."""
    cycle = itertools.cycle(calls)
    return time_call(lambda: next(cycle)(), device, len(calls), reps)


def sweep_launches(k, gated):
    blocks_n, blocks_k, splits, warps, stages = (64, 128, 256), (64, 128), (1, 2, 4, 8, 16, 24), (4, 8), (3, 4)
    for bn, bk, s, w, st in itertools.product(blocks_n, blocks_k, splits, warps, stages):
        # gated: one span (the activation needs the whole sum); shared memory: the stages' tiles fit
        if gated and s > 1 or bk > k or st * (bn * (2 if gated else 1) + 64) * bk * 2 > 200 * 1024:
            continue
        span = -(-(-(-k // s)) // bk) * bk
        if s > 1 and -(-k // span) != s:
            continue
        yield DecodeLinearLaunch(bn, bk, span, w, st)


def bench(args):
    device = torch.device(args.device)
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth(device)
    common = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  gpu=_gpu_name(device), torch=torch.__version__, triton=_version("triton"))
    out_rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for model in args.models:
        for product in args.products:
            n, k, gated, has_bias = product_shapes(model)[product]
            w_rows = 2 * n if gated else n
            nbytes = w_rows * k * 2
            copies = max(2, min(64, -(-args.min_bytes // nbytes)))
            weights = [torch.randn(w_rows, k, generator=gen, device=device).mul_(k ** -0.5).to(dtype)
                       for _ in range(copies)]
            bias = torch.randn(n, generator=gen, device=device).to(dtype) if has_bias else None
            act = torch.compile(lambda y: F.silu(y[:, :n]) * y[:, n:])
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
                want = decode_linear_reference(x, weights[0], bias, gated=gated)
                plain = F.linear(x.double(), weights[0].double(), None if bias is None else bias.double())
                methods = [("cublas", None, lambda w: F.linear(x, w, bias))]
                if gated:
                    methods.append(("cublas_act", None, lambda w: act(F.linear(x, w))))
                default = decode_linear_launch(n, k, gated, sm_count(device))
                methods += [("triton", default, None), ("triton_pdl", default, None)]
                methods += [(name, None, lambda w, tuned=name == "quack_tuned": quack_linear(x, w, bias, tuned))
                            for name in ("quack", "quack_tuned")]
                methods = [m for m in methods if m[0] in args.methods]
                if args.sweep:
                    methods += [("triton_sweep", launch, None) for launch in sweep_launches(k, gated)]
                    if gated:  # gate and up as one plain product (split-K possible), the activation after it
                        methods += [("triton_sweep_plain", launch, None) for launch in sweep_launches(k, False)]
                for name, launch, fn in methods:
                    row = dict(common, model=model, rows=rows, product=product, n=n, k=k, method=name, bytes=nbytes,
                               status="ok")
                    if launch is not None:
                        row.update(block_n=launch.block_n, block_k=launch.block_k, splits=launch.splits(k),
                                   num_warps=launch.num_warps, num_stages=launch.num_stages)
                        g = gated and name != "triton_sweep_plain"
                        fn = (lambda w, launch=launch, pdl=name == "triton_pdl", g=g:
                              decode_linear(x, w, None if gated else bias, gated=g, launch=launch, programmatic=pdl))
                    try:
                        got = fn(weights[0]).double()
                        if name in ("cublas", "triton_sweep_plain", "quack", "quack_tuned") and gated:
                            ref_err = (got - plain).abs().max().item()
                            err = ref_err
                        else:
                            err = (got - want).abs().max().item()
                            ref_err = ""
                        seconds = time_calls([lambda w=w: fn(w) for w in weights], device)
                        roof = nbytes / bandwidth
                        row.update(us=round(seconds * 1e6, 2), copy_gbps=round(bandwidth / 1e9, 1),
                                   roofline_us=round(roof * 1e6, 2), of_copy_bw=round(roof / seconds, 3),
                                   max_err=f"{err:.2e}", ref_err=ref_err if ref_err == "" else f"{ref_err:.2e}")
                    except Exception as exc:  # one failing tiling must not hide the others' numbers
                        row.update(status=f"error: {type(exc).__name__}: {str(exc)[:120]}")
                    out_rows.append(row)
                    if not name.startswith("triton_sweep"):
                        print(f"[{model} rows={rows} {product}] {name}: {row.get('us', '-')} us "
                              f"({row.get('of_copy_bw', '-')} of copy bw) err {row.get('max_err', '-')} "
                              f"{row['status']}", flush=True)
                if args.sweep:
                    swept = [r for r in out_rows if r["method"].startswith("triton_sweep") and r["model"] == model
                             and r["rows"] == rows and r["product"] == product and "us" in r]
                    for r in sorted(swept, key=lambda r: r["us"])[:6]:
                        print(f"    {r['method']}: {r['us']} us ({r['of_copy_bw']}) block_n={r['block_n']} "
                              f"block_k={r['block_k']} splits={r['splits']} warps={r['num_warps']} "
                              f"stages={r['num_stages']}", flush=True)
            del weights
    return out_rows, bandwidth


TABLE_COLUMNS = ["model", "rows", "product", "method", "block_n", "block_k", "splits", "num_warps", "num_stages",
                 "us", "roofline_us", "of_copy_bw", "max_err", "status"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="0.5b,1.5b,7b", help=f"comma list of {list(MODELS)}")
    ap.add_argument("--rows", type=_ints, default=[16, 64])
    ap.add_argument("--products", default=",".join(PRODUCTS), help=f"comma list of {list(PRODUCTS)}")
    ap.add_argument("--methods", default="cublas,cublas_act,triton,triton_pdl",
                    help=f"comma list of {list(METHODS)} (quack*: needs quack-kernels)")
    ap.add_argument("--sweep", action="store_true", help="also time every tiling of the sweep")
    ap.add_argument("--min-bytes", type=int, default=400 * 2**20,
                    help="weight copies per graph: at least this many bytes (keeps L2 out of it)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="CSV path (default experiments/results/decode_linear_<gpu>.csv)")
    args = ap.parse_args(argv)
    args.models = comma_choices(ap, "--models", args.models, MODELS)
    args.products = comma_choices(ap, "--products", args.products, PRODUCTS)
    args.methods = comma_choices(ap, "--methods", args.methods, METHODS)
    if not torch.cuda.is_available() or args.device == "cpu":
        ap.error("needs a CUDA device (the methods are timed as CUDA graphs)")
    return args


def main(argv=None):
    args = parse_args(argv)
    gpu = _gpu_name(torch.device(args.device))
    out = args.out or results_csv("decode_linear", gpu, HERE / "results")
    rows, bandwidth = bench(args)
    append_rows(Path(out), FIELDS, rows)
    print(_table([r for r in rows if not r["method"].startswith("triton_sweep")], TABLE_COLUMNS))
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s | csv {out}")


if __name__ == "__main__":
    main()
