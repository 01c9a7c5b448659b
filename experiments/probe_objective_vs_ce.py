"""The fused GRPO objective against cross-entropy on the same head, alternated step by step.

The target asks the fused GRPO objective (``linear_token_objective``) to cost at most cross-entropy's
time + 5%. Run separately (``bench_head.py``), the two medians come from different minutes of a GPU
whose clock drifts by ~10% under load; here each rep times one GEMM, one CE step and one objective
step back to back (``bench_head.py``'s ``ce`` and ``obj`` modes, ``impl="triton"``, forward and
backward), so the reported ratio is the median of per-rep ratios objective / CE.

``--objective full`` times the objective with every per-token term of current GRPO practice
(``bench_head.OBJECTIVES["full"]``: sampler importance weights, ``delta``, the top-entropy token mask
and the k3 KL) instead of the clipped ratio and entropy bonus alone.

Example::

    python experiments/probe_objective_vs_ce.py --shapes qwen05b,qwen7b,llama8b,long --ignore-frac 0.1 \\
        --out experiments/results/objective_vs_ce_h200.csv
    python experiments/probe_objective_vs_ce.py --objective full --shapes qwen05b,qwen7b --ignore-frac 0.1 \\
        --out experiments/results/objective_full_vs_ce_h200.csv
"""

import argparse
import datetime
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
import bench_head as B  # noqa: E402


#: The CSV's columns.
FIELDS = ["gpu", "torch", "triton", "quack", "date", "objective", "ignore_frac", "shape", "n", "h", "v", "gemm_ms",
          "ce_gemms", "obj_gemms", "obj_over_ce", "obj_over_ce_min", "obj_over_ce_max"]


def _event_ms(fn):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def measure(shape, ignore_frac, reps, warmup):
    """One row: GEMM ms, CE and objective in GEMMs, and objective / CE (median, min, max of reps)."""
    h, w, y, g1, g2, gen = B.head_inputs(shape, torch.device("cuda"), ignore_frac=ignore_frac)
    adv, consts = B.grpo_inputs(h, w, y, gen)
    f_obj, f_ce = B.build("triton", "obj"), B.build("triton", "ce")
    steps = {
        "gemm": lambda: torch.matmul(h.detach(), w.detach().t()),
        "ce": lambda: B.step(f_ce, "ce", h, w, y, g1, g2),
        "obj": lambda: B.step(f_obj, "obj", h, w, y, adv, consts),
    }
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            times[k].append(_event_ms(fn))
    ratio = [o / c for o, c in zip(times["obj"], times["ce"])]
    per_gemm = lambda k: statistics.median(t / g for t, g in zip(times[k], times["gemm"]))  # noqa: E731
    return dict(gemm_ms=round(statistics.median(times["gemm"]), 3), ce_gemms=round(per_gemm("ce"), 3),
                obj_gemms=round(per_gemm("obj"), 3), obj_over_ce=round(statistics.median(ratio), 4),
                obj_over_ce_min=round(min(ratio), 4), obj_over_ce_max=round(max(ratio), 4))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen05b,qwen7b,llama8b,long")
    ap.add_argument("--ignore-frac", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--objective", default="basic", choices=sorted(B.OBJECTIVES),
                    help="the GRPO objective (full: importance weights, delta, top-entropy mask, k3 KL)")
    ap.add_argument("--out", default=None, help="CSV path (appends rows)")
    args = ap.parse_args()
    B.set_objective(args.objective)
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                quack=B._peer_versions().get("quack-kernels", ""),
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), objective=args.objective,
                ignore_frac=args.ignore_frac)
    rows = B._Rows(args.out, FIELDS)  # each row written as soon as it is measured
    for shape in args.shapes.split(","):
        n, hid, v = B.SHAPES[shape]
        r = dict(meta, shape=shape, n=n, h=hid, v=v, **measure(shape, args.ignore_frac, args.reps, args.warmup))
        rows.append(r)
        print(f"{shape:8s} GEMM {r['gemm_ms']:7.3f} ms  CE {r['ce_gemms']:.3f}  objective {r['obj_gemms']:.3f} "
              f"GEMMs  objective / CE {r['obj_over_ce']:.4f} ({r['obj_over_ce_min']:.4f}-{r['obj_over_ce_max']:.4f})",
              flush=True)


if __name__ == "__main__":
    main()
