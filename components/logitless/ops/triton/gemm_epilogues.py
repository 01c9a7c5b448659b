"""The head's GEMMs in Triton with their epilogues inside: logits never reach memory as logits.

Three persistent kernels (grid = programs per SM x SMs, output tiles assigned round-robin in
grouped order so that concurrent tiles share W panels in L2), operands read through tensor
descriptors (TMA on sm_90, plain loads elsewhere), fp32 accumulation:

* :func:`logits_stats_kernel` -- ``z = h_b @ W.T / T`` tile by tile; its epilogue writes, per
  (row, V tile), the fp32 partial max ``m``, ``s = sum exp(z - m)`` and ``t = sum exp(z - m)(z - m)``
  over the valid columns, and the label's logit when the label is in the tile.
  :func:`merge_tiles_kernel` folds the partials into the running per-row state that
  ``kernels.finalize_state_kernel`` turns into LSE, entropy and log-prob. No logits workspace.
* :func:`logits_dlogits_kernel` -- the same GEMM over a (row block x V slab) whose epilogue writes
  ``d objective / d logits`` (the formula of ``kernels.dlogits_kernel``) in the inputs' dtype: the
  logits make no round trip through memory before becoming dlogits.
* :func:`dw_accumulate_kernel` -- ``dW[slab] (+)= dl.T @ h_b``, its fp32 accumulator starting from
  the existing ``dW`` tile: one rounding to dW's dtype per call, as ``addmm_`` does.

Opt-in (``LOGITLESS_HEAD_GEMM``, see :func:`enabled`): :mod:`logitless.ops.triton.head` calls them
where the inputs qualify (:func:`supported`), the cuBLAS + epilogue path everywhere else.

Block sizes (:data:`BLOCKS`) are per dtype, not measured yet; ``benchmarks/bench_head.py
--hgemm-blocks`` sweeps them.
"""

import os
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from logitless.ops.triton import kernels
from logitless.settings import settings

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, warp_specialize) per kernel kind and
#: input dtype; ``warp_specialize`` (0/1) asks Triton to split the tile loop into producer (TMA
#: loads) and consumer (MMA + epilogue) warps where the compiler supports it.
#: 16-bit inputs: the fastest of ``bench_head.py --hgemm-sweep qwen7b`` on an H200 (each kind swept
#: with the others fixed; experiments/results/head_gemm_sweep_h200.csv): statistics GEMM 1.21 GEMMs
#: (1.60 with 128 x 128 tiles), dlogits 4.64 GEMMs for log-probs + entropy (5.07), dW 5.32 for CE
#: (5.66). fp32 (tf32-free ``ieee`` dots): unmeasured, 64 x 128 tiles. Small tiles in the CPU
#: interpreter, so that odd test shapes cross several tiles (and H = 16 pads the K loop).
_SWEPT_16BIT = {"stats": (128, 256, 64, 8, 8, 3, 1), "dlogits": (256, 128, 64, 8, 8, 3, 0),
                "dw": (64, 256, 64, 8, 4, 4, 0)}
BLOCKS: Dict[Tuple[str, torch.dtype], Tuple[int, int, int, int, int, int, int]] = {
    (kind, dtype): (64, 128, 32, 8, 8, 3, 0) if dtype == torch.float32 else _SWEPT_16BIT[kind]
    for kind in ("stats", "dlogits", "dw") for dtype in (torch.bfloat16, torch.float16, torch.float32)
}
_INTERPRETER_BLOCKS = (32, 32, 32, 2, 4, 1, 0)
#: Persistent programs in the interpreter: fewer than tiles, so the round-robin loop is exercised.
_INTERPRETER_PROGRAMS = 3
#: Bytes of the statistics GEMM's per-launch buffers (partials, gathered rows): see :func:`stats_rows`.
STATS_WORKSPACE_BYTES = 16 << 20
#: Rows folded per program of :func:`merge_tiles_kernel`, V tiles per step.
_MERGE_ROWS, _MERGE_TILES = 64, 32


def blocks(kind: str, dtype: torch.dtype) -> Tuple[int, int, int, int, int, int, int]:
    """Tile shape and launch parameters of one kernel kind for one input dtype.

    Args:
        kind (str): ``"stats"``, ``"dlogits"`` (the two logits GEMMs) or ``"dw"``.
        dtype (torch.dtype): the inputs' dtype.

    Returns:
        Tuple[int, ...]: ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, warp_specialize)``.

    Example:
        >>> blocks("stats", torch.bfloat16)  # on a GPU
        (128, 256, 64, 8, 8, 3, 1)
    """
    return _INTERPRETER_BLOCKS if _INTERPRET else BLOCKS[(kind, dtype)]


def enabled() -> bool:
    """Whether ``LOGITLESS_HEAD_GEMM`` asks for these kernels.

    ``"cublas"``: never. ``"triton"``: always (where :func:`supported`). ``"auto"``: only where a
    committed H200 measurement says they win; at the 7B head they lost in every mode, even at their
    swept blocks (experiments/results/head_gemm_h200.csv), so ``"auto"`` is ``"cublas"``.

    Returns:
        bool: use the Triton GEMMs (subject to :func:`supported`).
    """
    return settings.head_gemm == "triton"


def supported(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the tensor descriptors can read ``hidden (N, H)`` and ``weight (V, H)``.

    TMA needs 16-byte aligned bases and row strides and unit inner strides: ``H * itemsize`` a
    multiple of 16 (H a multiple of 8 in bf16/fp16, of 4 in fp32). Otherwise the caller keeps the
    cuBLAS path.

    Args:
        hidden (torch.Tensor): ``(N, H)``. weight (torch.Tensor): ``(V, H)``.

    Returns:
        bool: the Triton GEMMs can run on these inputs.
    """
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != hidden.dtype:
        return False
    if hidden.device.type != "cuda" and not _INTERPRET:
        return False
    return _descriptor_ok(hidden) and _descriptor_ok(weight)


def _descriptor_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor a tensor descriptor can address: unit inner stride, 16-byte aligned base and rows."""
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _check_descriptors(fn: str, **tensors: torch.Tensor) -> None:
    # TMA reads a misaligned row stride as garbage rather than failing: refuse before the launch.
    for name, t in tensors.items():
        if not _descriptor_ok(t):
            raise ValueError(f"{fn}: {name} of shape {tuple(t.shape)}, strides {t.stride()}, dtype {t.dtype} "
                             f"cannot be read by a tensor descriptor: expected a 2-D tensor with unit inner "
                             f"stride and a 16-byte aligned base and row stride (see aligned_cols)")


def use(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """:func:`enabled` and :func:`supported`: the per-call choice of the host code."""
    return enabled() and supported(hidden, weight)


def aligned_cols(cols: int, itemsize: int) -> int:
    """Row stride (elements) of a ``(rows, cols)`` buffer that a tensor descriptor can read."""
    per = 16 // itemsize
    return -(-cols // per) * per


def _scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    # torch's caching allocator (graph-capture safe), on the current device
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch_setup(device: torch.device) -> None:
    # Device-side tensor descriptors on sm_90 need a little global scratch per program, which
    # Triton takes from its allocator: a context variable, so per thread (autograd runs CUDA
    # backwards on its own threads). Set torch's where none is set; a user's own stays.
    if device.type != "cuda":
        return
    try:
        from triton.runtime import _allocation

        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):
        unset = True
    if unset:
        triton.set_allocator(_scratch)


def _programs(tiles: int, device: torch.device) -> int:
    if _INTERPRET or device.type != "cuda":
        return max(1, min(tiles, _INTERPRETER_PROGRAMS))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, sms * settings.head_gemm_programs_per_sm))


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full fp32 products, as plain PyTorch's matmul (tf32 would lose accuracy).
    # "upcast": the CPU interpreter multiplies bf16 operands as their raw 16-bit integers, so there
    # they are converted to fp32 first (their products are exact in fp32 either way).
    if dtype == torch.bfloat16 and _INTERPRET:
        return "upcast"
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` in fp32 (see ``_precision``)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tile_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: ``GROUP_M`` row tiles walk the column tiles together (W panels shared in L2)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _logits_tile(h_desc, w_desc, off_m, off_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``h[off_m:+BLOCK_M] @ W[off_n:+BLOCK_N].T``; rows/columns past the ends read as 0."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = h_desc.load([off_m, k])
        b = w_desc.load([off_n, k])
        acc = _dot(a, b.T, acc, PRECISION)
    return acc


@triton.jit
def logits_stats_kernel(
    h_ptr, w_ptr, part_ptr, zy_ptr, labels_ptr, idx_ptr, row0, M, V, K, stride_h, stride_w, plane,
    inv_t, ignore_index,
    HAS_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Persistent over the ``(M / BLOCK_M) x (V / BLOCK_N)`` tiles of ``z = h_b @ W.T * inv_t``.

    ``part`` is fp32 ``(3, cdiv(V, BLOCK_N), M)`` (planes m, s, t of ``plane`` elements; coalesced
    for the merge);
    ``zy[row]`` gets the label's ``z`` from the tile holding it. Row ``r`` of ``h_b`` is the
    (compacted) row ``row0 + r``; its label is ``labels[idx[row0 + r]]`` (``HAS_IDX``) or
    ``labels[row0 + r]``.
    """
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, K], strides=[stride_h, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, K], strides=[stride_w, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _logits_tile(h_desc, w_desc, off_m, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        col_ok = (cols < V)[None, :]
        z = tl.where(col_ok, acc * inv_t, float("-inf"))
        m = tl.max(z, 1)
        ref = tl.where(m == float("-inf"), 0.0, m)
        e = tl.exp(z - ref[:, None])
        s = tl.sum(e, 1)
        t = tl.sum(tl.where(col_ok, e * (z - ref[:, None]), 0.0), 1)
        row_ok = rows < M
        out = part_ptr + pid_n.to(tl.int64) * M + rows
        tl.store(out, m, mask=row_ok)
        tl.store(out + plane, s, mask=row_ok)
        tl.store(out + 2 * plane, t, mask=row_ok)
        srow = row0 + rows.to(tl.int64)
        if HAS_IDX:
            orow = tl.load(idx_ptr + srow, mask=row_ok, other=0).to(tl.int64)
        else:
            orow = srow
        label = tl.load(labels_ptr + orow, mask=row_ok, other=ignore_index)
        inside = row_ok & (label != ignore_index) & (label >= off_n) & (label < off_n + BLOCK_N)
        z_y = tl.sum(tl.where(cols[None, :] == label[:, None], z, 0.0), 1)
        tl.store(zy_ptr + srow, z_y, mask=inside)


@triton.jit
def merge_tiles_kernel(part_ptr, state_ptr, row0, M, num_tiles, plane,
                       BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid ``(cdiv(M, BLOCK_R),)``: folds the V tiles' partials of rows ``[0, M)`` into
    ``state[row0 + r] = (m, s, t)`` over the whole vocabulary (``finalize_state_kernel``'s input).

    ``plane = num_tiles * M`` elements between the m, s and t planes (computed on the host: an
    argument equal to 1 is a compile-time constant, on which ``.to`` does not exist)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    t = tl.zeros([BLOCK_R], tl.float32)
    for j0 in range(0, num_tiles, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        mask = (j < num_tiles)[:, None] & row_ok[None, :]
        addr = part_ptr + j.to(tl.int64)[:, None] * M + rows[None, :]
        m_b = tl.load(addr, mask=mask, other=float("-inf"))
        s_b = tl.load(addr + plane, mask=mask, other=0.0)
        t_b = tl.load(addr + 2 * plane, mask=mask, other=0.0)
        m_c = tl.max(m_b, 0)
        ref = tl.where(m_c == float("-inf"), 0.0, m_c)
        w = tl.exp(m_b - ref[None, :])
        shift = tl.where(s_b > 0, (m_b - ref[None, :]) * s_b, 0.0)
        m, s, t = kernels._merge(m, s, t, m_c, tl.sum(w * s_b, 0), tl.sum(w * (t_b + shift), 0))
    st = state_ptr + (row0 + rows.to(tl.int64)) * 3
    tl.store(st, m, mask=row_ok)
    tl.store(st + 1, s, mask=row_ok)
    tl.store(st + 2, t, mask=row_ok)


@triton.jit
def logits_dlogits_kernel(
    h_ptr, w_ptr, dl_ptr, stride_h, stride_w, stride_dl, labels_ptr, idx_ptr, row0, lse_ptr,
    ent_ptr, glp_ptr, gent_ptr, coef_ptr, M, VLEN, col0, K, inv_t, ignore_index,
    MODE_CE: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, HAS_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Persistent over the tiles of ``h_b @ W[col0:col0 + VLEN].T``; writes their dlogits to ``dl``.

    ``w_ptr`` points at row ``col0`` of W. Per row: as ``kernels.dlogits_kernel`` (``MODE_CE``:
    ``coef * sum(-logp)``, else ``sum(g_logp * logp + g_ent * entropy)``), from the fp32 tile.
    """
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, K], strides=[stride_h, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[VLEN, K], strides=[stride_w, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(VLEN, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _logits_tile(h_desc, w_desc, off_m, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        srow = row0 + rows.to(tl.int64)
        if HAS_IDX:
            orow = tl.load(idx_ptr + srow, mask=row_ok, other=0).to(tl.int64)
        else:
            orow = srow
        label = tl.load(labels_ptr + orow, mask=row_ok, other=ignore_index)
        valid = row_ok & (label != ignore_index)
        lse = tl.load(lse_ptr + orow, mask=row_ok, other=0.0)
        c_lp, c_ent, ent = kernels._row_coefficients(orow, valid, coef_ptr, glp_ptr, gent_ptr,
                                                     ent_ptr, inv_t, MODE_CE, HAS_GLP, HAS_GENT)
        logp = ((acc * inv_t).to(tl.float64) - lse[:, None]).to(tl.float32)
        hit = (cols + col0)[None, :] == label[:, None]
        g = kernels._grad_logits(logp, hit, c_lp[:, None], c_ent[:, None], ent[:, None],
                                 valid[:, None], HAS_GENT)
        out = dl_ptr + rows.to(tl.int64)[:, None] * stride_dl + cols[None, :]
        tl.store(out, g.to(dl_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < VLEN)[None, :])


@triton.jit
def dw_accumulate_kernel(
    dl_ptr, h_ptr, dw_ptr, stride_dl, stride_h, stride_dw, VLEN, HID, ROWS,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Persistent over the ``(VLEN / BLOCK_M) x (HID / BLOCK_N)`` tiles of ``dW[slab] (+)= dl.T @ h``.

    ``dl`` is ``(ROWS, VLEN)``, ``h`` ``(ROWS, HID)``, ``dw`` the slab ``(VLEN, HID)``. With
    ``ACCUMULATE`` the fp32 accumulator starts from the slab's current values; one rounding per tile.
    """
    dl_desc = tl.make_tensor_descriptor(dl_ptr, shape=[ROWS, VLEN], strides=[stride_dl, 1],
                                        block_shape=[BLOCK_K, BLOCK_M])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[ROWS, HID], strides=[stride_h, 1],
                                       block_shape=[BLOCK_K, BLOCK_N])
    dw_desc = tl.make_tensor_descriptor(dw_ptr, shape=[VLEN, HID], strides=[stride_dw, 1],
                                        block_shape=[BLOCK_M, BLOCK_N])
    num_m = tl.cdiv(VLEN, BLOCK_M)
    num_n = tl.cdiv(HID, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if ACCUMULATE:
            acc = dw_desc.load([off_m, off_n]).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, ROWS, BLOCK_K):
            a = dl_desc.load([k, off_m])
            b = h_desc.load([k, off_n])
            acc = _dot(a.T, b, acc, PRECISION)
        dw_desc.store([off_m, off_n], acc.to(dw_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------- host side
def stats_rows(vocab: int, hid: int, dtype: torch.dtype, gathered: bool, budget: int) -> int:
    """Rows per launch of :func:`logits_stats`: its partials (and gathered rows) fit ``budget`` bytes.

    The launch size hardly changes the weight's traffic (it is re-read once per ``GROUP_M`` row
    tiles within a launch anyway), so launches are kept small (:data:`STATS_WORKSPACE_BYTES`):
    the forward's extra memory is then these buffers, not logits tiles.

    Args:
        vocab (int): V. hid (int): H. dtype (torch.dtype): inputs' dtype.
        gathered (bool): the launch's hidden rows are a gathered copy (compacted rows).
        budget (int): bytes for the partials and the gathered rows.

    Returns:
        int: a multiple of ``BLOCK_M`` (at least one tile of rows).

    Example:
        >>> stats_rows(152064, 3584, torch.bfloat16, True, 16 << 20)  # GPU: 1188 tiles x 12 B + 7 KiB a row
        768
    """
    block_m, block_n = blocks("stats", dtype)[:2]
    per_row = 12 * -(-vocab // block_n) + (hid * dtype.itemsize if gathered else 0)
    return max(block_m, budget // per_row // block_m * block_m)


def logits_stats(h_b: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 idx: Optional[torch.Tensor], row0: int, state: torch.Tensor, z_y: torch.Tensor,
                 inv_t: float, ignore_index: int) -> None:
    """Softmax state of rows ``[row0, row0 + len(h_b))`` over the whole vocabulary, one GEMM.

    Args:
        h_b (torch.Tensor): ``(rows, H)`` hidden rows (gathered when compacted).
        weight (torch.Tensor): ``(V, H)``.
        labels (torch.Tensor): ``(N,)`` int64. idx (Optional[torch.Tensor]): compacted row indices.
        row0 (int): index of ``h_b``'s first row among the (compacted) rows.
        state (torch.Tensor): fp32 ``(rows_total, 3)``: ``(m, s, t)`` written at ``row0 + r``.
        z_y (torch.Tensor): fp32 ``(rows_total,)``: the label's ``z`` written at ``row0 + r``.
        inv_t (float): 1 / temperature. ignore_index (int): ignored label.
    """
    _check_descriptors("logits_stats", h_b=h_b, weight=weight)
    rows, hid = h_b.shape
    vocab = weight.shape[0]
    bm, bn, bk, group, warps, stages, ws = blocks("stats", h_b.dtype)
    num_n = -(-vocab // bn)
    part = h_b.new_empty((3, num_n, rows), dtype=torch.float32)
    tiles = -(-rows // bm) * num_n
    progs = _programs(tiles, h_b.device)
    _launch_setup(h_b.device)
    logits_stats_kernel[(progs,)](
        h_b, weight, part, z_y, labels, idx if idx is not None else labels, row0, rows, vocab, hid,
        h_b.stride(0), weight.stride(0), num_n * rows, inv_t, ignore_index,
        HAS_IDX=idx is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        NUM_PROGRAMS=progs, PRECISION=_precision(h_b.dtype), WARP_SPECIALIZE=bool(ws), num_warps=warps,
        num_stages=stages,
    )
    merge_tiles_kernel[(-(-rows // _MERGE_ROWS),)](
        part, state, row0, rows, num_n, num_n * rows, BLOCK_R=_MERGE_ROWS, BLOCK_T=_MERGE_TILES, num_warps=4,
    )


def logits_dlogits(h_b: torch.Tensor, w_slab: torch.Tensor, dl: torch.Tensor, labels: torch.Tensor,
                   idx_b: Optional[torch.Tensor], row0: int, col0: int, lse: torch.Tensor,
                   ent: Optional[torch.Tensor], glp: Optional[torch.Tensor],
                   gent: Optional[torch.Tensor], coef: Optional[torch.Tensor], inv_t: float,
                   ignore_index: int) -> None:
    """``dl = d objective / d (h_b @ w_slab.T)``, the logits recomputed in the GEMM, never stored.

    Args:
        h_b (torch.Tensor): ``(rows, H)``. w_slab (torch.Tensor): ``W[col0:col0 + S]``, ``(S, H)``.
        dl (torch.Tensor): ``(rows, S)`` output (row stride free), inputs' dtype.
        labels (torch.Tensor): ``(N,)``. idx_b (Optional[torch.Tensor]): original rows of ``h_b``
            (compacted), else ``h_b``'s row ``r`` is row ``row0 + r``.
        row0 (int): see ``idx_b``. col0 (int): first vocabulary entry of the slab.
        lse (torch.Tensor): float64 ``(N,)``. ent, glp, gent (Optional[torch.Tensor]): fp32 ``(N,)``
            entropy and upstreams (``kernels.dlogits_kernel``). coef (Optional[torch.Tensor]):
            cross-entropy's device scalar (CE mode) or None.
        inv_t (float), ignore_index (int): as in the forward.
    """
    _check_descriptors("logits_dlogits", h_b=h_b, w_slab=w_slab)
    rows, hid = h_b.shape
    vlen = w_slab.shape[0]
    bm, bn, bk, group, warps, stages, ws = blocks("dlogits", h_b.dtype)
    tiles = -(-rows // bm) * -(-vlen // bn)
    progs = _programs(tiles, h_b.device)
    _launch_setup(h_b.device)
    dummy = lse
    logits_dlogits_kernel[(progs,)](
        h_b, w_slab, dl, h_b.stride(0), w_slab.stride(0), dl.stride(0), labels,
        idx_b if idx_b is not None else labels, row0 if idx_b is None else 0, lse,
        ent if ent is not None else dummy, glp if glp is not None else dummy,
        gent if gent is not None else dummy, coef if coef is not None else dummy,
        rows, vlen, col0, hid, inv_t, ignore_index,
        MODE_CE=coef is not None, HAS_GLP=glp is not None, HAS_GENT=gent is not None,
        HAS_IDX=idx_b is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        NUM_PROGRAMS=progs, PRECISION=_precision(h_b.dtype), WARP_SPECIALIZE=bool(ws), num_warps=warps,
        num_stages=stages,
    )


def dw_accumulate(dw_slab: torch.Tensor, dl: torch.Tensor, h_b: torch.Tensor, accumulate: bool) -> None:
    """``dw_slab (+)= dl.T @ h_b`` with fp32 accumulation and one rounding to ``dw_slab``'s dtype.

    Args:
        dw_slab (torch.Tensor): ``(S, H)`` rows of dW (16-byte aligned, unit inner stride).
        dl (torch.Tensor): ``(rows, S)``, row stride a multiple of 16 bytes (:func:`aligned_cols`).
        h_b (torch.Tensor): ``(rows, H)``.
        accumulate (bool): add to ``dw_slab`` (else overwrite it).
    """
    _check_descriptors("dw_accumulate", dw_slab=dw_slab, dl=dl, h_b=h_b)
    vlen, hid = dw_slab.shape
    rows = h_b.shape[0]
    bm, bn, bk, group, warps, stages, ws = blocks("dw", h_b.dtype)
    tiles = -(-vlen // bm) * -(-hid // bn)
    progs = _programs(tiles, h_b.device)
    _launch_setup(h_b.device)
    dw_accumulate_kernel[(progs,)](
        dl, h_b, dw_slab, dl.stride(0), h_b.stride(0), dw_slab.stride(0), vlen, hid, rows,
        ACCUMULATE=accumulate, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        NUM_PROGRAMS=progs, PRECISION=_precision(h_b.dtype), WARP_SPECIALIZE=bool(ws), num_warps=warps,
        num_stages=stages,
    )
