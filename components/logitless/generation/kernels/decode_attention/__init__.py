"""Split-K (flash-decoding) attention of one new query token per row over a static KV cache.

The compiled sampler's decode step attends one new token per row to a cache of fixed length ``L``
of which only the first ``n_filled`` columns hold keys. SDPA's decode kernels stream a row's whole
window in one program, so their time follows the window, not the rows or the filled length. Here
the cache is cut into splits of ``split_len`` columns, on a grid that depends on the shapes only
(without a given split length, per-row attention cuts its grid for :data:`FILL_MIN_SPLIT` columns and
its programs choose the split from ``n_filled`` at each launch, :func:`fill_split_len`):

* ``decode_partial_kernel``, grid ``(B, Hkv, num_splits)``: one program per (row, K/V head,
  split) reads its split's keys and values once for all ``G`` query heads that share the K/V head
  (torchtune's order: query head ``h`` reads K/V head ``h // G``), up to ``n_filled`` only, and
  keeps an fp32 online softmax: the running max ``m``, the sum ``l`` of ``exp(s - m)`` and the
  weighted sum ``acc`` of the values, written to an fp32 workspace. A split that starts at or
  beyond ``n_filled`` exits at once (split 0 excepted): it loads and writes nothing, and the merge
  never waits for it nor reads it. A split whose keys are
  all masked (left padding) writes the empty partial ``m = -inf``, ``l = 0``, ``acc = 0``.
* the merge: the last partial program of a (row, K/V head) to finish (an arrival count per pair,
  :func:`reserve_arrivals`) merges that row's partials itself; without reserved counters
  ``decode_merge_kernel``, grid ``(B, Hkv)``, does, with the same sums. It merges the splits below
  ``cdiv(n_filled, split_len)``
  (the non-empty ones) of the ``G`` query heads into ``acc / l`` in the query's dtype; a row with
  no valid key at all gets 0, as SDPA gives for a fully masked row.

With a :class:`SharedPrefix` (a group's G rows holding the same prompt columns ``[0, width)``),
``decode_prefix_kernel``, grid ``(segments, Hkv, prefix splits)``, reads those columns once per
segment of consecutive rows, all of the segment's query heads as one operand of the products, into
prefix slots of the workspace; the partial kernel then starts each row at column ``width``, and the
merge folds both (op ``logitless::decode_attention_shared_prefix``).

With a :class:`NewToken` (the step's key and value before the rotary embedding, and each row's
rotation), the partial kernel also does what a kernel before it would: it rotates the query as it
loads it, and the program holding column ``n_filled - 1`` rotates the new key, writes it and the
value into the caches there and folds that column in from registers (op
``logitless::decode_attention_new_token``).

``n_filled`` is a ``(1,)`` device tensor read by the kernels, so nothing on the host depends on it:
no sync, and one CUDA graph serves every step. The op ``logitless::decode_attention`` is an opaque
``torch.library`` custom op (a ``triton_op`` would let inductor see the kernels, but its traceable
wrapper does not take the interpreter's kernels, so CPU tests could not compile it):
``torch.compile`` captures it in the decode step without a graph break, and inductor hands it the
cache buffers themselves (no copy). Off CUDA it runs :func:`decode_attention_reference` (plain
PyTorch) unless the Triton interpreter is requested (``TRITON_INTERPRET=1``, how the tests run the
kernels on CPU tensors).

The launch parameters were chosen for an H200 at Qwen2.5 shapes (head_dim 64 and 128, caches up to
a few thousand columns): the split length's floor (``MIN_SPLIT``) from a sweep at 8-64 rows, the
block, stages and programs per SM from a sweep at 16 and 64 rows, the warps a guess. On Hopper the
kernels are programmatic dependent launches (:func:`supports_programmatic_launch`): the partial
kernel is scheduled while the kernel before it (the query's rotary embedding) finishes, the merge
while the partials finish; after a shared prefix's kernel, the partial kernel streams its rows'
columns while the prefix programs stream theirs, and waits for them only before its merge.

The code: :mod:`.plan` (launch planning: split lengths, blocks, programmatic launches, the segments
of a shared prompt), :mod:`.kernels` (the Triton kernels), :mod:`.op` (the ``torch.library`` ops,
their launch and checks, :func:`decode_attention`), :mod:`.reference` (plain PyTorch, and the
:class:`SharedPrefix` and :class:`NewToken` inputs).

Example:
    >>> q = torch.randn(8, 14, 64, device="cuda", dtype=torch.bfloat16)          # (B, Hq, D)
    >>> k = torch.randn(64, 2, 1536, 64, device="cuda", dtype=torch.bfloat16)    # a bigger cache
    >>> v = torch.randn_like(k)
    >>> valid = torch.ones(64, 1536, dtype=torch.bool, device="cuda")
    >>> n = torch.tensor([1100], device="cuda")
    >>> out = decode_attention(q, k[:8], v[:8], valid[:8], n)                      # (8, 14, 64)
"""

from logitless.generation.kernels.decode_attention.op import decode_attention, reserve_arrivals
from logitless.generation.kernels.decode_attention.plan import (Launch, default_split_len, fill_split_len,
                                                                group_segments, launch_split_len, prefix_rows,
                                                                prefix_split_len_for, resolve_launch,
                                                                shared_prefix_segments, supports_programmatic_launch)
from logitless.generation.kernels.decode_attention.reference import (NewToken, SharedPrefix,
                                                                     decode_attention_reference,
                                                                     write_new_token_reference)

__all__ = ["Launch", "NewToken", "SharedPrefix", "decode_attention", "decode_attention_reference",
           "default_split_len", "fill_split_len", "group_segments", "launch_split_len", "prefix_rows",
           "prefix_split_len_for", "reserve_arrivals", "resolve_launch", "shared_prefix_segments",
           "supports_programmatic_launch", "write_new_token_reference"]
