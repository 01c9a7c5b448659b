"""Side-by-side benchmark of LM-head losses: time, memory and error vs float64, in one process.

For each head shape and mode, every implementation runs on the same bf16 inputs:

* modes: ``ce`` (cross-entropy mean, forward+backward), ``logp`` (per-token log-probs + entropy
  with random per-token upstream gradients, forward+backward), ``fwd`` (log-probs + entropy under
  ``no_grad``, the old/reference pass of RL), ``ref`` (log-probs alone under ``no_grad``, as
  GRPO's reference and old passes ask for them), ``obj`` (the GRPO policy loss, forward+backward of a
  scalar: PPO-clipped ratio against fixed old log-probs with per-token advantages, minus 0.01 x
  entropy, token mean; the objective is ``GRPOLoss.row_objective``; ``--objective full`` adds the
  sampler-trainer importance weights (token_truncate at 3), the two-sided clip ``delta=4``, the
  top-20% high-entropy token mask and the k3 KL to a reference with ``beta=0.04``);
* impls: ``torch`` (plain: bf16 logits, fp32 loss), ``compile`` (``torch.compile`` of it),
  ``tt_chunked`` (torchtune's chunked-output CE: 8 logit chunks, fp32 upcast per chunk),
  ``tt_compiled`` (the same, compiled as torchtune's recipes do with ``compile: True``:
  ``training.compile_loss`` compiles the per-chunk upcast + loss, the chunk GEMMs stay eager),
  ``chunked`` / ``triton`` (``logitless`` ``impl=``; in ``obj``, ``linear_token_objective``:
  gradients in the forward), ``triton_fused`` (the one-pass 3-GEMM path of cross-entropy and
  ``obj`` forced at every size, dW rounded once per row chunk), ``triton_twopass`` (the 4-GEMM path
  forced), ``triton_hgemm`` / ``triton_fused_hgemm`` (``triton`` /
  ``triton_fused`` with ``LOGITLESS_HEAD_GEMM=triton``: the Triton GEMMs with their epilogues
  inside, forward and backward), ``triton_quack`` (``triton`` with ``LOGITLESS_HEAD_GEMM=quack``:
  the forwards on QuACK's GEMMs where they apply, an error without QuACK), ``triton_cublas``
  (``triton`` with ``LOGITLESS_HEAD_GEMM=cublas``: cuBLAS GEMMs and Triton epilogues only; ``triton``
  is ``auto``, the same where QuACK is not installed), ``triton_unfused`` (``obj`` only: ``linear_log_probs`` then the
  objective in torch, forward + recomputing backward), ``liger`` (Liger-Kernel fused linear CE),
  ``cce`` (Cut Cross-Entropy), ``quack`` (QuACK's chunked linear cross-entropy in its default: CuTe-DSL
  GEMMs, its scaled-exp pipeline where it applies, fp32 dW; ``fwd``: its loss-only GEMM whose
  epilogue keeps the row statistics and the label's logit, the logits never stored). Liger, CCE and
  QuACK have no entropy output: they run ``ce`` and ``fwd`` (log-probs only) and are marked n/a in
  ``logp`` and ``obj``. A peer that is not installed is reported.

* inputs (``--logits``): ``gaussian`` (hidden ~ N(0, 1), logits of std ``--logit-std``, 2 by
  default) or ``peaked`` (a trained LM's: each row's hidden state points at 3 tokens whose logits
  stand 15, 12 and 9 above a std-1 background, the label is the top one 60% of the time, another
  of the three 25%, else random), or ``zipf`` (the same with the favoured tokens and the random
  labels drawn by token frequency, Zipf's law over V: frequent tokens take large probabilities in
  many rows, as text's punctuation and function words do); ``--ignore-frac`` of the labels are
  ignored. Peers that skip work on small probabilities (Cut Cross-Entropy's gradient filtering)
  depend on this, and so does how much of dW the fused head's pinned labels cover.

Each row: median ms, ratio to one ``torch.matmul`` of (N x H) by (H x V) in bf16 measured in the
same run (each rep times a GEMM then the step, back to back; the median of the per-rep ratios,
since clocks drift by ~10% under sustained load), peak extra GiB (``max_memory_allocated`` minus
what was allocated before the step; the gradients dh, dW are part of it), and
``||x - ref|| / ||ref||`` against a float64 reference of the same inputs for the loss (or log-probs
and entropy; the objective in ``obj``), dh and dW.

Other modes: ``--tradeoffs SHAPE`` (workspace size and ignored rows, triton only), ``--micro
SHAPE`` (chunk GEMMs, epilogue launch shapes, a profile), ``--profile SHAPES`` (the GPU time of
each profiled path within ``--impls`` and ``--modes`` split into GEMMs, epilogues, other kernels
and idle), ``--hgemm-sweep SHAPES`` (block sizes of the Triton head GEMMs), ``--hgemm-blocks``
(set them for a run), ``--plot CSV PNG``.

Example:
    PYTHONPATH=components python benchmarks/bench_head.py --shapes qwen7b \
        --out benchmarks/results/head_h200.csv
"""

import argparse
import contextlib
import csv
import datetime
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sft import _add_columns  # noqa: E402

SHAPES = {  # name: (N tokens, H hidden, V vocab)
    "qwen7b": (8192, 3584, 152064),
    "llama8b": (8192, 4096, 128256),
    "qwen05b": (16384, 896, 151936),
    "long": (32768, 3584, 152064),
    "sft05b": (65536, 896, 151936),  # the 0.5B SFT step's 8 x 8192 tokens
}
IMPLS = ["torch", "compile", "tt_chunked", "tt_compiled", "chunked", "triton", "triton_fused", "triton_twopass",
         "triton_hgemm", "triton_fused_hgemm", "triton_quack", "triton_cublas", "triton_unfused", "liger", "cce", "quack"]
MODES = ["ce", "logp", "fwd", "ref", "obj"]
IGN = -100
# The obj mode's GRPO loss: clip range, entropy bonus (small, but it exercises the entropy
# gradient), and the spread of log(pi / pi_old) (some ratios clipped on each side).
CLIP_EPS, ENT_COEF, OLD_SPREAD = 0.2, 0.01, 0.2
#: ``--objective``: the GRPOLoss settings of the obj mode. ``full``: every per-token term GRPO
#: practice adds (the sampler's log-probs spread by SAMPLER_SPREAD around the old ones, the
#: reference's by REF_SPREAD around the current ones).
OBJECTIVES = {
    "basic": dict(epsilon=CLIP_EPS, entropy_coef=ENT_COEF),
    "full": dict(epsilon=CLIP_EPS, epsilon_high=0.28, entropy_coef=ENT_COEF, delta=4.0, beta=0.04,
                 kl_estimator="k3", top_entropy_quantile=0.2, sampler_correction_mode="token_truncate",
                 sampler_correction_clip_max=3.0),
}
SAMPLER_SPREAD, REF_SPREAD = 0.05, 0.1
_GRPO = {}  # name -> the GRPOLoss whose row_objective is the objective (its import pulls torchtune: lazy)
_OBJECTIVE = ["basic"]  # the objective of this run (``--objective``)


def _peer_versions():
    out = {}
    for mod, name in (("liger_kernel", "liger-kernel"), ("cut_cross_entropy", "cut-cross-entropy"),
                      ("quack", "quack-kernels")):
        try:
            from importlib.metadata import version

            __import__(mod)
            out[name] = version(name)
        except Exception as exc:  # a missing peer is reported, not fatal
            out[name] = f"missing ({type(exc).__name__})"
    return out


# ---------------------------------------------------------------- implementations (one step each)
def _plain_logp_ent(h, w, y):
    logits = (h @ w.t()).float()
    logz = logits.log_softmax(-1)
    valid = y != IGN
    logp = logz.gather(-1, torch.where(valid, y, 0)[:, None]).squeeze(-1) * valid
    ent = -(logz.exp() * logz).sum(-1) * valid
    return logp, ent


def _plain_logp(h, w, y):
    logits = (h @ w.t()).float()
    valid = y != IGN
    return logits.log_softmax(-1).gather(-1, torch.where(valid, y, 0)[:, None]).squeeze(-1) * valid, None


def _plain_ce(h, w, y):
    return F.cross_entropy((h @ w.t()).float(), y, ignore_index=IGN)


def _tt_chunks(h, w, y, fn, n_chunks=8):
    # torchtune's CEWithChunkedOutputLoss: the model emits logit chunks; each is upcast separately.
    return [fn(hc @ w.t(), yc) for hc, yc in zip(h.chunk(n_chunks), y.chunk(n_chunks))]


def _tt_chunk_ce(lg, yc):
    # torchtune's CEWithChunkedOutputLoss.compute_cross_entropy: upcast, then a summed CE
    return F.cross_entropy(lg.float(), yc, ignore_index=IGN, reduction="sum")


def _tt_chunk_logp(lg, yc):
    logz = lg.float().log_softmax(-1)
    valid = yc != IGN
    lp = logz.gather(-1, torch.where(valid, yc, 0)[:, None]).squeeze(-1) * valid
    return lp, -(logz.exp() * logz).sum(-1) * valid


def _tt_ce_of(chunk_ce):
    def f(h, w, y):
        return sum(_tt_chunks(h, w, y, chunk_ce)) / (y != IGN).sum().clamp(min=1)

    return f


def _tt_logp_of(chunk_logp):
    def f(h, w, y):
        parts = _tt_chunks(h, w, y, chunk_logp)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    return f


def set_objective(name):
    """Selects the obj mode's objective for this run (a key of :data:`OBJECTIVES`)."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, got {name!r}")
    _OBJECTIVE[0] = name


def _grpo():
    name = _OBJECTIVE[0]
    if name not in _GRPO:
        from logitless.losses.grpo import GRPOLoss

        _GRPO[name] = GRPOLoss(**OBJECTIVES[name])
    return _GRPO[name]


def objective(y, adv, consts):
    """The obj mode's objective as GRPOLoss hands it to the head (a RowObjective over the rows of
    ``y``): DAPO's token mean with the constants of :func:`grpo_inputs`."""
    loss = _grpo()
    valid = y != IGN
    return loss.row_objective(adv, valid.float() / valid.sum().clamp(min=1), valid, consts["old"], consts.get("ref"),
                              policy_weight=consts.get("policy_weight"), entropy_weight=consts["entropy_weight"])


def grpo_terms(lp, ent, rows, y, adv, consts):
    """The obj mode's loss over ``rows`` (:func:`objective`), in lp's dtype."""
    return objective(y, adv, consts)(lp, ent, rows)


def grpo_inputs(h, w, y, gen):
    """The obj mode's constants: per-token advantages, and ``{"old", "entropy_weight"}`` plus, for the
    full objective, ``"ref"`` and ``"policy_weight"`` (the sampler importance weight times the
    high-entropy mask); old log-probs are the current ones + noise."""
    import logitless

    loss = _grpo()
    adv = torch.randn(y.shape[0], device=h.device, generator=gen)
    noise = torch.randn(y.shape[0], device=h.device, generator=gen)
    valid = y != IGN
    with torch.no_grad():
        logp, ent = logitless.linear_log_probs(h, w, y, return_entropy=True)
    old = (logp.float() + OLD_SPREAD * noise) * valid
    consts = {"old": old}
    selected = valid
    if _OBJECTIVE[0] == "full":
        sampler = old + SAMPLER_SPREAD * torch.randn(y.shape[0], device=h.device, generator=gen)
        consts["ref"] = (logp.float() + REF_SPREAD * torch.randn(y.shape[0], device=h.device, generator=gen)) * valid
        keep = loss.high_entropy_mask(ent.float()[None], valid[None])
        consts["policy_weight"] = loss.policy_weights(valid[None], old[None], sampler[None], keep)[0]
        selected = keep[0]
    consts["entropy_weight"] = selected.float() / selected.sum().clamp(min=1)
    return adv, consts


def _obj_of(logp_ent):
    # The unfused objective: per-token (logp, ent) of every row, then the GRPO terms by autograd.
    def f(h, w, y, adv, consts):
        logp, ent = logp_ent(h, w, y)
        return grpo_terms(logp, ent, torch.arange(y.shape[0], device=y.device), y, adv, consts)

    return f


#: ``triton`` / ``triton_fused`` under another ``LOGITLESS_HEAD_GEMM``.
_HEAD_GEMM_IMPLS = {"triton_hgemm": "triton", "triton_fused_hgemm": "triton", "triton_quack": "quack",
                    "triton_cublas": "cublas"}


def build(impl, mode):
    """Returns ``f(h, w, y) -> loss`` (ce), ``(logp, ent_or_None)`` (logp, fwd),
    ``f(h, w, y, adv, consts) -> loss`` (obj), or a str why not."""
    import logitless

    if mode == "obj":
        _grpo()  # constructed outside any torch.compile trace
    if impl in _HEAD_GEMM_IMPLS:
        f = build(impl.rsplit("_", 1)[0], mode)
        if not isinstance(f, str):
            f = _with_head_gemm(f, _HEAD_GEMM_IMPLS[impl])
        return f
    if impl in ("torch", "compile"):
        f = {"ce": _plain_ce, "obj": _obj_of(_plain_logp_ent), "ref": _plain_logp}.get(mode, _plain_logp_ent)
        return torch.compile(f) if impl == "compile" else f
    if impl in ("tt_chunked", "tt_compiled"):
        if mode in ("obj", "ref"):
            return "n/a: no fused objective" if mode == "obj" else "n/a: entropy always computed"
        chunk = _tt_chunk_ce if mode == "ce" else _tt_chunk_logp
        if impl == "tt_compiled":  # torchtune.training.compile_loss: only the per-chunk loss
            chunk = torch.compile(chunk)
        return _tt_ce_of(chunk) if mode == "ce" else _tt_logp_of(chunk)
    if impl in ("triton_fused", "triton_twopass"):
        # triton_fused: the one-pass 3-GEMM path of cross-entropy / the objective forced at any
        # size, without pinned label columns (dW rounded once per row chunk); triton_twopass: the
        # 4-GEMM path forced. The default (`triton`) pins the label columns where they fit.
        if mode not in ("ce", "obj"):
            return "n/a: same as triton"
        from logitless.ops.triton import head

        forced = ({"FUSED_MAX_CHUNKS": 1 << 30, "PINNED_BYTES": 0} if impl == "triton_fused"
                  else {"FUSED_MAX_CHUNKS": 0, "PINNED_MAX_CHUNKS": 0})

        def fused(h, w, y, *consts):
            saved = {k: getattr(head, k) for k in forced}
            for k, v in forced.items():
                setattr(head, k, v)
            try:
                return (_linear_obj(h, w, y, *consts, "triton") if mode == "obj"
                        else logitless.linear_cross_entropy(h, w, y, impl="triton"))
            finally:
                for k, v in saved.items():
                    setattr(head, k, v)

        return fused
    if impl == "triton_unfused":
        if mode != "obj":
            return "n/a: obj only"
        return _obj_of(lambda h, w, y: logitless.linear_log_probs(h, w, y, impl="triton"))
    if impl in ("chunked", "triton"):
        if mode == "ce":
            return lambda h, w, y: logitless.linear_cross_entropy(h, w, y, impl=impl)
        if mode == "obj":
            return lambda h, w, y, adv, consts: _linear_obj(h, w, y, adv, consts, impl)
        return lambda h, w, y: logitless.linear_log_probs(h, w, y, impl=impl, return_entropy=mode != "ref")
    if impl in _PEERS:
        try:
            ce, log_probs = _PEERS[impl]()
        except Exception as exc:
            return f"missing: {type(exc).__name__}: {exc}"[:120]
        if mode in ("logp", "obj"):
            return "n/a: no entropy output"
        if mode == "ce":
            return ce
        return lambda h, w, y: (log_probs(h, w, y), None)
    raise ValueError(f"unknown impl {impl!r}")


def _liger():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as lfce

    return (lambda h, w, y: lfce(h, w, y, ignore_index=IGN),
            lambda h, w, y: -lfce(h, w, y, ignore_index=IGN, reduction="none"))


def _cce():
    from cut_cross_entropy import linear_cross_entropy as cce

    return (lambda h, w, y: cce(h, w, y, ignore_index=IGN),
            lambda h, w, y: -cce(h, w, y, ignore_index=IGN, reduction="none"))


def _quack():
    from quack.epilogue.library import lse_target_epi
    from quack.linear_cross_entropy import chunked_linear_cross_entropy as qlce

    def log_probs(h, w, y):
        # the GEMM's epilogue keeps each row's log-sum-exp and its label's fp32 logit
        stats = lse_target_epi(h, w.mT, store_d=False, target=y, tuned=False)
        return torch.where(y != IGN, stats["target_logit"] - stats["lse"], 0.0)

    return lambda h, w, y: qlce(h, w, y, ignore_index=IGN), log_probs


#: Peers without an entropy output: ``loader() -> (ce(h, w, y), log_probs(h, w, y))``, imported
#: when built (a peer that is not installed is reported, not fatal).
_PEERS = {"liger": _liger, "cce": _cce, "quack": _quack}


class _with_head_gemm:
    """``f`` whose step (forward and backward, see :func:`step`) runs with LOGITLESS_HEAD_GEMM=``mode``."""

    def __init__(self, f, mode):
        self.f, self.mode = f, mode

    def __call__(self, *args):
        return self.f(*args)

    def context(self):
        from logitless.settings import settings

        return settings.override(head_gemm=self.mode)


def _linear_obj(h, w, y, adv, consts, impl):
    from logitless.ops import linear_token_objective

    return linear_token_objective(h, w, y, objective(y, adv, consts), ignore_index=IGN, need_entropy=True,
                                  impl=impl)[0]


def step(f, mode, h, w, y, g1, g2):
    """One timed unit: forward (+ backward). Returns what the error check needs.

    ``g1``, ``g2``: upstream gradients of logp and ent (logp), advantages and the other constants
    (obj, :func:`grpo_inputs`).
    ``f.context()``, when ``f`` has one, is entered around the whole step (knobs that the backward
    reads too).
    """
    with (f.context() if hasattr(f, "context") else contextlib.nullcontext()):
        return _step(f, mode, h, w, y, g1, g2)


def _step(f, mode, h, w, y, g1, g2):
    if mode in ("fwd", "ref"):
        with torch.no_grad():
            return f(h, w, y)
    h.grad = w.grad = None
    out = f(h, w, y, g1, g2) if mode == "obj" else f(h, w, y)
    if mode in ("ce", "obj"):
        out.backward()
        return out.detach()
    logp, ent = out
    (logp * g1 + ent * g2).sum().backward()
    return logp.detach(), ent.detach()


# ---------------------------------------------------------------- float64 reference (chunked)
def reference64(h, w, y, g1, g2, adv=None, consts=None, rows=1024):
    """float64 CE(mean), logp/ent and (given ``adv``, ``consts``) the obj loss, with their gradients,
    chunked over rows on the device."""
    h64, w64 = h.detach().double(), w.detach().double()
    n = h.shape[0]
    valid = y != IGN
    n_valid = valid.sum().clamp(min=1).double()
    logp = torch.zeros(n, dtype=torch.float64, device=h.device)
    ent = torch.zeros_like(logp)
    obj = logp.new_zeros(())
    keys = ("ce", "logp") + (("obj",) if adv is not None else ())
    grads = {k: (torch.zeros_like(h64), torch.zeros_like(w64)) for k in keys}
    for s in range(0, n, rows):
        hc, yc, vc = h64[s:s + rows], y[s:s + rows], valid[s:s + rows]
        z = hc @ w64.t()
        lse = z.logsumexp(-1, keepdim=True)
        p = (z - lse).exp()
        safe = torch.where(vc, yc, 0)
        lp = (z.gather(-1, safe[:, None]) - lse).squeeze(-1)
        en = (lse.squeeze(-1) - (p * z).sum(-1))
        logp[s:s + rows] = lp * vc
        ent[s:s + rows] = en * vc
        onehot = torch.zeros_like(z).scatter_(-1, safe[:, None], 1.0)
        # Per-row upstreams (d/dlogp, d/dent): given (logp), or the objective's own (obj, a sum of
        # per-token terms, so autograd on this chunk's rows gives them).
        ups = {"logp": (g1[s:s + rows].double(), g2[s:s + rows].double())}
        if adv is not None:
            lp_, en_ = (t.detach().requires_grad_() for t in (logp[s:s + rows], ent[s:s + rows]))
            with torch.enable_grad():
                value = grpo_terms(lp_, en_, torch.arange(s, s + hc.shape[0], device=h.device), y, adv, consts)
                ups["obj"] = torch.autograd.grad(value, (lp_, en_))
            obj += value.detach()
        for key in keys:
            if key == "ce":
                dz = (p - onehot) / n_valid
            else:
                u1, u2 = ups[key]
                dz = u1[:, None] * (onehot - p) - u2[:, None] * p * (z - lse + en[:, None])
            dz *= vc[:, None]
            grads[key][0][s:s + rows] = dz @ w64
            grads[key][1].addmm_(dz.t(), hc)
            del dz
        del z, p, onehot
    loss = -(logp.sum() / n_valid)
    # Kept as fp32 (rounding 6e-8, far below any error measured) to leave memory to the peers.
    f32 = {k: tuple(t.float() for t in v) for k, v in grads.items()}
    out = {"ce": (loss, *f32["ce"]), "logp": (logp, ent, *f32["logp"])}
    if adv is not None:
        out["obj"] = (obj, *f32["obj"])
    return out


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-300)).item()


def errors(mode, out, h, w, ref):
    """``err_out``, ``err_dh``, ``err_dw`` of one step's output and gradients against ``ref``."""
    if mode in ("ce", "obj"):
        r_loss, r_dh, r_dw = ref[mode][:3]
        return dict(err_out=rel(out, r_loss), err_dh=rel(h.grad, r_dh), err_dw=rel(w.grad, r_dw))
    r_lp, r_ent, r_dh, r_dw = ref["logp"]
    logp, ent = out
    err = rel(logp, r_lp)
    if ent is not None:
        err = max(err, rel(ent, r_ent))
    if mode in ("fwd", "ref"):
        return dict(err_out=err)
    return dict(err_out=err, err_dh=rel(h.grad, r_dh), err_dw=rel(w.grad, r_dw))


# ---------------------------------------------------------------- timing
def time_ms(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(impl, mode, f, h, w, y, g1, g2, ref, reps, warmup):
    row = dict(impl=impl, mode=mode)
    run = lambda: step(f, mode, h, w, y, g1, g2)  # noqa: E731
    run()  # compile / autotune outside the memory measurement
    torch.cuda.synchronize()
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    if ref is not _NO_REF:
        row.update(errors(mode, out, h, w, ref))
    del out
    # Each rep times one GEMM then one step back to back; the ratio is the median of the per-rep
    # ratios, so both sides see the same clocks (they drift by 10% under sustained load).
    gemm = lambda: torch.matmul(h.detach(), w.detach().t())  # noqa: E731
    for _ in range(warmup):
        gemm()
        run()
    pairs = [(time_ms(gemm, 1, 0), time_ms(run, 1, 0)) for _ in range(reps)]
    row["ms"] = statistics.median(p[1] for p in pairs)
    row["gemm_ms"] = statistics.median(p[0] for p in pairs)
    row["gemms"] = statistics.median(p[1] / p[0] for p in pairs)
    h.grad = w.grad = None
    return row


class _Rows(list):
    """Rows, each appended to the CSV as soon as it is measured (a killed run keeps its rows)."""

    def __init__(self, path, fields):
        super().__init__()
        # an existing CSV of fewer columns is rewritten under the new header first, so rows line up
        self.path, self.fields = path, _add_columns(Path(path), fields) if path else fields
        if path and not os.path.exists(path):
            with open(path, "w", newline="") as fh:
                csv.DictWriter(fh, fieldnames=fields).writeheader()

    def append(self, r):
        super().append(r)
        if self.path:
            with open(self.path, "a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=self.fields, extrasaction="ignore").writerow(
                    {k: (f"{r[k]:.4g}" if isinstance(r.get(k), float) else r.get(k, ""))
                     for k in self.fields})


def micro(shape, reps=10):
    """Prints the pieces of the triton path at one shape: chunk GEMMs, epilogue variants, a profile."""
    import itertools

    from logitless.ops.triton import head

    n, hd, v = SHAPES[shape]
    dev = torch.device("cuda")
    h = torch.randn(n, hd, device=dev, dtype=torch.bfloat16)
    w = torch.randn(v, hd, device=dev, dtype=torch.bfloat16) * (2.0 / math.sqrt(hd))
    full = time_ms(lambda: h @ w.t(), reps, 3)
    print(f"## micro {shape}: full GEMM {full:.2f} ms")
    y = torch.randint(0, v, (n,), device=dev)
    saved = (head.PREFETCH, head.BLOCK_V, head.PROGRAMS_PER_SM)
    for rows, cols in ((768, v), (4096, 10240)):
        buf = torch.randn(rows, cols, device=dev).to(torch.bfloat16)
        lse = torch.zeros(rows, device=dev)
        coef = torch.ones((), device=dev)
        for stats, block, pps in itertools.product((True, False), (2048, 4096, 8192), (4, 8)):
            head.PREFETCH, head.BLOCK_V, head.PROGRAMS_PER_SM = stats, block, pps
            ch = head._Tile(*head._num_splits(rows, cols, dev), None)
            ch.part = torch.empty(rows, ch.splits, 3, device=dev)
            t_st = time_ms(lambda: head._row_stats(ch, buf, 1.0), reps, 2)
            t_dl = time_ms(lambda: head._dlogits(ch, buf, None, 0, y, lse, None, None, None, coef, 1.0, IGN),
                           reps, 2)
            print(f"{rows}x{cols} prefetch={stats} BLOCK_V={block} pps={pps} splits={ch.splits}: stats "
                  f"{buf.numel() * 2 / t_st / 1e6:.0f} GB/s, dlogits {buf.numel() * 4 / t_dl / 1e6:.0f} GB/s",
                  flush=True)
        buf = None
    head.PREFETCH, head.BLOCK_V, head.PROGRAMS_PER_SM = saved
    hg = h.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    from torch.profiler import ProfilerActivity, profile

    for mode in ("ce", "fwd"):
        f = build("triton", mode)
        for _ in range(2):
            step(f, mode, hg, wg, y, None, None)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(f, mode, hg, wg, y, None, None)
            torch.cuda.synchronize()
        print(f"### profile triton {mode} {shape}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


PROFILE_CASES = (("triton", "ce"), ("triton_fused", "ce"), ("triton", "logp"), ("triton", "fwd"),
                 ("triton", "obj"), ("triton_hgemm", "ce"), ("triton_fused_hgemm", "ce"),
                 ("triton_hgemm", "logp"), ("triton_hgemm", "fwd"), ("triton_hgemm", "obj"), ("liger", "ce"),
                 ("liger", "fwd"), ("chunked", "logp"), ("tt_compiled", "logp"), ("chunked", "fwd"),
                 ("tt_compiled", "fwd"))


def profile_cases(impls, modes):
    """The (impl, mode) pairs of :data:`PROFILE_CASES` that ``--profile`` runs: those whose impl is
    in ``impls`` and whose mode is in ``modes``.

    Raises:
        ValueError: none is, naming the arguments and the pairs there are.
    """
    cases = [(i, m) for i, m in PROFILE_CASES if i in impls and m in modes]
    if not cases:
        pairs = ", ".join(f"{i}/{m}" for i, m in PROFILE_CASES)
        raise ValueError(f"--profile: no profiled pair has an impl of --impls {','.join(impls)} and a mode of "
                         f"--modes {','.join(modes)}; the pairs: {pairs}")
    return cases


_GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "cublas")
#: Triton kernels that are GEMMs (with their epilogues inside): logitless.ops.triton.gemm_epilogues.
_TRITON_GEMMS = ("logits_stats_kernel", "logits_dlogits_kernel", "dw_accumulate_kernel")


def _kernel_category(name):
    low = name.lower()
    if any(k in low for k in _GEMM_NAMES + _TRITON_GEMMS):
        return "gemm"
    if "_kernel" in low and not low.startswith(("void at::", "at::")):
        return "epilogue"  # the Triton kernels (ours, or a peer's)
    return "other"  # torch elementwise / index / reduce / copy kernels


LOGITS = ("gaussian", "peaked", "zipf")
#: peaked inputs: how far each row's 3 favoured tokens stand above the std-1 background logits, and
#: how often the label is the top one / one of the other two.
PEAK_LOGITS, P_TOP, P_OTHER_PEAK = (15.0, 12.0, 9.0), 0.6, 0.25


def head_inputs(shape, device, logits="gaussian", logit_std=2.0, ignore_frac=0.0, dims=None):
    """bf16 inputs of one head shape (seed 0): ``h, w, y, g_logp, g_ent, generator``.

    Args:
        shape (str): a key of ``SHAPES``. device (torch.device): where to build them.
        logits (str): ``"gaussian"``: normed hidden ~ N(0, 1), logits ~ N(0, logit_std^2);
            ``"peaked"``: as a trained LM's; ``"zipf"``: peaked, tokens drawn by frequency (see the
            module docstring).
        logit_std (float): std of the Gaussian logits (the background's is 1 when peaked).
        ignore_frac (float): fraction of labels set to the ignored index.
        dims (Optional[Tuple[int, int, int]]): ``(N, H, V)`` instead of ``SHAPES[shape]``.

    Returns:
        tuple: ``h, w, y, g1, g2, gen``; the generator continues the same stream (GRPO constants).
    """
    if logits not in LOGITS:
        raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
    if not 0.0 <= ignore_frac < 1.0:
        raise ValueError(f"ignore_frac must be in [0, 1), got {ignore_frac}")
    n, hd, v = dims or SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hd, device=device, generator=gen)
    std = logit_std if logits == "gaussian" else 1.0
    w = torch.randn(v, hd, device=device, generator=gen) * (std / math.sqrt(hd))
    if logits == "zipf":
        freq = 1.0 / torch.arange(1, v + 1, device=device, dtype=torch.float64)  # token id = rank
        draw = lambda *size: torch.multinomial(freq, math.prod(size), replacement=True,  # noqa: E731
                                               generator=gen).view(size)
    else:
        draw = lambda *size: torch.randint(0, v, size, device=device, generator=gen)  # noqa: E731
    y = draw(n)
    if logits != "gaussian":
        # h += sum_k b_k W[t_k] / |W[t_k]|^2 lifts logit t_k by b_k (cross terms ~ b / sqrt(H))
        top = draw(n, len(PEAK_LOGITS))
        for k, b in enumerate(PEAK_LOGITS):
            wk = w[top[:, k]]
            h += b * wk / wk.square().sum(-1, keepdim=True)
        u = torch.rand(n, device=device, generator=gen)
        other = top[torch.arange(n, device=device),
                    torch.randint(1, len(PEAK_LOGITS), (n,), device=device, generator=gen)]
        y = torch.where(u < P_TOP, top[:, 0], torch.where(u < P_TOP + P_OTHER_PEAK, other, y))
    if ignore_frac:
        y = torch.where(torch.rand(n, device=device, generator=gen) < ignore_frac, IGN, y)
    h = h.to(torch.bfloat16).requires_grad_(True)
    w = w.to(torch.bfloat16).requires_grad_(True)
    g1 = torch.randn(n, device=device, generator=gen)
    g2 = torch.randn(n, device=device, generator=gen)
    return h, w, y, g1, g2, gen


def _largest_gaps(prof, k):
    """The ``k`` longest stretches with no kernel running: (microseconds, kernel before, after,
    the innermost host ops that span most of the stretch)."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    host = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    gaps, end, name = [], None, ""
    for s0, s1, nm in ks:
        if end is not None and s0 > end:
            gaps.append((s0 - end, name, nm, end, s0))
        if end is None or s1 > end:
            end, name = s1, nm
    small = [g[0] for g in gaps if g[0] <= 100]
    print(f"    idle stretches: {len(gaps) - len(small)} over 100 us "
          f"({sum(g[0] for g in gaps) - sum(small):.0f} us), {len(small)} shorter ({sum(small):.0f} us)")
    out = []
    for us, before, after, g0, g1 in sorted(gaps, reverse=True)[:k]:
        spans = [e for e in host
                 if min(e.time_range.end, g1) - max(e.time_range.start, g0) > 0.5 * (g1 - g0)]
        spans.sort(key=lambda e: e.time_range.end - e.time_range.start)
        out.append((us, before, after, ", ".join(e.name[:40] for e in spans[:3])))
    return out


def profile_breakdown(shape, out=None, reps=3, logits="gaussian", logit_std=2.0, ignore_frac=0.0,
                      cases=PROFILE_CASES):
    """Where each head path spends its GPU time, in units of one GEMM of the same run.

    For each (impl, mode) of ``cases`` (:func:`profile_cases`): ``reps`` steps under
    ``torch.profiler``; kernel time is summed per category (cuBLAS GEMMs, Triton epilogues, other
    torch kernels) and compared with the steps' wall time on CUDA events (the rest is idle GPU:
    launch gaps, host syncs).
    """
    from torch.profiler import ProfilerActivity, profile

    import triton

    h, w, y, g1, g2, gen = head_inputs(shape, torch.device("cuda"), logits, logit_std, ignore_frac)
    adv, consts = grpo_inputs(h, w, y, gen)
    gemm_ms = time_ms(lambda: torch.matmul(h.detach(), w.detach().t()), 10, 3)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    fields = ["shape", "impl", "mode", "gemm_ms", "wall", "gemm", "epilogue", "other", "idle",
              "n_gemm_kernels", "top_kernels", *meta]
    rows = _Rows(out, fields)
    print(f"## profile {shape}: one GEMM = {gemm_ms:.2f} ms (all figures below in GEMMs per step)")
    for impl, mode in cases:
        f = build(impl, mode)
        if isinstance(f, str):
            print(f"{impl:13s} {mode:4s} {f}")
            continue
        ups = (adv, consts) if mode == "obj" else (g1, g2)
        run = lambda: step(f, mode, h, w, y, *ups)  # noqa: E731
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        wall = time_ms(run, reps, 0)
        host = []
        for _ in range(reps):  # host time to issue one step (it waits only at its own syncs)
            t0 = time.perf_counter()
            run()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        host_ms = statistics.median(host)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                run()
            torch.cuda.synchronize()
        cats, count, per_kernel = {"gemm": 0.0, "epilogue": 0.0, "other": 0.0}, 0, {}
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            ms = e.device_time_total / 1e3 / reps
            c = _kernel_category(e.name)
            cats[c] += ms
            count += c == "gemm"
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + ms
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:4]
        gaps = _largest_gaps(prof, 4)
        r = dict(shape=shape, impl=impl, mode=mode, gemm_ms=round(gemm_ms, 3), wall=wall / gemm_ms,
                 **{k: t / gemm_ms for k, t in cats.items()},
                 idle=max(0.0, wall - sum(cats.values())) / gemm_ms, n_gemm_kernels=count // reps,
                 top_kernels="; ".join(f"{k[:48]}={t / gemm_ms:.3f}" for k, t in top), **meta)
        rows.append(r)
        print(f"{impl:13s} {mode:4s} wall {r['wall']:.2f} = gemm {r['gemm']:.2f} + epilogue "
              f"{r['epilogue']:.2f} + other {r['other']:.2f} + idle {r['idle']:.2f} "
              f"({r['n_gemm_kernels']} GEMM launches); host issues a step in {host_ms / gemm_ms:.2f}",
              flush=True)
        print("    " + r["top_kernels"], flush=True)
        for us, before, after, host in gaps:
            print(f"    idle {us:.0f} us between {before[:30]} and {after[:30]}; host: {host}", flush=True)
        h.grad = w.grad = None
        torch.cuda.empty_cache()


#: Block configurations of the Triton head GEMMs the sweep tries, bf16:
#: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, warp_specialize); the first is the
#: default. A configuration the compiler or the SM cannot run is reported, not fatal.
SWEEP_BLOCKS = [(128, 128, 64, 8, 8, 3, 0), (128, 256, 64, 8, 8, 3, 0), (256, 128, 64, 8, 8, 3, 0),
                (128, 128, 64, 8, 4, 4, 0), (64, 256, 64, 8, 4, 4, 0), (128, 64, 64, 8, 4, 4, 0),
                (128, 128, 64, 8, 8, 3, 1), (128, 256, 64, 8, 8, 3, 1)]
#: Which kernel each sweep mode times: fwd (statistics GEMM), logp (dlogits GEMM), ce (dW GEMM).
SWEEP_KINDS = (("stats", "fwd"), ("dlogits", "logp"), ("dw", "ce"))


def parse_hgemm_blocks(spec):
    """``"stats=128x256x64x8x8x3x0,dw=..."`` -> ``{kind: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps,
    stages, warp_specialize)}``."""
    out = {}
    for item in filter(None, spec.split(",")):
        kind, _, cfg = item.partition("=")
        vals = tuple(int(x) for x in cfg.split("x")) if cfg else ()
        if kind not in ("stats", "dlogits", "dw") or len(vals) != 7:
            raise ValueError(f"--hgemm-blocks: expected KIND=MxNxKxGROUPxWARPSxSTAGESxWS with KIND one of "
                             f"stats, dlogits, dw; got {item!r}")
        out[kind] = vals
    return out


def hgemm_sweep(shape, out=None, reps=5, ignore_frac=0.1):
    """Block sizes and programs per SM of the Triton head GEMMs (LOGITLESS_HEAD_GEMM=triton), bf16.

    Each kernel kind is swept alone (the others at their defaults) in the mode that runs it:
    statistics GEMM in ``fwd``, dlogits GEMM in ``logp``, dW GEMM in ``ce``; times in GEMMs of the
    same run. Prints the table last, the fastest configuration per kind marked.
    """
    import triton

    from logitless.ops.triton import gemm_epilogues
    from logitless.settings import settings

    h, w, y, g1, g2, _ = head_inputs(shape, torch.device("cuda"), "gaussian", 2.0, ignore_frac)
    fields = ["shape", "kernel", "mode", "blocks", "programs_per_sm", "ms", "gemms", "peak_extra_gib", "note", "gpu",
              "torch", "triton", "date"]
    rows = _Rows(out, fields)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat())
    defaults = dict(gemm_epilogues.BLOCKS)
    for kind, mode in SWEEP_KINDS:
        for cfg in SWEEP_BLOCKS:
            for per_sm in (1, 2):
                base = dict(shape=shape, kernel=kind, mode=mode, blocks="x".join(map(str, cfg)), programs_per_sm=per_sm,
                            **meta)
                gemm_epilogues.BLOCKS[(kind, torch.bfloat16)] = cfg
                try:
                    with settings.override(head_gemm_programs_per_sm=per_sm):
                        r = measure("triton_hgemm", mode, build("triton_hgemm", mode), h, w, y, g1, g2, _NO_REF, reps, 1)
                    rows.append(dict(base, ms=round(r["ms"], 3), gemms=round(r["gemms"], 3),
                                     peak_extra_gib=round(r["peak_extra_gib"], 3), note=""))
                except Exception as exc:  # e.g. a tile that needs more shared memory than the SM has
                    rows.append(dict(base, note=f"{type(exc).__name__}: {exc}"[:100]))
                finally:
                    gemm_epilogues.BLOCKS.clear()
                    gemm_epilogues.BLOCKS.update(defaults)
                h.grad = w.grad = None
                torch.cuda.empty_cache()
    print(f"\n## hgemm sweep {shape} (bf16, {ignore_frac:g} ignored): GEMMs per step, * = fastest per kernel")
    print("| kernel | mode | blocks (MxNxKxGxWxSxWS) | programs/SM | ms | GEMMs | note |\n|---|---|---|---:|---:|---:|---|")
    for kind, _ in SWEEP_KINDS:
        timed = [r for r in rows if r["kernel"] == kind and "gemms" in r]
        best = min(timed, key=lambda r: r["gemms"]) if timed else None
        for r in (r for r in rows if r["kernel"] == kind):
            mark = "*" if r is best else ""
            print(f"| {kind} | {r['mode']} | {r['blocks']}{mark} | {r['programs_per_sm']} | {r.get('ms', '')} | "
                  f"{r.get('gemms', '')} | {r['note']} |")


def tradeoffs(shape, reps=5):
    """Workspace size vs speed, the cost of ignored rows, and epilogue launch shapes (triton only)."""
    from logitless.ops.triton import head

    n, hd, v = SHAPES[shape]
    dev = torch.device("cuda")
    h = torch.randn(n, hd, device=dev).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, hd, device=dev) * (2.0 / math.sqrt(hd))).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, v, (n,), device=dev)
    print(f"## tradeoffs {shape}")
    f = build("triton_fused", "ce")
    for mib in (224, 512, 1024, 2048):
        head.WORKSPACE_BYTES = mib << 20
        r = measure("triton", "ce", f, h, w, y, None, None, _NO_REF, reps, 1)
        print(f"ce workspace {mib:5d} MiB: {r['ms']:.1f} ms = {r['gemms']:.2f} GEMMs, peak extra "
              f"{r['peak_extra_gib']:.2f} GiB", flush=True)
    head.WORKSPACE_BYTES = 224 << 20
    for frac in (0.0, 0.5, 0.9):
        yi = y.clone()
        yi[torch.rand(n, device=dev) < frac] = IGN
        for mode in ("ce", "fwd"):
            r = measure("triton", mode, build("triton", mode), h, w, yi, None, None, _NO_REF, reps, 1)
            print(f"{mode} ignored {frac:.0%}: {r['ms']:.1f} ms = {r['gemms']:.2f} GEMMs", flush=True)
    for block, warps in ():
        head.BLOCK_V, head._NUM_WARPS = block, warps
        for mode in ("ce", "fwd"):
            r = measure("triton", mode, build("triton", mode), h, w, y, None, None, _NO_REF, reps, 1)
            print(f"{mode} BLOCK_V={block} num_warps={warps}: {r['ms']:.1f} ms = {r['gemms']:.2f} GEMMs",
                  flush=True)


class _NoRef(dict):
    # measure() without the float64 check (the trade-off runs only time).
    def __getitem__(self, key):
        return None


_NO_REF = _NoRef()


def plot(csv_path, png_path):
    """Draws GEMM ratios and peak extra memory per implementation from a results CSV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as fh:
        rows = [r for r in csv.DictReader(fh) if r["ms"]]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]  # an empty panel cannot be log-scaled
    fig, axes = plt.subplots(2, len(modes), figsize=(5.2 * len(modes), 7.5), squeeze=False)
    width = 0.8 / len(impls)
    for col, mode in enumerate(modes):
        for row, (key, label) in enumerate((("gemms", "time / one GEMM"), ("peak_extra_gib", "peak extra GiB"))):
            ax = axes[row][col]
            for k, impl in enumerate(impls):
                vals = []
                for shape in shapes:
                    hit = [r for r in rows if r["shape"] == shape and r["mode"] == mode and r["impl"] == impl]
                    vals.append(float(hit[0][key]) if hit else float("nan"))
                ax.bar([x + k * width for x in range(len(shapes))], vals, width, label=impl)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes)
            ax.set_ylabel(label)
            if key == "gemms":
                ax.set_title(f"{mode}: no_grad" if mode in ("fwd", "ref") else f"{mode}: fwd+bwd")
            else:
                ax.set_yscale("log")
    axes[0][0].legend(fontsize=7, ncol=2)
    gpu = rows[0].get("gpu", "")
    fig.suptitle(f"LM-head losses on {gpu} (torch {rows[0].get('torch', '')}, bf16)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def _fmt(x, spec):
    return format(float(x), spec) if x not in ("", None, "nan") and float(x) == float(x) else ""


def tables(csv_path, out=sys.stdout):
    """Markdown tables of a results CSV, one per (shape, logits regime, ignored fraction), in the
    order the rows were measured (the README and docs/benchmarks.md tables come from here)."""
    with open(csv_path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("ms")]
    keys = list(dict.fromkeys((r["shape"], r.get("logits", ""), r.get("ignore_frac", "")) for r in rows))
    for shape, regime, ign in keys:
        sel = [r for r in rows if (r["shape"], r.get("logits", ""), r.get("ignore_frac", "")) == (shape, regime, ign)]
        r0 = sel[0]
        print(f"\n#### {shape} ({r0['N']}, {r0['H']}, {r0['V']}), {regime or 'gaussian-std2'} logits, "
              f"{float(ign or 0):.0%} ignored labels: one GEMM = {float(r0['gemm_ms']):.1f} ms\n", file=out)
        print("| mode | impl | ms | GEMMs | peak extra GiB | err loss/logp | err dh | err dW |", file=out)
        print("|---|---|---:|---:|---:|---:|---:|---:|", file=out)
        for r in sel:
            impl = f"**{r['impl']}**" if r["impl"] == "triton" else r["impl"]
            gemms = _fmt(r["gemms"], ".2f")
            print(f"| {r['mode']} | {impl} | {_fmt(r['ms'], '.1f')} | "
                  f"{f'**{gemms}**' if r['impl'] == 'triton' else gemms} | {_fmt(r['peak_extra_gib'], '.2f')} | "
                  f"{_fmt(r['err_out'], '.1e')} | {_fmt(r['err_dh'], '.1e')} | {_fmt(r['err_dw'], '.1e')} |", file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen7b,llama8b,qwen05b,long")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--compile-shapes", default="qwen7b,qwen05b",
                    help="shapes where torch.compile runs (each costs a compilation per mode)")
    ap.add_argument("--logits", default="gaussian",
                    help="input regimes, comma-separated: " + ", ".join(LOGITS))
    ap.add_argument("--logit-std", type=float, default=2.0, help="std of the gaussian logits")
    ap.add_argument("--ignore-frac", type=float, default=0.0, help="fraction of ignored labels")
    ap.add_argument("--objective", default="basic", choices=sorted(OBJECTIVES),
                    help="the obj mode's GRPO objective (full: importance weights, delta, top-entropy mask, k3 KL)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="CSV path (appends rows)")
    ap.add_argument("--micro", default="", help="shapes for the piecewise timing of the triton path")
    ap.add_argument("--tradeoffs", default="", help="shapes for workspace / ignored-rows / launch sweeps")
    ap.add_argument("--profile", default="", help="shapes for the GEMM / epilogue / idle split of each path")
    ap.add_argument("--hgemm-sweep", default="", help="shapes for the block-size sweep of the Triton head GEMMs")
    ap.add_argument("--hgemm-blocks", default="",
                    help="block sizes of the Triton head GEMMs for this run, bf16: "
                         "KIND=MxNxKxGROUPxWARPSxSTAGESxWS,... (KIND: stats, dlogits, dw; WS: warp "
                         "specialisation 0/1)")
    ap.add_argument("--plot", nargs=2, metavar=("CSV", "PNG"), help="only draw a results CSV")
    ap.add_argument("--table", metavar="CSV", help="only print a results CSV as markdown tables")
    args = ap.parse_args(argv)
    set_objective(args.objective)
    if args.profile:
        try:
            cases = profile_cases(args.impls.split(","), args.modes.split(","))
        except ValueError as e:
            ap.error(str(e))
    if args.plot:
        return plot(*args.plot)
    if args.table:
        return tables(args.table)
    if args.hgemm_blocks:
        from logitless.ops.triton import gemm_epilogues

        for kind, cfg in parse_hgemm_blocks(args.hgemm_blocks).items():
            gemm_epilogues.BLOCKS[(kind, torch.bfloat16)] = cfg
    for shape in filter(None, args.hgemm_sweep.split(",")):
        hgemm_sweep(shape, args.out, ignore_frac=args.ignore_frac)
    if args.hgemm_sweep:
        return
    for shape in filter(None, args.tradeoffs.split(",")):
        tradeoffs(shape)
    if args.tradeoffs:
        return
    for shape in filter(None, args.profile.split(",")):
        profile_breakdown(shape, args.out, logits=args.logits.split(",")[0], logit_std=args.logit_std,
                          ignore_frac=args.ignore_frac, cases=cases)
    if args.profile:
        return
    for shape in filter(None, args.micro.split(",")):
        micro(shape)
    if args.micro:
        return
    if not torch.cuda.is_available():
        sys.exit("bench_head.py needs a CUDA device")
    import triton

    modes = args.modes.split(",")
    dev = torch.device("cuda")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, date=datetime.date.today().isoformat(), objective=args.objective,
                **{k.replace("-", "_"): v for k, v in _peer_versions().items()})
    print("# " + " ".join(f"{k}={v}" for k, v in meta.items()), flush=True)
    fields = ["shape", "N", "H", "V", "logits", "ignore_frac", "mode", "impl", "ms", "gemm_ms", "gemms", "peak_extra_gib",
              "err_out", "err_dh", "err_dw", "note", *meta.keys()]
    rows = _Rows(args.out, fields)
    for shape, regime in [(s, r) for s in args.shapes.split(",") for r in args.logits.split(",")]:
        n, hd, v = SHAPES[shape]
        h, w, y, g1, g2, gen = head_inputs(shape, dev, regime, args.logit_std, args.ignore_frac)
        regime_name = f"gaussian-std{args.logit_std:g}" if regime == "gaussian" else regime
        adv, consts = grpo_inputs(h, w, y, gen) if "obj" in modes else (None, None)
        ref = reference64(h, w, y, g1, g2, adv, consts)
        torch.cuda.empty_cache()
        gemm = time_ms(lambda: torch.matmul(h.detach(), w.detach().t()), max(args.reps, 10), 3)
        print(f"## {shape} N={n} H={hd} V={v} {regime_name} ignored {args.ignore_frac:g}: "
              f"one GEMM = {gemm:.2f} ms", flush=True)
        for mode in modes:
            ups = (adv, consts) if mode == "obj" else (g1, g2)
            for impl in args.impls.split(","):
                base = dict(shape=shape, N=n, H=hd, V=v, logits=regime_name, ignore_frac=args.ignore_frac,
                            mode=mode, impl=impl, gemm_ms=round(gemm, 3), **meta)
                if impl == "compile" and shape not in args.compile_shapes.split(","):
                    rows.append(dict(base, note="skipped: compile budget"))
                    continue
                f = build(impl, mode)
                if isinstance(f, str):
                    rows.append(dict(base, note=f))
                    print(f"{shape:8s} {mode:4s} {impl:14s} {f}", flush=True)
                    continue
                try:
                    r = measure(impl, mode, f, h, w, y, *ups, ref, args.reps, args.warmup)
                    rows.append(dict(base, **r, note=""))
                    print(f"{shape:8s} {regime:8s} {mode:4s} {impl:14s} {r['ms']:8.2f} ms {r['gemms']:5.2f} GEMMs "
                          f"{r['peak_extra_gib']:6.2f} GiB err {r.get('err_out', float('nan')):.2e} "
                          f"{r.get('err_dh', float('nan')):.2e} {r.get('err_dw', float('nan')):.2e}",
                          flush=True)
                except torch.cuda.OutOfMemoryError:
                    rows.append(dict(base, note="OOM"))
                    print(f"{shape:8s} {mode:4s} {impl:14s} OOM", flush=True)
                except Exception as exc:
                    traceback.print_exc()
                    rows.append(dict(base, note=f"error: {type(exc).__name__}: {exc}"[:160]))
                h.grad = w.grad = None
                del f
                torch._dynamo.reset()
                torch.cuda.empty_cache()
        h = w = y = g1 = g2 = adv = consts = ups = ref = None
        torch.cuda.empty_cache()
    print("\nshape    logits          mode impl              ms  GEMMs  GiB   err_out  err_dh   err_dw   note")
    for r in rows:
        if "ms" in r:
            print(f"{r['shape']:8s} {r['logits']:15s} {r['mode']:4s} {r['impl']:14s} {r['ms']:7.1f} {r['gemms']:5.2f} "
                  f"{r['peak_extra_gib']:5.2f} {r.get('err_out', float('nan')):.1e} "
                  f"{r.get('err_dh', float('nan')):.1e} {r.get('err_dw', float('nan')):.1e}")
        else:
            print(f"{r['shape']:8s} {r['logits']:15s} {r['mode']:4s} {r['impl']:14s} {r['note']}")


if __name__ == "__main__":
    main()
