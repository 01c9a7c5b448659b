"""Where the fused GRPO objective's one pass pays off: one pass against two, trained and frozen head.

``linear_token_objective`` calls the Python objective once per row chunk of its one pass, so at
many chunks the host may not keep ahead of the GPU. For each head shape this times the obj mode of
``bench_head.py`` (the GRPO policy loss, forward + backward; dW wanted or the head frozen, as under
LoRA) on the one-pass path (pinned label columns where ``head.one_pass_pins`` allows them) and on
the two-pass path, each forced; reports the GPU time in GEMMs of the same run, the host's time to
issue the step (wall clock to the return of ``backward``, no sync) and the error against float64.
A host time near the GPU time means the step is host-bound.

Example::

    python experiments/probe_objective_chunks.py --shapes qwen05b,qwen7b --ignore-frac 0.1 \\
        --out experiments/results/objective_chunks_h200.csv
"""

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
import bench_head as B  # noqa: E402

#: The CSV's columns.
FIELDS = ["gpu", "torch", "triton", "date", "ignore_frac", "shape", "n", "h", "v", "mode", "path", "ms", "gemms",
          "host_ms", "err_out", "err_dh", "err_dw"]
#: Extra shapes: the GRPO config's 1.5B head over a micro-batch of 16 completions x 512 tokens.
SHAPES = dict(B.SHAPES, qwen15b_grpo=(8192, 1536, 151936))


def run_case(h, w, y, adv, old, path, frozen):
    """One step of the objective on ``path`` ("one" or "two"); returns the loss."""
    from logitless.ops.triton import head, token_objective

    # "two": the eager chunk rule with no one-pass chunk allowed (a frozen head too)
    forced = ({"FUSED_MAX_CHUNKS": 1 << 30} if path == "one"
              else {"FUSED_MAX_CHUNKS": 0, "PINNED_MAX_CHUNKS": 0})
    saved = {k: getattr(head, k) for k in forced}
    for k, v in forced.items():
        setattr(head, k, v)
    replayable = token_objective.ChunkUpstreams.replayable
    if path == "two":
        token_objective.ChunkUpstreams.replayable = staticmethod(lambda *a: False)
    try:
        h.grad = w.grad = None
        w.requires_grad_(not frozen)
        loss = B._linear_obj(h, w, y, adv, old, "triton")
        loss.backward()
        return loss.detach()
    finally:
        for k, v in saved.items():
            setattr(head, k, v)
        token_objective.ChunkUpstreams.replayable = replayable


def measure(shape, ignore_frac, reps, warmup):
    """Rows of one shape: (mode, path, ms, gemms, host_ms, err_out, err_dh, err_dw)."""
    dims = SHAPES[shape]
    h, w, y, g1, g2, gen = B.head_inputs(shape, torch.device("cuda"), ignore_frac=ignore_frac, dims=dims)
    adv, old = B.grpo_inputs(h, w, y, gen)
    ref = B.reference64(h, w, y, g1, g2, adv, old)["obj"]
    a, b = h.detach(), w.detach().t()
    rows = []
    for frozen in (False, True):
        for path in ("one", "two"):
            case = lambda: run_case(h, w, y, adv, old, path, frozen)  # noqa: E731
            out = case()
            torch.cuda.synchronize()
            err = dict(err_out=B.rel(out, ref[0]), err_dh=B.rel(h.grad, ref[1]),
                       err_dw=float("nan") if frozen else B.rel(w.grad, ref[2]))
            for _ in range(warmup):
                case()
            ratios, times, hosts = [], [], []
            for _ in range(reps):
                g0, g1, s0, s1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
                torch.cuda.synchronize()
                g0.record()
                a @ b
                g1.record()
                s0.record()
                t0 = time.perf_counter()
                case()
                hosts.append((time.perf_counter() - t0) * 1e3)
                s1.record()
                torch.cuda.synchronize()
                ms = s0.elapsed_time(s1)
                times.append(ms)
                ratios.append(ms / g0.elapsed_time(g1))
            rows.append(dict(shape=shape, n=dims[0], h=dims[1], v=dims[2], mode="frozen" if frozen else "dw",
                             path=path, ms=round(statistics.median(times), 3),
                             gemms=round(statistics.median(ratios), 3),
                             host_ms=round(statistics.median(hosts), 3), **{k: f"{v:.3g}" for k, v in err.items()}))
            print(rows[-1], flush=True)
    w.requires_grad_(True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen05b,qwen15b_grpo,qwen7b")
    ap.add_argument("--ignore-frac", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), ignore_frac=args.ignore_frac)
    rows = B._Rows(args.out, FIELDS)  # each shape's rows written as soon as they are measured
    for shape in args.shapes.split(","):
        for r in measure(shape, args.ignore_frac, args.reps, args.warmup):
            rows.append(dict(meta, **r))
    print("| shape | mode | path | GEMMs | ms | host ms | err dh | err dW |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['mode']} | {r['path']} | {r['gemms']} | {r['ms']} | {r['host_ms']} "
              f"| {r['err_dh']} | {r['err_dw']} |")


if __name__ == "__main__":
    main()
