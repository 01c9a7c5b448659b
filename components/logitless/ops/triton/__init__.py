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
* :mod:`~logitless.ops.triton.decode_attention` -- :func:`decode_attention`, split-K attention of one
  new token per row over a static KV cache (the compiled sampler's decode step), its kernels and
  its ``torch.library`` op (the package attribute of that name is the function; import the module
  with ``importlib.import_module`` to reach its other names);
* :mod:`~logitless.ops.triton.counter_sampling` -- ``counter_draw``, the compiled sampler's
  counter-based draw of the next token and its log-prob in two launches (op ``logitless::counter_draw``);
* :mod:`~logitless.ops.triton.decode_linear` -- ``decode_linear``, a decode step's linear layer (or
  gated MLP activation) for a few rows, split over columns and the reduction (op
  ``logitless::decode_linear``; the compiled sampler's opt-in ``decode_linear="triton"``);
* :mod:`~logitless.ops.triton.decode_rotary` -- ``decode_rotary_cache``, a decode step's rotary
  embedding of q and k and its KV-cache write in one launch, reading the rotary module's own table
  (op ``logitless::decode_rotary_cache``; the compiled sampler's split-K step with a shared prompt),
  and ``rotation_coefficients``, the per-row cos and sin with which ``decode_attention``'s
  ``NewToken`` does both inside the attention's launch (its per-row step).

Example:
    >>> import torch
    >>> from logitless.ops import triton as T
    >>> h = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(151936, 896, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> y = torch.randint(0, 151936, (64,), device="cuda")
    >>> T.linear_cross_entropy(h, w, y, ignore_index=-100, reduction="mean", temperature=1.0).backward()
"""

from logitless.ops.triton.decode_attention import decode_attention, decode_attention_reference
from logitless.ops.triton.functional import linear_cross_entropy, linear_log_probs
from logitless.ops.triton.head import chunk_rows
from logitless.ops.triton.token_objective import linear_token_objective

__all__ = ["linear_cross_entropy", "linear_log_probs", "linear_token_objective", "chunk_rows", "decode_attention",
           "decode_attention_reference"]
