"""How long the fused head's forward takes depending on what the GPU ran just before it.

``bench_head.py`` times each step right after a reference GEMM (one GEMM, then one step, per rep)
so that both see the same clocks. This probe asks whether that order changes the step's time: for
each predecessor it runs, per rep, the predecessor, a sync, then one timed forward
(``logitless.linear_log_probs(..., impl="triton")`` under ``no_grad``, 10% ignored labels), and
reports the median. Predecessors: none, the reference GEMM (``h @ W.T``), a 2.5 GB fill (memory
traffic without tensor cores), ``torch.cuda._sleep`` for about a GEMM's time (an idle GPU), batched
GEMMs on data that fits in L2 (tensor cores without HBM traffic) and the forward itself.

One CSV (``benchmarks/results/head_predecessor_<gpu>.csv``).

Example (H200):
    PYTHONPATH=components python experiments/probe_head_predecessor.py --shapes qwen7b,qwen05b
"""

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
from bench_generation import _table, save_rows  # noqa: E402
from bench_head import SHAPES, head_inputs, time_ms  # noqa: E402

FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "shape", "round", "predecessor", "predecessor_ms",
          "forward_ms", "gemm_ms", "forward_gemms"]
TABLE = ["shape", "round", "predecessor", "predecessor_ms", "forward_ms", "forward_gemms"]


def predecessors(h, w, forward, device):
    """Name -> callable, each about one reference GEMM long (the fill and the call excepted)."""
    out = torch.empty(h.shape[0], w.shape[0], device=device, dtype=h.dtype)
    cubes = torch.randn(16, 2048, 2048, device=device, dtype=torch.bfloat16)
    gemm_ms = time_ms(lambda: torch.mm(h, w.t(), out=out), 5, 1)
    cube_ms = time_ms(lambda: torch.bmm(cubes, cubes), 5, 1)
    cycles = int(torch.cuda.get_device_properties(device).clock_rate * 1e3 * gemm_ms * 1e-3)
    return gemm_ms, {
        "none": lambda: None,
        "gemm": lambda: torch.mm(h, w.t(), out=out),
        "fill": lambda: out.fill_(1.0),
        "sleep": lambda: torch.cuda._sleep(cycles),
        "gemm_in_l2": lambda: [torch.bmm(cubes, cubes) for _ in range(max(1, round(gemm_ms / cube_ms)))],
        "forward": forward,
    }


def shape_rows(shape, device, reps, rounds):
    import logitless

    h, w, y = head_inputs(shape, device, ignore_frac=0.1)[:3]  # bench_head.py's: logits of std 2
    forward = lambda: logitless.linear_log_probs(h, w, y, impl="triton")  # noqa: E731
    rows = []
    with torch.no_grad():
        gemm_ms, before = predecessors(h, w, forward, device)
        for _ in range(3):
            forward()
        for rnd in range(rounds):
            for name, pred in before.items():
                # each rep: the predecessor, a sync, the timed forward (time_ms syncs after each)
                pairs = [(time_ms(pred, 1, 0), time_ms(forward, 1, 0)) for _ in range(reps)]
                prev, ms = statistics.median(p for p, _ in pairs), statistics.median(f for _, f in pairs)
                rows.append(dict(shape=shape, round=rnd, predecessor=name, predecessor_ms=f"{prev:.3f}",
                                 forward_ms=f"{ms:.3f}", gemm_ms=f"{gemm_ms:.3f}", forward_gemms=f"{ms / gemm_ms:.3f}"))
                print(_table([rows[-1]], TABLE).splitlines()[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen7b,qwen05b", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            ap.error(f"--shapes: {shape!r} is not one of {list(SHAPES)}")
    device = torch.device("cuda")
    rows = []
    for shape in shapes:
        rows += shape_rows(shape, device, args.reps, args.rounds)
    save_rows("head_predecessor", FIELDS, rows, device, args.out, folder=RESULTS)
    print(_table(rows, TABLE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
