"""Where a training step's GPU time goes: kernel time per category, and the idle rest.

Used by ``bench_grpo.py --profile-update`` to explain the update's model FLOPs utilisation: a step
is run under ``torch.profiler`` and every CUDA kernel is put in one category by its name:

- ``gemm``: cuBLAS / CUTLASS matrix multiplies (the FLOPs the MFU counts run here)
- ``attention``: flash / memory-efficient / cuDNN / FlexAttention kernels
- ``head``: logitless's Triton head kernels (statistics, dlogits, token objective)
- ``fused``: other Triton kernels (inductor's fused elementwise / reductions under ``torch.compile``,
  the compiled sampler's draw and its decode step's rotary + cache write)
- ``elementwise``: PyTorch's eager elementwise and reduction kernels (norms, rotary, activations,
  residual adds, casts: memory-bound work that ``torch.compile`` would fuse)
- ``optimizer``: the optimizer's multi-tensor kernels and gradient-norm reductions
- ``copy``: memcpy / memset / index and concatenation copies
- ``other``: everything else

``idle`` is the measured wall time minus the union of kernel intervals (launch gaps, host syncs).

Example:
    >>> category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1")
    'gemm'
    >>> category("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>")
    'elementwise'
"""

from typing import Dict, Iterable, List, Tuple

import torch

CATEGORIES = ("gemm", "attention", "head", "fused", "elementwise", "optimizer", "copy", "other")

# Checked in this order: the first category whose patterns match the lower-cased kernel name wins.
_PATTERNS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("optimizer", ("multi_tensor_apply", "fused_adam", "fusedadam", "adamw", "_foreach", "lpnorm",
                   "norm_two_reduce")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa",
                   "triton_tem_fused_flex", "flex_attention", "decode_partial_kernel", "decode_merge_kernel",
                   "decode_prefix_kernel")),
    ("gemm", ("gemm", "xmma", "cutlass", "sm90_", "sm80_", "ampere_", "hopper_", "cublas", "matmul",
              "nvjet", "splitkreduce")),
    ("copy", ("memcpy", "memset", "copy_kernel", "index_kernel", "index_elementwise", "catarray", "cat_array",
              "gather", "scatter", "index_put", "indexing_backward")),
    ("head", ("row_stats_kernel", "merge_slab_kernel", "finalize_state_kernel", "finalize_kernel",
              "dlogits_kernel", "col_stats_kernel", "dlogits_t_kernel", "scale_kernel", "token_objective",
              "logitless")),
    ("fused", ("triton_", "counter_draw_kernel", "counter_pick_kernel", "decode_rotary_cache_kernel")),
    ("elementwise", ("elementwise", "reduce_kernel", "norm", "softmax", "unrolled", "vectorized",
                     "silu", "rotary", "activation")),
)


def category(name: str) -> str:
    """The category of a CUDA kernel named ``name`` (one of :data:`CATEGORIES`).

    Args:
        name (str): the kernel name as ``torch.profiler`` reports it.

    Returns:
        str: its category.

    Example:
        >>> category("triton_red_fused__to_copy_mean_pow_rsqrt_0")
        'fused'
    """
    low = name.lower()
    for cat, patterns in _PATTERNS:
        if any(p in low for p in patterns):
            return cat
    return "other"


def busy_time(intervals: Iterable[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (kernels of several streams may overlap).

    Example:
        >>> busy_time([(0, 2), (1, 3), (5, 6)])
        4
    """
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def breakdown(kernels: List[Tuple[str, float, float]], wall_us: float, top: int = 6) -> Dict[str, object]:
    """Kernel time per category and the idle rest of ``wall_us``.

    Args:
        kernels (List[Tuple[str, float, float]]): ``(name, start_us, end_us)`` of every CUDA kernel.
        wall_us (float): the measured wall time the kernels ran in.
        top (int): how many of the longest kernels (by total time) to list.

    Returns:
        Dict[str, object]: ``{category: microseconds}`` for every category, ``"idle"`` (microseconds),
        ``"busy"`` (microseconds of the union of kernel intervals), ``"launches"`` (``{category:
        kernel count}``) and ``"top"`` (``[(name, us), ...]``).

    Example:
        >>> out = breakdown([("gemm_a", 0.0, 6.0), ("vectorized_elementwise_kernel", 6.0, 8.0)], wall_us=10.0)
        >>> out["gemm"], out["elementwise"], out["idle"], out["launches"]["gemm"]
        (6.0, 2.0, 2.0, 1)
    """
    per_cat = {c: 0.0 for c in CATEGORIES}
    launches = {c: 0 for c in CATEGORIES}
    per_kernel: Dict[str, float] = {}
    for name, start, end in kernels:
        cat = category(name)
        per_cat[cat] += end - start
        launches[cat] += 1
        per_kernel[name] = per_kernel.get(name, 0.0) + end - start
    busy = busy_time((s, e) for _, s, e in kernels)
    return {**per_cat, "busy": busy, "idle": max(0.0, wall_us - busy), "launches": launches,
            "top": sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]}


def profile_kernels(fn, device: torch.device) -> Tuple[List[Tuple[str, float, float]], float]:
    """Runs ``fn()`` once under ``torch.profiler``; returns its CUDA kernels and its wall time (us).

    Args:
        fn: the work to profile (synchronised before and after).
        device (torch.device): a CUDA device.

    Returns:
        Tuple: ``([(name, start_us, end_us), ...], wall_us)``.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return kernels, start.elapsed_time(end) * 1e3
