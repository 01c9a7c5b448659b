"""How the decode attention's kernels are launched: the split of the cache into programs, the
block, warps and stages, whether launches are programmatic, and the segments of rows that share a
prompt. Plain Python (no Triton): the sampler and the benchmarks plan with it too.
"""

import math
from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from logitless._platform import sm_count, triton_interpreting

__all__ = ["BLOCK_N", "FILL_MIN_SPLIT", "Launch", "MAX_PREFIX_QUERIES", "MAX_SPLIT", "MIN_SPLIT", "NUM_STAGES",
           "NUM_WARPS", "default_split_len", "fill_split_len", "group_segments", "launch_split_len", "prefix_rows",
           "prefix_split_len_for", "resolve_launch", "shared_prefix_segments", "supports_programmatic_launch"]

#: The partial kernel's default launch: columns per inner-loop block, warps per program and
#: software-pipeline stages. Best geometric mean over Qwen2.5-0.5B/1.5B/7B heads, 16 and 64 rows,
#: 1088 and 3584 filled columns on an H200 among block 32/64/128 x 2/3 stages
#: (``experiments/results/decode_attention_launch_h200.csv``): 0.86x the former 64 x 3 at head_dim 64,
#: 0.95x at 128.
BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 4, 2
#: Bounds of the automatic split length (columns). At 8-16 rows on an H200, splits shorter than 256
#: were at most 3% faster and up to 2.1x slower (64 columns;
#: ``experiments/results/decode_attention_split_len_h200.csv``): the merge walks a row's splits one
#: after another in only ``B x Hkv`` programs.
MIN_SPLIT, MAX_SPLIT = 256, 512
#: Programs per SM the fixed split rule (:func:`default_split_len`, a length set at capture) aims at
#: for a full cache: one (longer splits at many rows) measured best for per-row attention in the same
#: sweep as the launch (2 and 4: 1.02x and 1.04x its time). Per-row attention now chooses its split
#: from the fill (:data:`FILL_MIN_SPLIT`); the rule serves a shared prompt's rows, with the constant below.
PROGRAMS_PER_SM = 1
#: The same with a shared prompt (:class:`SharedPrefix`): the rows' own splits then cover only the
#: columns after the prompt, a fraction of the cache, so the rule aims at more programs over the
#: whole of it. With splits that hold no column exiting at once, 64 rows of a 1536-column cache (a
#: 1024-column prompt in groups of 16) took 256-column splits at Qwen2.5-0.5B and 1.5B (0.79-1.00x
#: the time of 512) and kept 512 at 7B, whose 512 measured 0.96-1.00x 256's on an H200
#: (``experiments/results/decode_attention_early_exit_h200.csv``).
SHARED_PROGRAMS_PER_SM = 4
#: Per-row attention without a given split length chooses it on the device at every launch, from
#: ``n_filled`` (:func:`fill_split_len`): the shortest power of two from ``FILL_MIN_SPLIT`` up to
#: :data:`MAX_SPLIT` whose splits holding columns number at most ``FILL_PROGRAMS_PER_SM`` per SM over
#: the grid's (row, K/V head) pairs and at most ``FILL_MAX_ROW_SPLITS`` per pair (the merge walks a
#: pair's splits one after another). One captured grid then serves a rollout whose fill grows from the
#: prompt to the cache's end: short splits while few columns are filled, long ones near the end. On an
#: H200 (``experiments/results/decode_attention_fill_split_h200.csv``) the best fixed split over
#: Qwen2.5-0.5B/1.5B/7B was 128 columns at 64 rows and 384 of 640 filled (2 K/V heads), 512 at 7B's
#: 4 heads; at 8-16 rows of a 4096-column cache 128-256 at 1024 filled, 256 at 2048, and at 3584
#: 256 for 8 rows of 2 heads (14 splits a pair; 16 splits of 128 at 2048 cost 0.5-0.8 us more than 8 of
#: 256) and 512 otherwise: this rule picks each of them.
FILL_MIN_SPLIT, FILL_PROGRAMS_PER_SM, FILL_MAX_ROW_SPLITS = 128, 3, 14
#: Shared-prefix programs (:func:`decode_prefix_kernel`): rows x query heads of one program's query
#: operand at most (a longer segment is cut into several), its inner-loop block and warps (for an
#: operand above 64 x 128; 4 below). 128 queries keep the fp32 accumulator in registers at head_dim 128.
MAX_PREFIX_QUERIES, PREFIX_BLOCK_N, PREFIX_NUM_WARPS = 128, 64, 8
#: Bounds of the automatic prefix split length (columns): about one program per SM over a full cache.
MIN_PREFIX_SPLIT, MAX_PREFIX_SPLIT = 128, 1024


def prefix_rows(heads_per_kv: int, group_size: int) -> int:
    """Rows per segment for groups of ``group_size`` rows sharing a prefix: the whole group, cut so
    that one program's query operand holds at most :data:`MAX_PREFIX_QUERIES` rows x heads.

    Example:
        >>> prefix_rows(6, 16), prefix_rows(7, 64)
        (16, 18)
    """
    return max(1, min(group_size, MAX_PREFIX_QUERIES // heads_per_kv))


def shared_prefix_segments(segment_of_row: Tensor, num_segments: int) -> Tuple[Tensor, Tensor]:
    """``(seg_start, seg_rows)`` of rows labelled with their segment, on the device, without a sync.

    Args:
        segment_of_row (Tensor): ``(R,)`` int64, non-decreasing: row ``r`` belongs to segment
            ``segment_of_row[r]`` (rows of one segment are consecutive), in ``[0, num_segments)``.
        num_segments (int): S, the segment table's length (segments without rows get 0 rows).

    Returns:
        Tuple[Tensor, Tensor]: ``(S,)`` int32 first rows and row counts.

    Example:
        >>> shared_prefix_segments(torch.tensor([0, 0, 2, 2, 2]), 3)
        (tensor([0, 2, 2], dtype=torch.int32), tensor([2, 0, 3], dtype=torch.int32))
    """
    rows = torch.bincount(segment_of_row, minlength=num_segments)[:num_segments]
    return (rows.cumsum(0) - rows).to(torch.int32), rows.to(torch.int32)


def group_segments(rows: Tensor, group_size: int, rows_per_segment: int,
                   num_groups: int) -> Tuple[Tensor, Tensor]:
    """``(seg_start, seg_rows)`` of a batch whose row ``r`` is row ``rows[r]`` of ``num_groups``
    groups of ``group_size`` consecutive rows, each group cut into segments of ``rows_per_segment``
    (:func:`prefix_rows`); a segment without rows left (compacted away) gets 0 rows.

    Args:
        rows (Tensor): ``(R,)`` int64, ascending: the original row of each row of the batch.
        group_size (int): G. rows_per_segment (int): rows per segment at most. num_groups (int): P.

    Returns:
        Tuple[Tensor, Tensor]: ``(P * ceil(G / rows_per_segment),)`` int32 first rows and row counts.

    Example:
        >>> group_segments(torch.tensor([0, 2, 3, 4]), 4, 2, 2)
        (tensor([0, 1, 3, 4], dtype=torch.int32), tensor([1, 2, 1, 0], dtype=torch.int32))
    """
    per_group = -(-group_size // rows_per_segment)
    segment = rows // group_size * per_group + rows % group_size // rows_per_segment
    return shared_prefix_segments(segment, num_groups * per_group)


def default_split_len(rows: int, kv_heads: int, length: int, num_sms: int = 132,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """A split length fixed for the whole cache: about ``programs_per_sm`` programs per SM over a full
    cache, a power of two in ``[MIN_SPLIT, MAX_SPLIT]`` (per-row attention without a given split
    chooses from the fill instead, :func:`fill_split_len`).

    Many rows get long splits, so that fewer partials are written and merged. Few rows (a compacted
    bucket) stop at ``MIN_SPLIT``: shorter splits would spread their keys over more programs, but the
    merge, which walks each row's splits in order, then costs more than the spread gains.

    Args:
        rows (int): B.
        kv_heads (int): Hkv.
        length (int): the cache length L.
        num_sms (int): streaming multiprocessors of the GPU (an H200 has 132).
        programs_per_sm (int): :data:`PROGRAMS_PER_SM`, or :data:`SHARED_PROGRAMS_PER_SM` for the
            rows' own columns after a shared prompt.

    Returns:
        int: columns per split.

    Example:
        >>> default_split_len(64, 4, 4096), default_split_len(8, 2, 1536), default_split_len(64, 2, 1536, 132, 4)
        (512, 256, 256)
    """
    target = rows * kv_heads * length / (programs_per_sm * num_sms)
    split = 1 << max(0, int(math.floor(math.log2(max(target, 1.0)))))
    return max(MIN_SPLIT, min(MAX_SPLIT, split))


def fill_split_len(columns: int, pairs: int, num_sms: int = 132, min_split: int = FILL_MIN_SPLIT,
                   max_split: int = MAX_SPLIT) -> int:
    """The split length the per-row kernels choose on the device for ``columns`` filled columns
    (without a given split length): the shortest power of two from ``min_split`` up to
    ``max_split`` whose splits holding columns number at most :data:`FILL_PROGRAMS_PER_SM` per SM
    over ``pairs`` (row, K/V head) pairs and at most :data:`FILL_MAX_ROW_SPLITS` per pair, else
    ``max_split``. The kernels compute the same from ``n_filled`` (``_split_len``).

    Args:
        columns (int): filled columns (``n_filled``).
        pairs (int): rows x K/V heads of the launch.
        num_sms (int): streaming multiprocessors of the GPU (an H200 has 132).
        min_split (int): the shortest split (the launch's grid is cut for it).
        max_split (int): the longest, a power-of-two multiple of ``min_split``.

    Returns:
        int: columns per split.

    Example:
        >>> fill_split_len(384, 64 * 2), fill_split_len(640, 64 * 2), fill_split_len(384, 64 * 4)
        (128, 256, 512)
    """
    split, budget = min_split, FILL_PROGRAMS_PER_SM * num_sms
    while split < max_split:
        splits = -(-columns // split)
        if pairs * splits <= budget and splits <= FILL_MAX_ROW_SPLITS:
            break
        split *= 2
    return split


def launch_split_len(rows: int, kv_heads: int, length: int, block_n: int, device: torch.device,
                     programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """The fixed split length of the rows' own columns after a shared prompt when none is given
    (:func:`resolve_launch`): :func:`default_split_len` for ``device``'s SMs, at least one ``block_n`` block.

    Args:
        rows (int): B. kv_heads (int): Hkv. length (int): the cache length L.
        block_n (int): columns per inner-loop block.
        device (torch.device): where the kernel runs (its SM count; 132 off CUDA).
        programs_per_sm (int): as :func:`default_split_len`'s.

    Returns:
        int: columns per split.

    Example:
        >>> launch_split_len(8, 2, 1536, 64, torch.device("cpu"))
        256
    """
    return max(block_n, default_split_len(rows, kv_heads, length, sm_count(device), programs_per_sm))


def prefix_split_len_for(segments: int, kv_heads: int, length: int, device: torch.device) -> int:
    """The shared-prefix split length when none is given: about one program per SM over a full
    cache of ``length`` columns, a power of two in ``[MIN_PREFIX_SPLIT, MAX_PREFIX_SPLIT]``.

    Example:
        >>> prefix_split_len_for(4, 2, 1536, torch.device("cpu"))
        128
    """
    target = segments * kv_heads * length / sm_count(device)
    split = 1 << max(0, int(math.floor(math.log2(max(target, 1.0)))))
    return max(MIN_PREFIX_SPLIT, min(MAX_PREFIX_SPLIT, split))


class Launch(NamedTuple):
    """The partial kernel's launch (:func:`resolve_launch`).

    Fields: ``split_len`` (columns per split, the grid's cut), ``block_n``, ``num_warps``,
    ``num_stages`` and ``max_split_len``: ``split_len`` for a fixed split; larger when the kernels
    choose the split on the device from ``n_filled`` (:func:`fill_split_len`), from ``split_len`` up
    to it.
    """

    split_len: int
    block_n: int
    num_warps: int
    num_stages: int
    max_split_len: int

    @property
    def fill_steps(self) -> int:
        """Doublings of ``split_len`` the kernels may choose (0: a fixed split)."""
        return (self.max_split_len // self.split_len).bit_length() - 1


def resolve_launch(rows: int, kv_heads: int, length: int, device: torch.device, split_len: int = 0,
                   block_n: int = 0, num_warps: int = 0, num_stages: int = 0,
                   shared_prompt: bool = False) -> Launch:
    """The launch the kernels run with: the parameters given (non-zero), the defaults for the rest.

    The block defaults to :data:`BLOCK_N`, at most a given split; the warps and stages to
    :data:`NUM_WARPS` and :data:`NUM_STAGES`. Without a given split, the rows' own splits after a
    shared prompt take :func:`launch_split_len` (aiming at :data:`SHARED_PROGRAMS_PER_SM`), and
    per-row attention a split chosen on the device from ``n_filled`` between
    :data:`FILL_MIN_SPLIT` (at least one block) and :data:`MAX_SPLIT` (:func:`fill_split_len`).

    Args:
        rows (int): B. kv_heads (int): Hkv. length (int): the cache length L.
        device (torch.device): where the kernels run (its SM count).
        split_len, block_n, num_warps, num_stages (int): as given; 0 = the default.
        shared_prompt (bool): the rows' own splits after a :class:`SharedPrefix`.

    Returns:
        Launch: ``(split_len, block_n, num_warps, num_stages, max_split_len)``.

    Example:
        >>> resolve_launch(8, 2, 1536, torch.device("cpu"), split_len=64)
        Launch(split_len=64, block_n=64, num_warps=4, num_stages=2, max_split_len=64)
        >>> resolve_launch(64, 2, 640, torch.device("cpu"))
        Launch(split_len=128, block_n=128, num_warps=4, num_stages=2, max_split_len=512)
    """
    if split_len:
        block_n = block_n or min(BLOCK_N, split_len)
        longest = split_len
    else:
        block_n = block_n or BLOCK_N
        if shared_prompt:
            split_len = longest = launch_split_len(rows, kv_heads, length, block_n, device, SHARED_PROGRAMS_PER_SM)
        else:
            split_len = max(block_n, FILL_MIN_SPLIT)
            longest = max(split_len, MAX_SPLIT)
    return Launch(split_len, block_n, num_warps or NUM_WARPS, num_stages or NUM_STAGES, longest)


def supports_programmatic_launch(device: torch.device) -> bool:
    """Whether ``device`` can run kernels as programmatic dependent launches (a CUDA GPU of compute
    capability 9.0 or later, outside the interpreter): a kernel may then be scheduled while the one
    before it finishes, and waits for it (``gdc_wait``) before its first load.

    Example:
        >>> supports_programmatic_launch(torch.device("cpu"))
        False
    """
    return device.type == "cuda" and not triton_interpreting() and torch.cuda.get_device_capability(device)[0] >= 9
