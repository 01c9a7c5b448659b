"""Progress bar (tqdm), per-step throughput / peak-memory meters, and when a step logs or saves."""

from __future__ import annotations

import resource
import sys
import time
from typing import Callable, Dict, Optional

import torch
from tqdm import tqdm


def peak_memory_gib(device: torch.device) -> Dict[str, float]:
    """Peak memory so far: CUDA allocated/reserved on a GPU, the process's max RSS on CPU.

    Args:
        device (torch.device): the training device.

    Returns:
        Dict[str, float]: ``{"peak_memory_alloc_gib", "peak_memory_reserved_gib"}`` on CUDA,
        ``{"peak_rss_gib"}`` on CPU.

    Example:
        >>> peak_memory_gib(torch.device("cpu"))["peak_rss_gib"] > 0
        True
    """
    if device.type == "cuda":
        return {"peak_memory_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_gib": rss / (2**30 if sys.platform == "darwin" else 2**20)}


def is_due(step: int, every_n_steps: Optional[int], *, last_step: Optional[int] = None) -> bool:
    """Whether step ``step`` (1-based) logs or saves: a multiple of ``every_n_steps`` or the last step.

    Args:
        step (int): the optimizer step just taken.
        every_n_steps (Optional[int]): the period (None: only ``last_step``).
        last_step (Optional[int]): the run's last step (None: no extra step).

    Returns:
        bool: due at this step.

    Example:
        >>> [s for s in range(1, 8) if is_due(s, 3, last_step=7)]
        [3, 6, 7]
    """
    return (every_n_steps is not None and step % every_n_steps == 0) or step == last_step


def busiest_rank_peak_memory_gib(device: torch.device, all_reduce: Callable[..., torch.Tensor]) -> Dict[str, float]:
    """:func:`peak_memory_gib` of the rank that peaked highest (every rank calls it).

    Args:
        device (torch.device): the training device.
        all_reduce (Callable): ``Runtime.all_reduce`` (``op="max"`` over the ranks).

    Returns:
        Dict[str, float]: the keys of :func:`peak_memory_gib`, each the maximum over the ranks.
    """
    mem = peak_memory_gib(device)
    peaks = all_reduce(torch.tensor(list(mem.values()), dtype=torch.float64), op="max")
    return dict(zip(mem, peaks.tolist()))


class StepTimer:
    """Tokens per second over the interval since the last :meth:`lap`.

    Example:
        >>> t = StepTimer(); ...; t.lap(tokens=4096)["tokens_per_second"]
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self.t0 = time.perf_counter()

    def lap(self, tokens: int) -> Dict[str, float]:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        dt, self.t0 = t - self.t0, t
        return {"step_time_s": dt, "tokens_per_second": tokens / dt if dt > 0 else 0.0}


class ProgressBar:
    """A tqdm bar over optimizer steps showing loss, tokens/s and peak memory (rank 0 only).

    Args:
        total (int): total optimizer steps of the run.
        initial (int): steps already done (resume).
        enabled (bool): False on non-zero ranks.

    Example:
        >>> bar = ProgressBar(total=100)
        >>> bar.update({"loss": 2.3, "tokens_per_second": 1e4, "peak_memory_alloc_gib": 3.1})
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.bar = tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True,
                        desc="train", file=sys.stdout)

    def update(self, metrics: Dict[str, float]) -> None:
        post = {"loss": f"{metrics.get('loss', float('nan')):.4f}",
                "tok/s": f"{metrics.get('tokens_per_second', 0):.0f}"}
        for k in ("peak_memory_alloc_gib", "peak_rss_gib"):
            if k in metrics:
                post["peak_GiB"] = f"{metrics[k]:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def close_progress_bars() -> None:
    """Closes every open tqdm bar (each ends its line), so that what is printed next starts on a line
    of its own: a run that stops early (Ctrl-C) never reaches :meth:`ProgressBar.close`."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
