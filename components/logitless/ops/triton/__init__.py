"""Fused LM head: cuBLAS GEMMs over bounded row chunks with Triton epilogues.

This package's public names; the code lives in its modules:

* :mod:`~logitless.ops.triton.functional` -- :func:`linear_cross_entropy`, :func:`linear_log_probs`
  (argument checks, then the registered ops);
* :mod:`~logitless.ops.triton.token_objective` -- :func:`linear_token_objective`;
* :mod:`~logitless.ops.triton.ops` -- the ``torch.library`` custom ops and their autograd;
* :mod:`~logitless.ops.triton.head` -- the host side (tiling, workspaces, GEMM + epilogue schedule);
* :mod:`~logitless.ops.triton.kernels` -- the Triton epilogue kernels;
* :mod:`~logitless.ops.triton.gemm_epilogues` -- Triton GEMMs with those epilogues inside (opt-in,
  ``LOGITLESS_HEAD_GEMM=triton``);

Example:
    >>> import torch
    >>> from logitless.ops import triton as T
    >>> h = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(151936, 896, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> y = torch.randint(0, 151936, (64,), device="cuda")
    >>> T.linear_cross_entropy(h, w, y, ignore_index=-100, reduction="mean", temperature=1.0).backward()
"""

from logitless.ops.triton import functional
from logitless.ops.triton.functional import linear_cross_entropy, linear_log_probs
from logitless.ops.triton.head import chunk_rows
from logitless.ops.triton.token_objective import linear_token_objective

# what ops/dispatch.py calls (an internal package: nothing here is public API)
__all__ = ["functional", "linear_cross_entropy", "linear_log_probs", "linear_token_objective", "chunk_rows"]
