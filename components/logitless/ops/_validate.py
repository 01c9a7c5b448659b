"""Argument checks shared by every implementation of the head ops.

Every check runs before any computation and raises a ``ValueError`` that names the argument, the
value received and what was expected, so a bad call never reaches a kernel (where an out-of-range
label would be a device-side assert, or silently wrong).
"""

from typing import Optional

import torch

from logitless.settings import HEAD_GEMM_BACKENDS

#: ``impl`` names, each the module it selects: ops/triton/, ops/chunked.py, ops/reference.py.
IMPLS = ("auto", "triton", "chunked", "reference")
REDUCTIONS = ("mean", "sum", "none")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Temperatures the head ops accept. Every gradient of the head carries a factor 1/T
# (d/dz of softmax(z/T)): at T = 1e-4 a unit-scale head's dh = (p - onehot) W / T reaches ~2e4,
# a third of fp16's largest value (65504), and below ~3e-5 it overflows; above 1e4 the softmax of
# O(10) logits is uniform to within 1e-3, i.e. the logits no longer matter. Anything outside is a
# typo or a unit mistake (0 for greedy belongs to the sampler, never to a log-prob).
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def check_gemm_backend(gemm_backend: Optional[str]) -> None:
    """``gemm_backend`` of the head ops and losses: None (the ``LOGITLESS_HEAD_GEMM`` setting) or one
    of :data:`~logitless.settings.HEAD_GEMM_BACKENDS`."""
    if gemm_backend is not None and gemm_backend not in HEAD_GEMM_BACKENDS:
        raise ValueError(f"gemm_backend must be None (the LOGITLESS_HEAD_GEMM setting) or one of "
                         f"{HEAD_GEMM_BACKENDS}, got {gemm_backend!r}")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_temperature(temperature: float) -> None:
    if isinstance(temperature, (torch.Tensor, bool)) or not isinstance(temperature, (int, float)):
        raise ValueError(
            f"temperature must be a positive Python float, got {type(temperature).__name__} "
            f"{temperature!r}"
        )
    bounds = f"a finite number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
    if not temperature > 0:  # also rejects NaN
        raise ValueError(f"temperature must be > 0 ({bounds}), got {temperature!r}")
    if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:  # also rejects inf
        raise ValueError(
            f"temperature must be {bounds}, got {temperature!r} (the head's gradients scale with "
            f"1/temperature; logitless.ops._validate.MIN_TEMPERATURE says why)"
        )


def check_head_dims(weight: torch.Tensor) -> None:
    """Rejects an empty vocabulary (V = 0) or hidden size (H = 0); an empty batch (N = 0) is legal.

    A softmax over no classes is undefined and a head with no features is a model-config mistake;
    both would otherwise reach a kernel (a division by zero in the chunking, an ambiguous reshape).
    N = 0 is an empty micro-batch: the ops return empty per-token outputs and a 0.0 loss.
    """
    if weight.dim() == 2 and weight.shape[0] < 1:
        raise ValueError(
            f"weight must have at least one row (V >= 1), got shape {tuple(weight.shape)}"
        )
    if weight.dim() == 2 and weight.shape[1] < 1:
        raise ValueError(
            f"hidden size H = weight.shape[1] must be >= 1, got shape {tuple(weight.shape)}"
        )


def check_chunk_size(chunk_size: Optional[int]) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")


def check_token_objective(token_objective, need_entropy) -> None:
    """``token_objective`` must be callable as ``f(logp, ent, rows)``; ``need_entropy`` a bool."""
    if not callable(token_objective):
        raise ValueError(
            f"token_objective must be a callable f(logp, ent, rows) -> scalar tensor, got "
            f"{type(token_objective).__name__}"
        )
    if not isinstance(need_entropy, bool):
        raise ValueError(f"need_entropy must be a bool, got {need_entropy!r}")


def check_head_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int,
    check_label_range: bool = True,
) -> Optional[int]:
    """Checks shapes, dtypes, devices and label values of ``(hidden, weight, labels)``.

    Args:
        hidden (torch.Tensor): ``(..., H)`` floating point.
        weight (torch.Tensor): ``(V, H)``, same dtype and device as ``hidden``.
        labels (torch.Tensor): ``hidden.shape[:-1]``, integer, each in ``[0, V)`` or ``ignore_index``.
        ignore_index (int): label value that marks a token without loss.
        check_label_range (bool): scan the labels for out-of-range values. This reads the labels
            on the host (a device sync), so it is skipped while ``torch.compile`` traces.

    Returns:
        Optional[int]: the number of non-ignored labels, read in the same host sync as the range
        check (the fused head compacts them without a second sync); None when the range is not
        checked.

    Raises:
        ValueError: on the first violated expectation, naming the argument.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"hidden must be float16, bfloat16, float32 or float64, got dtype {hidden.dtype}"
        )
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D (V, H) as nn.Linear stores it, got shape {tuple(weight.shape)}"
        )
    check_head_dims(weight)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must have shape (..., H) with H = weight.shape[1] = {weight.shape[1]}, "
            f"got hidden shape {tuple(hidden.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight dtype must equal hidden dtype {hidden.dtype}, got weight dtype {weight.dtype}"
        )
    if weight.device != hidden.device:
        raise ValueError(
            f"weight must be on hidden's device {hidden.device}, got weight on {weight.device}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
            f"got {tuple(labels.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 (or int32), got dtype {labels.dtype}")
    if labels.device != hidden.device:
        raise ValueError(
            f"labels must be on hidden's device {hidden.device}, got labels on {labels.device}"
        )
    if not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if not check_label_range or torch.compiler.is_compiling():
        return None
    if labels.numel() == 0:
        return 0
    vocab = weight.shape[0]
    kept = labels != ignore_index
    bad = kept & ((labels < 0) | (labels >= vocab))
    n_bad, n_valid = torch.stack([bad.sum(), kept.sum()]).tolist()  # the one host sync
    if n_bad:
        first = labels[bad][0].item()
        raise ValueError(
            f"labels must be in [0, {vocab}) or ignore_index={ignore_index}, "
            f"got {n_bad} label(s) out of range, e.g. {first}"
        )
    return n_valid
