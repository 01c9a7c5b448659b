"""What a process compiles on its first start, said before it happens, and where the result is kept.

A run's first step can spend tens of seconds in ``torch.compile`` (the compiled sampler's decode step
and its CUDA graphs, the layers with ``compile: True``, the chunked head's softmax epilogues, the
GRPO objective's gradient, flex attention's block masks) with nothing else on screen.
:func:`note_compile` logs one line before each such compilation, once per process and thing.

Compiled code is kept across runs by torch's own caches (inductor's FX graph and autotuning caches
and Triton's kernel cache, all on by default): a second run of the same config on the same machine
loads it instead of compiling again. Inductor keeps them in ``$TORCHINDUCTOR_CACHE_DIR``, by default
a folder under ``/tmp``, which many machines empty at reboot; :func:`use_persistent_compile_cache`
(called by every recipe at start) points it at ``$XDG_CACHE_HOME/logitless/torchinductor``
(``~/.cache/logitless/torchinductor``) unless the variable is already set.

This module imports nothing from torch or the rest of the package: the ops call it too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

#: torch inductor's cache folder variable (its Triton kernels go under it too).
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

_NOTED: set = set()


def recipe_logger() -> logging.Logger:
    """The ``logitless`` logger, printing INFO lines as torchtune's ``get_logger("INFO")`` does for its own."""
    logger = logging.getLogger("logitless")
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
        logger.setLevel(logging.INFO)
    return logger


def default_compile_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/logitless/torchinductor``, or ``~/.cache/logitless/torchinductor``: one per user,
    kept across reboots.

    Example:
        >>> default_compile_cache_dir()
        PosixPath('/home/me/.cache/logitless/torchinductor')
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "logitless" / "torchinductor"


def use_persistent_compile_cache() -> Path:
    """Sets ``TORCHINDUCTOR_CACHE_DIR`` to :func:`default_compile_cache_dir` unless it is set already.

    Call it before the process's first ``torch.compile``: inductor reads the variable when it first
    needs its cache.

    Returns:
        Path: the compile cache folder in use.

    Example:
        >>> use_persistent_compile_cache()  # with TORCHINDUCTOR_CACHE_DIR unset
        PosixPath('/home/me/.cache/logitless/torchinductor')
    """
    if not os.environ.get(INDUCTOR_CACHE_ENV):
        os.environ[INDUCTOR_CACHE_ENV] = str(default_compile_cache_dir())
    return Path(os.environ[INDUCTOR_CACHE_ENV])


def note_compile(what: str) -> bool:
    """Logs, once per process for each ``what``, that ``what`` is compiled now and where it is kept.

    Args:
        what (str): what is compiled, e.g. ``"the sampler's decode step (CUDA graphs per batch size)"``.

    Returns:
        bool: True when the line was logged (the first call for ``what``).

    Example:
        >>> note_compile("each transformer layer (compile: True)")
        True
    """
    if what in _NOTED:
        return False
    _NOTED.add(what)
    cache = os.environ.get(INDUCTOR_CACHE_ENV) or "torch's default folder"
    recipe_logger().info(f"Compiling {what}: once per process, tens of seconds on a GPU unless the compile "
                         f"cache ({cache}) holds it from an earlier run")
    return True


__all__ = ["INDUCTOR_CACHE_ENV", "default_compile_cache_dir", "note_compile", "recipe_logger",
           "use_persistent_compile_cache"]
