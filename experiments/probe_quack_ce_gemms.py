"""The one-pass cross-entropy's per-chunk GEMMs on cuBLAS against QuACK, in GEMMs (one cuBLAS
``(N, H) @ (H, V)``): the logits GEMM with the statistics (cuBLAS + the Triton statistics pass
against QuACK storing the logits with per-tile sums), dh (``dl @ W``) and dW (``dW += dl.T @ h``:
cuBLAS ``addmm_``, QuACK reading dW in its epilogue ("C") or adding through its store ("reduce")),
over every chunk of the one pass at 10% ignored rows, each at four QuACK tile shapes; dW's error
against float64. Needs an sm_90 GPU and quack-kernels.

    python experiments/probe_quack_ce_gemms.py qwen05b,qwen7b,llama8b
"""
import sys, statistics, traceback
import torch
from logitless.ops.triton import head, kernels
from logitless.ops import quack_head, _quack_epilogues as qe
from quack.gemm_interface import gemm_tuned
from quack.gemm_config import GemmConfig

torch.manual_seed(0)
dev = "cuda"
def tm(fn, reps=5, warm=2):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); out.append(a.elapsed_time(b))
    return statistics.median(out)

CFG = {
 "pp128x192c21": GemmConfig(tile_m=128, tile_n=192, pingpong=True, cluster_m=2, cluster_n=1, is_dynamic_persistent=False),
 "co128x256c21": GemmConfig(tile_m=128, tile_n=256, pingpong=False, cluster_m=2, cluster_n=1, is_dynamic_persistent=False),
 "co256x128c21": GemmConfig(tile_m=256, tile_n=128, pingpong=False, cluster_m=2, cluster_n=1, is_dynamic_persistent=False),
 "co256x192c12": GemmConfig(tile_m=256, tile_n=192, pingpong=False, cluster_m=1, cluster_n=2, is_dynamic_persistent=False),
}
rows_out = []
def rec(shape, what, impl, ms, unit, extra=""):
    rows_out.append((shape, what, impl, ms, ms / unit, extra)); print(rows_out[-1], flush=True)

shapes = {"qwen7b": (8192, 3584, 152064), "qwen05b": (16384, 896, 151936), "llama8b": (8192, 4096, 128256)}
for name in sys.argv[1].split(","):
    N, H, V = shapes[name]
    rows = int(N * 0.9)
    hfull = (torch.randn(N, H, device=dev) * 0.5).to(torch.bfloat16)
    W = (torch.randn(V, H, device=dev) * 0.05).to(torch.bfloat16)
    h = hfull[:rows].contiguous()
    y = torch.randint(0, V, (rows,), device=dev)
    ref = torch.empty(N, V, device=dev, dtype=torch.bfloat16)
    unit = tm(lambda: torch.matmul(hfull, W.t(), out=ref)); del ref
    rec(name, "gemm", "cublas", unit, unit)
    ch = head._Chunks(h, W, None, head.WORKSPACE_BYTES)
    n_c = ch.n_c
    spans = [(s, min(s + n_c, rows)) for s in range(0, rows, n_c)]
    logp, ent, lse = head.row_outputs(h, rows)
    def cur():
        for h_c, idx_c, start, logits in ch:
            head._stats(ch, logits, None, start, y, logp, ent, lse, 1.0, -100)
    rec(name, f"logits+stats x{len(spans)} n_c={n_c}", "cublas+triton", tm(cur), unit)
    lse_cur = lse.clone(); logp_cur = logp.clone()
    tile_n = quack_head.stats_tile_n(V); T = V // tile_n
    st = torch.empty((3, -(-n_c // 4) * 4, T), device=dev); acc_y = torch.empty(n_c, device=dev)
    logp2, ent2, lse2 = head.row_outputs(h, rows)
    def qk():
        for s, e in spans:
            m = e - s
            qe.tile_entropy_stats(h[s:e], W, y[s:e], quack_head._LOG2E, round_logits=True, tile_n=tile_n,
                                  tile_max=st[0, :m], sum_exp=st[1, :m], sum_exp_x=st[2, :m], target_acc=acc_y[:m],
                                  logits=ch.buf[:m])
            kernels.finalize_tile_stats_kernel[(m,)](st[0, :m], st[1, :m], st[2, :m], acc_y, y, y, logp2, ent2, lse2,
                s, T, 1.0, -100, HAS_IDX=False, BLOCK_T=1024, num_warps=4)
    try:
        rec(name, f"logits+stats x{len(spans)}", "quack_stored", tm(qk), unit,
            f"lse diff {(lse2 - lse_cur).abs().max().item():.2e} logp diff {(logp2 - logp_cur).abs().max().item():.2e}")
        # the stored logits equal cuBLAS's? compare last chunk
        s, e = spans[-1]; ref_l = torch.matmul(h[s:e], W.t())
        print("stored logits max diff", (ch.buf[:e - s].float() - ref_l.float()).abs().max().item(), flush=True)
    except Exception:
        traceback.print_exc()
    dl = (torch.randn(n_c, V, device=dev) * 1e-4).to(torch.bfloat16)
    dh = torch.empty(rows, H, device=dev, dtype=torch.bfloat16)
    def dh_cub():
        for s, e in spans: torch.matmul(dl[: e - s], W, out=dh[s:e])
    rec(name, "dh", "cublas", tm(dh_cub), unit)
    for cn, cfg in CFG.items():
        for sk in (1, 2, 4) if H < 2048 else (1, 2):
            def dh_q():
                for s, e in spans: gemm_tuned.fn(dl[: e - s], W, dh[s:e], config=cfg, split_k=sk)
            try: rec(name, "dh", f"quack {cn} sk{sk}", tm(dh_q), unit)
            except Exception as ex: print("dh fail", cn, sk, repr(ex)[:200], flush=True)
    dw = torch.empty(V, H, device=dev, dtype=torch.bfloat16)
    def dw_cub():
        for i, (s, e) in enumerate(spans):
            if i == 0: torch.matmul(dl[: e - s].t(), h[s:e], out=dw)
            else: dw.addmm_(dl[: e - s].t(), h[s:e])
    rec(name, "dW", "cublas", tm(dw_cub), unit)
    full = [(s, e) for s, e in spans if e - s == n_c]
    hsum = sum(h[s:e].double() for s, e in full)
    ref64 = dl.double().t() @ hsum
    def err():
        return ((dw.double() - ref64).norm() / ref64.norm()).item()
    def run_err(fn):
        for i, (s, e) in enumerate(full): fn(i, s, e)
        torch.cuda.synchronize(); return err()
    e_cub = run_err(lambda i, s, e: torch.matmul(dl.t(), h[s:e], out=dw) if i == 0 else dw.addmm_(dl.t(), h[s:e]))
    rec(name, "dW err", "cublas", 0, unit, f"{e_cub:.3e}")
    for cn, cfg in CFG.items():
        for mode in ("C", "reduce"):
            def one(i, s, e):
                A = dl[: e - s].mT
                if i == 0: gemm_tuned.fn(A, h[s:e], dw, config=cfg)
                elif mode == "C": gemm_tuned.fn(A, h[s:e], dw, C=dw.view(V, H), config=cfg)
                else: gemm_tuned.fn(A, h[s:e], dw, config=cfg, add_to_output=True)
            def dw_q():
                for i, (s, e) in enumerate(spans): one(i, s, e)
            try:
                t = tm(dw_q)
                rec(name, "dW", f"quack {cn} {mode}", t, unit, f"err {run_err(one):.3e}")
            except Exception as ex: print("dw fail", cn, mode, repr(ex)[:300], flush=True)
    del dw, dl, dh, ch
    torch.cuda.empty_cache()

print("\nshape,what,impl,ms,gemms,extra")
for r in rows_out: print(f"{r[0]},{r[1]},{r[2]},{r[3]:.3f},{r[4]:.3f},{r[5]}")
