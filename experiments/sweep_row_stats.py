"""Row-statistics epilogue variants on a GPU: bandwidth of ``row_stats_kernel`` and alternatives.

The forward's only pass over the logits computes, per row, the running max ``m``,
``s = sum exp(z - m)`` and ``t = sum exp(z - m)(z - m)``. Variants (same outputs, checked against
float64):

* ``block``: the shipped kernel: three block-wide reductions per column block.
* ``lean``: ``block`` with fewer instructions per element (padding loaded as -inf, the shifted
  logit clamped instead of two selects).

    PYTHONPATH=components python experiments/sweep_row_stats.py

H100 (``experiments/results/row_stats_h100.csv``): ``lean`` is within +-4 % of ``block`` at the tile
shapes the head uses (4096 x 10240: 1.62 vs 1.56 TB/s; 4096 x 28672: 2.20 vs 2.23; 768 x 152064:
2.06 vs 1.98), so the kernel is not issue-bound; the small no-grad tiles are launch/tail-bound
(~50 us kernels). ``block`` stays. An earlier run of this sweep also tried per-lane running
statistics (two exps per element, one reduction at the end) and a block-wide max with per-lane
sums; neither beat ``block`` at any shape, and they were dropped from it.
"""

import itertools
import statistics

import torch
import triton
import triton.language as tl

from logitless.ops.triton import kernels


@triton.jit
def lean_stats_kernel(logits_ptr, stride_row, part_ptr, V, span, inv_t,
                      NUM_SPLITS: tl.constexpr, BLOCK_V: tl.constexpr):
    # Fewer instructions per element than ``block``: the padding is loaded as -inf (no select on
    # z), and the shifted logit d = z - m is clamped at -150 (exp(-150) is exactly 0 in fp32 and
    # 0 * -150 = 0) instead of a select on e * d.
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    start = split * span
    end = tl.minimum(start + span, V)
    offs = tl.arange(0, BLOCK_V)
    m = -3.0e38
    s = 0.0
    t = 0.0
    for k in range(0, span, BLOCK_V):
        cols = start + k + offs
        x = tl.load(base + cols, mask=cols < end, other=float("-inf"))
        z = x.to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        alpha = tl.exp2((m - m_new) * LOG2E)
        d = tl.maximum(z - m_new, -150.0)
        e = tl.exp2(d * LOG2E)
        t = alpha * (t + (m - m_new) * s) + tl.sum(e * d, 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
    out = part_ptr + (row.to(tl.int64) * NUM_SPLITS + split) * 3
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, t)


def _ms(fn, reps=20):
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record()  # noqa: E702
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _check(part, x, splits, span):
    z = x.double()
    rows = torch.arange(0, x.shape[0], max(1, x.shape[0] // 64), device=x.device)
    worst = 0.0
    for r in rows.tolist():
        m, s, t = (part[r, :, i].double() for i in range(3))
        mm = m.max()
        w = (m - mm).exp()
        ss = (w * s).sum()
        tt = (w * (t + (m - mm) * s)).sum()
        ref_lse = z[r].logsumexp(0)
        p = (z[r] - ref_lse).exp()
        ref_ent = ref_lse - (p * z[r]).sum()
        lse, ent = mm + ss.log(), ss.log() - tt / ss
        worst = max(worst, abs(lse - ref_lse).item() / abs(ref_lse).item(),
                    abs(ent - ref_ent).item() / abs(ref_ent).item())
    return worst


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("shape,variant,block_v,warps,pps,splits,GB/s,max_rel_err")
    for rows, cols in ((4096, 10240), (4096, 28672), (768, 152064), (8192, 7168)):
        x = (torch.randn(rows, cols, device=dev) * 2).to(torch.bfloat16)
        for variant, block_v, warps, pps in itertools.product(
                ("block", "lean"), (2048, 4096, 8192), (4, 8), (8,)):
            blocks = -(-cols // block_v)
            splits = max(1, min(blocks, -(-pps * sms // rows), 32))
            span = -(-blocks // splits) * block_v
            splits = -(-cols // span)
            part = torch.empty(rows, splits, 3, device=dev)
            if variant == "block":
                fn = lambda: kernels.row_stats_kernel[(rows, splits)](  # noqa: E731
                    x, x.stride(0), part, cols, span, 1.0, NUM_SPLITS=splits, BLOCK_V=block_v,
                    PREFETCH=True, num_warps=warps)
            else:
                fn = lambda: lean_stats_kernel[(rows, splits)](  # noqa: E731
                    x, x.stride(0), part, cols, span, 1.0, NUM_SPLITS=splits, BLOCK_V=block_v,
                    num_warps=warps)
            ms = _ms(fn)
            fn()
            err = _check(part, x, splits, span)
            print(f"{rows}x{cols},{variant},{block_v},{warps},{pps},{splits},{x.numel() * 2 / ms / 1e6:.0f},"
                  f"{err:.1e}", flush=True)


if __name__ == "__main__":
    main()
