"""``torch.library`` custom ops around the fused head, with fake impls and autograd.

Opaque to ``torch.compile`` (the chunk loop and the Triton launches are not traced), so a compiled
model calls them without graph breaks; the fake impls give output shapes, which never depend on
the data (no host sync is visible to the graph).

Two backward regimes:

* ``logitless::triton_ce_fused``: scalar upstream (reduction mean/sum). The forward already
  computes dh and dW for an upstream of 1; backward scales them in place by the upstream scalar
  (on the device; free when it is 1). Three GEMMs for the whole step. Backward runs once: a
  second backward through the same graph (``retain_graph=True``) raises.
* ``logitless::triton_head_fwd`` / ``triton_head_bwd``: per-token log-probs and entropy with any
  upstream gradients; the backward recomputes the logits chunk by chunk (four GEMMs).
"""

import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from logitless.ops.triton import head
from logitless.settings import settings


def _head_gemm(mode: str):
    """``settings.override(head_gemm=mode)`` for one op call; ``""``: the setting as it is."""
    return settings.override(head_gemm=mode) if mode else contextlib.nullcontext()


@torch.library.custom_op("logitless::triton_head_fwd", mutates_args=())
def head_fwd(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
             temperature: float, for_backward: bool = False,
             n_valid: int = -1, head_gemm: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    """Returns ``(logp, ent, lse)`` of shape ``(N,)`` (fp32, fp32, float64); see :func:`head.head_forward`.

    ``n_valid``: the caller's count of non-ignored labels (-1: unknown, counted with a sync).
    ``head_gemm``: ``LOGITLESS_HEAD_GEMM`` for this call (``""``: the current setting); autograd
    hands the same value to the backward, which must run the GEMMs its forward ran.
    """
    with _head_gemm(head_gemm):
        return head.head_forward(hidden, weight, labels, ignore_index, temperature, for_backward, n_valid)


@head_fwd.register_fake
def _(hidden, weight, labels, ignore_index, temperature, for_backward=False, n_valid=-1, head_gemm=""):
    n = hidden.shape[0]
    return (hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((n,), dtype=torch.float32),
            hidden.new_empty((n,), dtype=torch.float64))


@torch.library.custom_op("logitless::triton_head_bwd", mutates_args=())
def head_bwd(hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, ent: Tensor,
             g_logp: Optional[Tensor], g_ent: Optional[Tensor], ignore_index: int,
             temperature: float, need_dh: bool, need_dw: bool,
             n_valid: int = -1, head_gemm: str = "") -> Tuple[Tensor, Tensor]:
    """Returns ``(dh, dw)``; see :func:`head.head_backward`. ``head_gemm``: as in :func:`head_fwd`."""
    with _head_gemm(head_gemm):
        return head.head_backward(hidden, weight, labels, lse, ent, g_logp, g_ent, ignore_index,
                                  temperature, need_dh, need_dw, n_valid)


@head_bwd.register_fake
def _(hidden, weight, labels, lse, ent, g_logp, g_ent, ignore_index, temperature, need_dh, need_dw,
      n_valid=-1, head_gemm=""):
    return (torch.empty_like(hidden) if need_dh else hidden.new_empty((0,)),
            torch.empty_like(weight) if need_dw else weight.new_empty((0,)))


def _upstream(g: Optional[Tensor]) -> Optional[Tensor]:
    # Upstream gradients arrive in any layout (a sum's backward is a stride-0 expand).
    return None if g is None else g.to(torch.float32).contiguous()


def _head_setup(ctx, inputs, output):
    hidden, weight, labels, ignore_index, temperature = inputs[:5]
    _, ent, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, labels, lse, ent)
    ctx.ignore_index, ctx.temperature = ignore_index, temperature
    # The forward's count of valid rows: the backward compacts them again without a host sync.
    ctx.n_valid = inputs[6] if len(inputs) > 6 else -1
    # The GEMMs the forward ran (the knob may change before the backward runs).
    ctx.head_gemm = (inputs[7] if len(inputs) > 7 else "") or settings.head_gemm


def _head_backward(ctx, g_logp, g_ent, g_lse):
    hidden, weight, labels, lse, ent = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if (g_logp is None and g_ent is None) or not (need_dh or need_dw):
        return (None,) * 8
    dh, dw = head_bwd(hidden, weight, labels, lse, ent, _upstream(g_logp), _upstream(g_ent),
                      ctx.ignore_index, ctx.temperature, need_dh, need_dw, ctx.n_valid, ctx.head_gemm)
    return (dh if need_dh else None), (dw if need_dw else None), None, None, None, None, None, None


head_fwd.register_autograd(_head_backward, setup_context=_head_setup)


@torch.library.custom_op("logitless::triton_ce_fused", mutates_args=())
def ce_fused(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
             temperature: float, mean: bool, need_dh: bool, need_dw: bool,
             n_valid: int = -1, head_gemm: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    """Returns ``(loss, dh, dw)``, gradients for an upstream of 1; see :func:`head.ce_fused`.
    ``head_gemm``: as in :func:`head_fwd` (the backward only scales what the forward computed)."""
    with _head_gemm(head_gemm):
        return head.ce_fused(hidden, weight, labels, ignore_index, temperature, mean, need_dh, need_dw,
                             n_valid)


@ce_fused.register_fake
def _(hidden, weight, labels, ignore_index, temperature, mean, need_dh, need_dw, n_valid=-1, head_gemm=""):
    return (hidden.new_empty((), dtype=torch.float32),
            torch.empty_like(hidden) if need_dh else hidden.new_empty((0,)),
            torch.empty_like(weight) if need_dw else weight.new_empty((0,)))


@torch.library.custom_op("logitless::triton_scale_", mutates_args=("x",))
def scale_(x: Tensor, g: Tensor) -> None:
    """``x *= g`` in place (device scalar ``g``; no host sync)."""
    head.scale_(x, g)


@scale_.register_fake
def _(x, g):
    return None


def _ce_setup(ctx, inputs, output):
    _, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(dh, dw)
    ctx.need = (inputs[6], inputs[7])
    ctx.used = False


def _ce_backward(ctx, g_loss, g_dh, g_dw):
    if ctx.used:
        raise RuntimeError(
            "logitless triton cross-entropy: backward ran twice through the same graph; the "
            "gradients are computed in the forward and scaled in place, so retain_graph=True is "
            "not supported (use reduction='none' and sum, which recomputes)"
        )
    ctx.used = True
    dh, dw = ctx.saved_tensors
    if g_loss is None:
        return (None,) * 10
    g = g_loss.detach()
    if ctx.need[0]:
        scale_(dh, g)
    if ctx.need[1]:
        scale_(dw, g)
    return ((dh if ctx.need[0] else None), (dw if ctx.need[1] else None)) + (None,) * 8


ce_fused.register_autograd(_ce_backward, setup_context=_ce_setup)
