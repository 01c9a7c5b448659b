"""The compiled sampler's draw alone: its time, its tokens against float64 and its Gumbel's accuracy.

:func:`logitless.generation.kernels.counter_sampling.counter_draw` draws the next token of every row from
its logits with the counter stream. One CSV, a row per measurement, its kind in ``section``:

* ``gumbel``: ``log2(-log2(u))`` over the ``2**23`` uniforms of
  :func:`~logitless.generation.sampling.uniform_from_bits` (every ``--gumbel-stride``-th), as the
  kernel computes it (``kernel``: the outer log ``lg2.approx`` on CUDA), with both logs accurate
  (``accurate``) and, on CUDA, both ``lg2.approx`` (``both_approx``): the largest error against
  float64 (``max_err_ulps``: in ulps of ``max(|g|, 1)``), whether every value is finite and the
  values fall as ``u`` rises;
* ``draw``: per ``--rows`` and temperature (1, 0.7, 0), microseconds per draw of ``--vocab`` bf16
  logits (``N(0, 2**2)``), on CUDA a graph of ``--reps`` draws over 4 logits buffers; over
  ``--steps`` steps, the rows whose token equals a float64 Gumbel-max of the same uniforms and the
  largest log-probability error against float64;
* ``near_certain``: one token at logit 0, the other ``vocab - 1`` at -30 (about ``1e-13`` each):
  the draws of ``--rows`` rows over ``--near-steps`` steps that return another token.

``--before PATH`` runs the ``draw`` timing and the ``near_certain`` count for another version of
``counter_sampling.py`` too (loaded under another op name; its tokens are not compared: its uniforms
may differ), e.g. ``git show 2ece5ed:components/logitless/ops/triton/counter_sampling.py``.

Example (H200):
    git show 2ece5ed:components/logitless/ops/triton/counter_sampling.py > /tmp/counter_sampling_before.py
    PYTHONPATH=components:recipes python experiments/bench_counter_draw.py --before /tmp/counter_sampling_before.py
    PYTHONPATH=components:recipes python experiments/bench_counter_draw.py --device cpu --rows 2 --vocab 300 \\
        --steps 2 --near-steps 2 --gumbel-stride 4099 --reps 1  # smoke (TRITON_INTERPRET=1)
"""

import argparse
import importlib.util
import itertools
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks")]  # this folder's scripts, then the benchmarks' helpers
from bench_decode_attention import _ints, time_call  # noqa: E402
from bench_generation import _table, results_csv, run_metadata  # noqa: E402
from bench_sft import append_rows  # noqa: E402

from logitless.generation.kernels import counter_sampling  # noqa: E402
from logitless.generation.kernels.counter_sampling import _gumbel2  # noqa: E402
from logitless.generation.sampling import counter_uniform, token_hashes  # noqa: E402

FIELDS = ["date", "gpu", "torch", "triton", "torchtune", "section", "code", "variant", "rows", "vocab", "temperature",
          "us", "same_tokens", "draws", "logp_max_err", "other_tokens", "max_err_ulps", "finite", "monotone"]
TABLE = ["section", "code", "variant", "rows", "temperature", "us", "same_tokens", "logp_max_err", "other_tokens",
         "draws", "max_err_ulps", "finite", "monotone"]
CELLS = 1 << 23


@triton.jit
def _gumbel_kernel(cells_ptr, out_ptr, n, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    # VARIANT 0: as the kernel on CUDA; 1: both logs accurate; 2: both logs lg2.approx
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.load(cells_ptr + i, mask=i < n, other=0)
    u = (j.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    if VARIANT == 2:
        g = libdevice.fast_log2f(-libdevice.fast_log2f(u))
    else:
        g = _gumbel2(u, VARIANT == 0)
    tl.store(out_ptr + i, g, mask=i < n)


def gumbel_rows(device, stride):
    """The ``gumbel`` section."""
    cells = torch.arange(0, CELLS, stride, device=device)
    cells = torch.cat([cells, torch.tensor([CELLS - 1], device=device)]).unique()  # the top uniform too
    exact = torch.log2(-torch.log2((cells.double() + 0.5) / CELLS))
    variants = {"kernel": 0, "accurate": 1, "both_approx": 2} if device.type == "cuda" else {"accurate": 1}
    out = []
    for name, variant in variants.items():
        g = torch.empty(len(cells), device=device)
        _gumbel_kernel[(triton.cdiv(len(cells), 1024),)](cells, g, len(cells), VARIANT=variant, BLOCK=1024)
        ulps = (g.double() - exact).abs() / (exact.abs().clamp_min(1.0) * 2**-23)
        out.append(dict(section="gumbel", code="now", variant=name, max_err_ulps=round(float(ulps.max()), 3),
                        finite=bool(torch.isfinite(g).all()), monotone=bool((g[1:] <= g[:-1]).all())))
    return out


def load_before(path):
    """``counter_sampling.py`` at ``path`` as a module whose op is ``logitless_before::counter_draw``."""
    source = Path(path).read_text().replace('"logitless::counter_draw"', '"logitless_before::counter_draw"')
    spec = importlib.util.spec_from_loader("counter_sampling_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)  # triton reads a jit function's source through its module's file
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def draw_rows(codes, rows, vocab, steps, reps, device):
    """The ``draw`` section for ``rows`` rows."""
    gen = torch.Generator(device=device).manual_seed(1)
    buffers = [(torch.randn(rows, vocab, device=device, generator=gen) * 2).to(torch.bfloat16) for _ in range(4)]
    keys = torch.randint(0, 2**62, (rows,), device=device, generator=gen)
    hashes = token_hashes(vocab, device)
    out = []
    for temperature in (1.0, 0.7, 0.0):
        for code, module in codes.items():
            cycle = itertools.cycle(buffers)
            step = torch.tensor([3], device=device)
            seconds = time_call(lambda: module._counter_draw_op(next(cycle), keys, step, temperature), device, reps, 5)
            row = dict(section="draw", code=code, rows=rows, vocab=vocab, temperature=temperature,
                       us=round(seconds * 1e6, 2))
            if code == "now":
                same, err = 0, 0.0
                scaled = buffers[0].double() / (temperature or 1.0)
                for t in range(steps):
                    step = torch.tensor([t], device=device)
                    tokens, logp = module._counter_draw_op(buffers[0], keys, step, temperature)
                    if temperature:
                        u = counter_uniform(keys, step, vocab, hashes).double()
                        ref = (scaled - torch.log(-torch.log(u))).argmax(-1)
                    else:
                        ref = scaled.argmax(-1)
                    same += int((tokens == ref).sum())
                    exact = torch.log_softmax(scaled, -1).gather(1, tokens[:, None]).squeeze(1)
                    err = max(err, float((logp.double() - exact).abs().max()))
                row.update(same_tokens=same, draws=rows * steps, logp_max_err=f"{err:.2e}")
            out.append(row)
    return out


def near_certain_rows(codes, rows, vocab, steps, device):
    """The ``near_certain`` section."""
    logits = torch.full((rows, vocab), -30.0, device=device)
    logits[:, 7] = 0.0
    keys = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(3)).to(device)
    out = []
    for code, module in codes.items():
        other = sum(int((module._counter_draw_op(logits, keys, torch.tensor([t], device=device), 1.0)[0] != 7).sum())
                    for t in range(steps))
        out.append(dict(section="near_certain", code=code, rows=rows, vocab=vocab, temperature=1.0,
                        other_tokens=other, draws=rows * steps))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=_ints, default=[64, 16, 8])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=50, help="steps whose tokens are compared with float64")
    ap.add_argument("--near-steps", type=int, default=2000, help="steps of the near-certain count")
    ap.add_argument("--reps", type=int, default=20, help="draws per timed CUDA graph")
    ap.add_argument("--gumbel-stride", type=int, default=1, help="every n-th of the 2**23 uniforms")
    ap.add_argument("--before", default=None, help="another counter_sampling.py to time and count too")
    ap.add_argument("--out", default=None, help="CSV path (default experiments/results/counter_draw_<gpu>.csv)")
    args = ap.parse_args(argv)
    for flag in ("vocab", "steps", "near_steps", "reps", "gumbel_stride"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: expected a positive integer, got {getattr(args, flag)}")
    if args.before is not None and not os.path.isfile(args.before):
        ap.error(f"--before: no file {args.before!r}")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    common = run_metadata(device)
    codes = {"now": counter_sampling}
    if args.before is not None:
        codes["before"] = load_before(args.before)
    rows = gumbel_rows(device, args.gumbel_stride)
    for n in args.rows:
        rows += draw_rows(codes, n, args.vocab, args.steps, args.reps, device)
    rows += near_certain_rows(codes, args.rows[0], args.vocab, args.near_steps, device)
    out = Path(args.out or results_csv("counter_draw", common["gpu"], RESULTS))
    append_rows(out, FIELDS, [dict(common, **r) for r in rows])
    print(f"{common['gpu']} | torch {common['torch']} | triton {common['triton']} | csv {out}")
    print(_table(rows, TABLE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
