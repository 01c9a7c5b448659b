"""How a recipe run ends on a bad config, bad data or a failed save: one line on stderr, no traceback.

A :class:`~logitless.training.config.ConfigError` (raised for a bad config value, a bad dataset
row, a device that does not exist, an output folder another run holds, ...) already says which key
holds what and what was expected; a 15-frame traceback above it only hides the message. So does a
:class:`~logitless.training.checkpoint.CheckpointSaveError` (a full disk during a save: it names the
checkpoint, the folder, the error and the space needed). The recipe entry points are wrapped with
:func:`report_errors`, which prints ``ConfigError: <message>`` to stderr and exits with status 2, or
``CheckpointSaveError: <message>`` with status 1. Set the environment variable ``LOGITLESS_DEBUG=1``
to get the full traceback instead. Every other exception propagates unchanged (a bug must keep its
traceback).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, TypeVar

from logitless.settings import KNOBS, settings
from logitless.training.checkpoint import CheckpointSaveError
from logitless.training.config import ConfigError

#: Environment variable that turns the one-line error back into the raised exception.
DEBUG_ENV = KNOBS["debug"].env
#: Exit status of a run stopped by a ConfigError (as argparse exits on a usage error).
CONFIG_ERROR_EXIT_CODE = 2
#: Exit status of a run stopped by a checkpoint save that failed (a full disk...).
SAVE_ERROR_EXIT_CODE = 1

F = TypeVar("F", bound=Callable[..., Any])


def debug_enabled() -> bool:
    """True when ``LOGITLESS_DEBUG`` is set to anything but empty, ``0``, ``false`` or ``no``."""
    return settings.debug


def report_errors(fn: F) -> F:
    """Wraps a recipe entry point: a ConfigError becomes one line on stderr and exit status 2, a
    CheckpointSaveError one line and exit status 1.

    Args:
        fn (Callable): the entry point.

    Returns:
        Callable: the wrapped entry point (same signature).

    Example:
        >>> @report_errors
        ... def recipe_main(cfg): SFTRecipe(cfg).run()
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ConfigError, CheckpointSaveError) as e:
            if debug_enabled():
                raise
            rank = os.environ.get("RANK")
            prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
            kind = "ConfigError" if isinstance(e, ConfigError) else "CheckpointSaveError"
            print(f"{prefix}{kind}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(CONFIG_ERROR_EXIT_CODE if isinstance(e, ConfigError) else SAVE_ERROR_EXIT_CODE) from None

    return wrapper  # type: ignore[return-value]


__all__ = ["CONFIG_ERROR_EXIT_CODE", "DEBUG_ENV", "SAVE_ERROR_EXIT_CODE", "debug_enabled", "report_errors"]
