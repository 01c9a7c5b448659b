"""How many CPU threads torch uses in a recipe process (config key ``cpu_threads``).

torch's default is one intra-op thread per core for every process. OpenMP waits for all of them at
the end of each parallel op, so a thread that shares its core with anything else (another rank,
the data loader, another user's job) stalls every op: on a 2-core machine with one busy core, tiny
SFT took 3 min 36 s with torch's default against 17 s with one thread. ``auto`` leaves a core free:

- math on the CPU: ``cores // local processes - 1`` threads (at least 1), where ``cores`` is what
  ``os.sched_getaffinity`` allows this process (containers and ``taskset`` included);
- math on a GPU: ``cores // local processes`` (the CPU only feeds the GPU);
- ``OMP_NUM_THREADS`` set in the environment (by the user, or by torchrun for several processes) is
  kept as it is.

An integer sets that many threads; null leaves torch's default.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from logitless.first_start import recipe_logger
from logitless.training.config import ConfigError, Key

CPU_THREADS_KEY = Key((int, str, None), default="auto",
                      doc="torch CPU threads per process: 'auto', an integer >= 1, or null for torch's default")


def check_cpu_threads(value: Any) -> None:
    """Raises :class:`ConfigError` unless ``value`` is ``"auto"``, an integer >= 1 or None.

    Args:
        value (Any): the config value of ``cpu_threads``.

    Raises:
        ConfigError: naming the key, the value and what is accepted.

    Example:
        >>> check_cpu_threads("auto")
    """
    ok = value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    if not ok:
        raise ConfigError(f"config key 'cpu_threads': expected 'auto', an integer >= 1 or null, got {value!r}")


def resolve_cpu_threads(value: Any, *, cpu_math: bool, cores: int, local_world_size: int,
                        env_threads: Optional[int]) -> Optional[int]:
    """The thread count ``cpu_threads=value`` asks for (the rule is in this module's docstring).

    Args:
        value (Any): ``"auto"``, an integer >= 1 or None.
        cpu_math (bool): the model runs on the CPU.
        cores (int): cores this process may run on.
        local_world_size (int): recipe processes on this machine.
        env_threads (Optional[int]): ``OMP_NUM_THREADS`` when set.

    Returns:
        Optional[int]: threads to set, or None to keep torch's current setting.

    Example:
        >>> resolve_cpu_threads("auto", cpu_math=True, cores=2, local_world_size=1, env_threads=None)
        1
    """
    check_cpu_threads(value)
    if value is None:
        return None
    if value != "auto":
        return int(value)
    if env_threads is not None:
        return None
    per_process = max(1, cores // max(1, local_world_size))
    return max(1, per_process - 1) if cpu_math else per_process


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def apply_cpu_threads(value: Any, device: str) -> int:
    """Sets torch's intra-op thread count for ``cpu_threads=value``; call it before any torch work.

    Args:
        value (Any): the config value (``"auto"``, an integer >= 1 or None).
        device (str): the config's ``device`` (``"auto"`` means CUDA when available).

    Returns:
        int: ``torch.get_num_threads()`` afterwards.

    Example:
        >>> apply_cpu_threads("auto", "cpu")   # 2 cores, one process
        1
    """
    cpu_math = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = resolve_cpu_threads(value, cpu_math=cpu_math, cores=cores,
                            local_world_size=_env_int("LOCAL_WORLD_SIZE") or 1,
                            env_threads=_env_int("OMP_NUM_THREADS"))
    if n is not None:
        torch.set_num_threads(n)
    n = torch.get_num_threads()
    if (_env_int("RANK") or 0) == 0:
        recipe_logger().info("cpu_threads=%s: torch uses %d CPU threads per process", value, n)
    return n


__all__ = ["CPU_THREADS_KEY", "apply_cpu_threads", "check_cpu_threads", "resolve_cpu_threads"]
