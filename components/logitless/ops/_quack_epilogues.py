"""QuACK GEMM epilogues of the head (imports ``quack``: load only where it is installed).

QuACK mints and caches one kernel per epilogue function, keyed by the function's source and the
operands' metadata, so the functions live at module level, where a fresh process finds them again.

Two epilogues:

* :func:`label_log_prob_stats`: each row's online log-sum-exp and its label's logit (log-probs
  without entropy);
* :func:`tile_entropy_stats`: per (row, N tile) the tile's max logit, ``sum 2^x`` and
  ``sum 2^x * x`` with ``x = (z - max) * log2(e)``, and the label's logit, which
  :func:`logitless.ops.triton.kernels.finalize_tile_stats_kernel` folds into log-probs, entropy and
  the float64 log-sum-exp. The tile max is a prepass over the accumulator (registers on sm_90), so
  each element takes one exponential and no rescaling;
* :func:`dw_accumulate`: no epilogue of ours, QuACK's plain GEMM adding into dW through its store;
* :func:`slab_dlogits`: the backward's recompute of a V slab of logits, which stores the gradient
  w.r.t. them instead (all but the label's entry, see
  :func:`logitless.ops.triton.kernels.label_dlogits_kernel`).
"""

import functools
import math
from typing import Optional

import cutlass
import torch
from cutlass import Float32, Uint32
from cutlass.experimental import primitives as prims
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pexp2
from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect, GroupedColStatsBase, OnlineLSEReduce
from quack.gemm_config import GemmConfig
from quack.gemm_interface import gemm_tuned

_LOG2E = math.log2(math.e)

_LABEL = ColVecLoad("target")


@gemm_epilogue(
    outs={"lse": OnlineLSEReduce("lse"), "target_logit": ColVecSelect("target_logit", idx_op=_LABEL)},
    extra_ops=(_LABEL,),
)
def _tempered_label_stats(acc, inv_temperature):
    """Each row's online log-sum-exp of ``acc * inv_temperature`` and the label's scaled fp32 logit."""
    z = acc * inv_temperature
    return {"D": z, "lse": z, "target_logit": z}


def label_log_prob_stats(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         inv_temperature: float) -> dict:
    """``{"lse": (N,), "target_logit": (N,)}`` fp32 of ``hidden @ weight.T * inv_temperature``; the
    logits are not stored. ``target_logit`` is left unwritten where the label is out of range."""
    return _tempered_label_stats(hidden, weight.mT, store_d=False, target=labels, tuned=False,
                                 inv_temperature=inv_temperature)


class TileRowMax(GroupedColStatsBase):
    """Prepass statistic: each row's max over a group of N columns (the whole tile here).

    A true max from a ``-inf`` identity; the prepass does not mask columns past ``N``, so the group
    width (the tile's N) must divide the vocabulary (QuACK's host check enforces it).
    """

    combine = "max"

    @cutlass.cute.jit
    def stat_value(self, total, group_cols):
        return total


def _bf16(v):
    """``v`` rounded to the nearest bf16 (ties to even), as fp32: the cuBLAS path's logits.

    In integer arithmetic on the bits (finite values): a conversion instruction there and back,
    which shares a pipe with the exponential, made the 7B head's forward 1.43 GEMMs against 1.11
    (H200; 1.01-1.06 unrounded).
    """
    bits = prims.mov_b32(v, target_type=Uint32)
    bits = (bits + (Uint32(0x7FFF) + ((bits >> Uint32(16)) & Uint32(1)))) & Uint32(0xFFFF0000)
    return prims.mov_b32(bits, target_type=Float32)


def _tile_max_prepass(acc):
    # The max of the raw accumulator also serves the rounded epilogue: the statistics hold for any
    # offset, and a rounded value exceeds it by at most half a bf16 step.
    return {"tile_max": acc}


def _tile_stats_spec(entropy: bool) -> dict:
    """``gemm_epilogue`` arguments of a per-(row, tile) statistics epilogue: the tile max prepass,
    ``sum 2^x`` (and ``sum 2^x x`` with ``entropy``), the label's accumulator. Each epilogue gets
    its own op instances."""
    tile_max, label = TileRowMax("tile_max"), ColVecLoad("target")
    reduces = {"sum_exp": ColVecReduce("sum_exp")}
    if entropy:
        reduces["sum_exp_x"] = ColVecReduce("sum_exp_x", scaled=True)
    return dict(ops={"tile_max": tile_max}, prepass=_tile_max_prepass, prepass_outs=("tile_max",),
                reduces=reduces, outs={"target_acc": ColVecSelect("target_acc", idx_op=label)},
                extra_ops=(tile_max.out("tile_max_out"), label))


@gemm_epilogue(**_tile_stats_spec(entropy=True))
def _tile_entropy_stats(acc, tile_max, log2e_over_t):
    """Per (row, tile): ``sum 2^x`` and ``sum 2^x x`` of ``x = (acc - tile max) log2(e) / T``; the
    label's fp32 accumulator."""
    x = (acc - tile_max) * log2e_over_t
    e = pexp2(x)
    return {"sum_exp": e, "sum_exp_x": (e, x), "target_acc": acc}


@gemm_epilogue(**_tile_stats_spec(entropy=True))
def _rounded_tile_entropy_stats(acc, tile_max, log2e_over_t):
    """:func:`_tile_entropy_stats` of the accumulator rounded to bf16, the logits that the backward's
    cuBLAS recompute sees: the log-sum-exp it is handed must be theirs, or its softmax does not sum
    to one (a bias along every direction the rows share). ``D`` (stored only when asked, rounded to
    bf16 by the store as by ``_bf16``) is the logits the one-pass cross-entropy turns into dlogits."""
    a = _bf16(acc)
    x = (a - tile_max) * log2e_over_t
    e = pexp2(x)
    return {"D": acc, "sum_exp": e, "sum_exp_x": (e, x), "target_acc": a}


@gemm_epilogue(**_tile_stats_spec(entropy=False))
def _rounded_tile_lse_stats(acc, tile_max, log2e_over_t):
    """:func:`_rounded_tile_entropy_stats` without ``sum 2^x x`` (no entropy): cross-entropy's chunks,
    whose per-tile statistics then take two thirds of the memory."""
    a = _bf16(acc)
    e = pexp2((a - tile_max) * log2e_over_t)
    return {"D": acc, "sum_exp": e, "target_acc": a}


@functools.cache
def _config(tile_n: int) -> GemmConfig:
    # one config per N tile the caller chose (quack_head.stats_tile_n)
    return GemmConfig(tile_m=128, tile_n=tile_n, cluster_m=2, cluster_n=1, pingpong=tile_n <= 208,
                      is_dynamic_persistent=False)


def tile_entropy_stats(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, log2e_over_t: float,
                       *, round_logits: bool, tile_n: int, tile_max: torch.Tensor, sum_exp: torch.Tensor,
                       sum_exp_x: Optional[torch.Tensor], target_acc: torch.Tensor,
                       logits: Optional[torch.Tensor] = None) -> None:
    """Fill the per-(row, tile) statistics of ``hidden @ weight.T`` (and store the logits when asked).

    Args:
        hidden (torch.Tensor): ``(M, H)`` bf16.
        weight (torch.Tensor): ``(V, H)`` bf16, ``V % tile_n == 0``.
        labels (torch.Tensor): ``(M,)`` int64; a label outside ``[0, V)`` leaves its row of
            ``target_acc`` unwritten.
        log2e_over_t (float): ``log2(e) / temperature``.
        round_logits (bool): round the accumulator to bf16 first (a backward recomputes bf16 logits).
        tile_n (int): one of ``quack_head.TILE_N_CHOICES``.
        tile_max, sum_exp, sum_exp_x (torch.Tensor): ``(M, V // tile_n)`` fp32 outputs: the tile's
            max accumulator, ``sum 2^x``, ``sum 2^x x`` (None: not computed; ``round_logits`` only).
        target_acc (torch.Tensor): ``(M,)`` fp32 output: the label's accumulator.
        logits (Optional[torch.Tensor]): ``(M, V)`` bf16 output with 16-byte aligned rows: the
            rounded logits, stored (``round_logits`` only); None: not stored.
    """
    if logits is not None and not round_logits:
        raise ValueError("tile_entropy_stats: logits are stored only with round_logits=True (the statistics "
                         "must be those of the stored bf16 logits)")
    if sum_exp_x is None and not round_logits:
        raise ValueError("tile_entropy_stats: sum_exp_x=None needs round_logits=True")
    store = {"store_d": False} if logits is None else {"out": {"D": logits}}
    sums = {"sum_exp": sum_exp} if sum_exp_x is None else {"sum_exp": sum_exp, "sum_exp_x": sum_exp_x}
    epilogue = _rounded_tile_lse_stats if sum_exp_x is None else \
        _rounded_tile_entropy_stats if round_logits else _tile_entropy_stats
    epilogue(hidden, weight.mT, **store, config=_config(tile_n), tile_max=tile_n, tile_max_out=tile_max, **sums,
             target=labels, target_acc=target_acc, log2e_over_t=log2e_over_t)


_SLAB_LABEL = ColVecLoad("slab_label")


@gemm_epilogue(
    ops={name: ColVecLoad(name) for name in ("lse_hi", "lse_lo", "c_lp", "c_ent", "ent")},
    outs={"label_acc": ColVecSelect("label_acc", idx_op=_SLAB_LABEL)},
    extra_ops=(_SLAB_LABEL,),
)
def _rounded_dlogits(acc, lse_hi, lse_lo, c_lp, c_ent, ent, inv_temperature):
    """``-p (c_lp + c_ent (log p + entropy))`` of the bf16-rounded logits, ``log p = z - lse`` with the
    LSE as two fp32; the label's rounded accumulator picked out for its own entry."""
    a = _bf16(acc)
    logp = (a * inv_temperature - lse_hi) - lse_lo
    p = pexp2(logp * _LOG2E)
    return {"D": -1.0 * p * (c_lp + c_ent * (logp + ent)), "label_acc": a}


def slab_dlogits(hidden: torch.Tensor, weight_slab: torch.Tensor, out: torch.Tensor, row_inputs: torch.Tensor,
                 slab_label: torch.Tensor, label_acc: torch.Tensor, inv_temperature: float) -> None:
    """Write ``d objective / d logits`` of ``hidden @ weight_slab.T`` into ``out``, but at each row's
    label, whose logit goes to ``label_acc``.

    Args:
        hidden (torch.Tensor): ``(M, H)`` bf16.
        weight_slab (torch.Tensor): ``(W, H)`` bf16, contiguous rows (a V slab of the head).
        out (torch.Tensor): ``(M, W)`` bf16, contiguous.
        row_inputs (torch.Tensor): ``(5, M)`` fp32 from ``kernels.slab_row_inputs_kernel``, each row
            contiguous and 16-byte aligned.
        slab_label (torch.Tensor): ``(M,)`` int64, the label's column in the slab or -1.
        label_acc (torch.Tensor): ``(M,)`` fp32 output, written where ``slab_label >= 0``.
        inv_temperature (float): ``1 / T``.
    """
    lse_hi, lse_lo, c_lp, c_ent, ent = row_inputs.unbind(0)
    _rounded_dlogits(hidden, weight_slab.mT, out={"D": out}, tuned=False, lse_hi=lse_hi, lse_lo=lse_lo, c_lp=c_lp,
                     c_ent=c_ent, ent=ent, slab_label=slab_label, label_acc=label_acc,
                     inv_temperature=inv_temperature)


#: The one pass's dW GEMMs (M = V, N = H, K = chunk rows): the fastest of four tile shapes on an H200
#: at the 7B and 0.5B heads (``experiments/probe_quack_ce_gemms.py``, ``quack_ce_gemms_h200.csv``).
_DW_CONFIG = GemmConfig(tile_m=128, tile_n=192, cluster_m=2, cluster_n=1, pingpong=True, is_dynamic_persistent=False)


def dw_accumulate(dw: torch.Tensor, dl: torch.Tensor, h_c: torch.Tensor, first: bool) -> None:
    """``dw (+)= dl.T @ h_c``: QuACK's GEMM at a fixed configuration (``gemm_tuned.fn``: not
    autotuned), adding through its tensor-memory store's reduce-add when not ``first``."""
    gemm_tuned.fn(dl.mT, h_c, dw, config=_DW_CONFIG, add_to_output=not first)
