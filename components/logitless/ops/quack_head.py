"""Forward-only log-probs with the row statistics in a CuTe-DSL GEMM's epilogue (QuACK).

The reference and old-policy passes of GRPO, and a loss-only evaluation, need each row's log-prob of
its label and nothing else: no entropy, no gradient. QuACK (``quack-kernels``, an optional
dependency) runs the head GEMM as a warp-specialised Hopper kernel whose epilogue folds every
fp32 output tile into the row's online log-sum-exp and picks out the label's logit, so the logits
are never stored. On an H200 that forward takes 0.92-1.01 of one cuBLAS GEMM's time at the 7B, 8B,
0.5B and 32768-row heads (the GEMM writes its bf16 output; this one does not), against 1.10-1.64
for the cuBLAS + Triton-epilogue path, and its log-probs come from fp32 logits (docs/performance.md).

``LOGITLESS_HEAD_GEMM`` chooses it: ``quack`` asks for it (an error if ``quack-kernels`` is not
installed), ``auto`` takes it where it applies and QuACK is installed. It applies to bf16 inputs on
an sm_90 GPU with ``H`` a multiple of 8 (the GEMM's tensor-memory-access rows), outside
``torch.compile`` tracing, for calls that need neither entropy nor gradients; every other call runs
the ``impl="triton"`` path as before.
"""

import functools
import importlib.util

import torch

__all__ = ["quack_installed", "forward_applies", "log_probs", "ROWS_PER_LAUNCH"]

#: Rows per GEMM launch: the epilogue's per-(row, tile) log-sum-exp partials of 8192 rows take about
#: 0.05 GiB at a 152k vocabulary (0.19 GiB at 32768 rows in one launch), within the forward's 0.1 GiB.
ROWS_PER_LAUNCH = 8192


@functools.cache
def quack_installed() -> bool:
    """Whether ``quack-kernels`` can be imported (its module found once per process; not imported)."""
    return importlib.util.find_spec("quack") is not None


def forward_applies(hidden: torch.Tensor, weight: torch.Tensor, mode: str) -> bool:
    """Whether a forward-only log-prob call (no entropy, no gradient) runs on QuACK's GEMM.

    Args:
        hidden (torch.Tensor): ``(N, H)``.
        weight (torch.Tensor): ``(V, H)``.
        mode (str): ``LOGITLESS_HEAD_GEMM`` as the call sees it.

    Returns:
        bool: True for ``mode`` ``"quack"`` or ``"auto"`` with bf16 CUDA inputs on an sm_90 GPU,
        ``H % 8 == 0``, outside ``torch.compile`` tracing, and QuACK installed.

    Example:
        >>> forward_applies(torch.randn(4, 8), torch.randn(11, 8), "auto")  # CPU tensors
        False
    """
    if mode not in ("quack", "auto"):
        return False
    if torch.compiler.is_compiling():
        return False
    if not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
        return False
    if hidden.shape[1] % 8 != 0 or hidden.shape[0] == 0:
        return False
    if torch.cuda.get_device_capability(hidden.device) != (9, 0):
        return False
    return quack_installed()


def log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
              temperature: float) -> torch.Tensor:
    """Per-row ``log softmax(hidden @ weight.T / temperature)[label]``; 0 at ignored rows.

    Args:
        hidden (torch.Tensor): ``(N, H)`` bf16, contiguous, on an sm_90 GPU.
        weight (torch.Tensor): ``(V, H)`` bf16, contiguous.
        labels (torch.Tensor): ``(N,)`` int64 in ``[0, V)`` or ``ignore_index`` (validated by the
            caller).
        ignore_index (int): rows with this label get 0.
        temperature (float): > 0, divides the logits (in fp32, in the epilogue).

    Returns:
        torch.Tensor: ``(N,)`` float32.

    Example:
        >>> logp = log_probs(h, w, y, ignore_index=-100, temperature=0.7)  # doctest: +SKIP
    """
    from logitless.ops import _quack_epilogues

    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], ROWS_PER_LAUNCH):
        rows = slice(start, start + ROWS_PER_LAUNCH)
        stats = _quack_epilogues.label_log_prob_stats(hidden[rows], weight, labels[rows], 1.0 / float(temperature))
        # a row whose label is out of range (ignored) has no label logit written: discard it
        out[rows] = torch.where(labels[rows] != ignore_index, stats["target_logit"] - stats["lse"], 0.0)
    return out

