"""How a recipe run ends on Ctrl-C: one line naming the last checkpoint, exit status 130.

SIGINT stops a run at once: Python raises ``KeyboardInterrupt`` wherever the main thread is (between
two kernels on a GPU, inside a save, ...), and :func:`exit_on_interrupt` turns it into one line on
stderr instead of a traceback::

    Interrupted after step 37; last checkpoint: outputs/run/step_000030 (resume with resume_from_checkpoint=auto)

Nothing a resume needs is lost. Saves are atomic (:mod:`logitless.training.checkpoint`): a save cut
short leaves its ``.tmp-step_*`` staging folder, which the run removes when it resumes, and the
previous checkpoints intact; ``resume_from_checkpoint=auto`` continues from the newest checkpoint
that verifies exactly as an uninterrupted run would have. Steps after that checkpoint are computed
again.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from logitless.settings import settings
from logitless.training.checkpoint import complete_checkpoints
from logitless.training.progress import close_progress_bars

#: Exit status of a run stopped by Ctrl-C: 128 + SIGINT, what a shell reports for it.
INTERRUPTED_EXIT_CODE = 130


def interrupted_message(output_dir: Union[str, os.PathLike], steps_done: Optional[int]) -> str:
    """The line printed when a run is interrupted.

    Args:
        output_dir: the run's output folder.
        steps_done (Optional[int]): optimizer steps completed (None: interrupted before training).

    Returns:
        str: where the run stopped, its newest complete checkpoint and how to resume.

    Example:
        >>> interrupted_message("/tmp/r", 37)
        'Interrupted after step 37; last checkpoint: /tmp/r/step_000030 (resume with resume_from_checkpoint=auto)'
    """
    when = "before training started" if steps_done is None else f"after step {steps_done}"
    saved = complete_checkpoints(output_dir)
    if saved:
        return f"Interrupted {when}; last checkpoint: {saved[-1]} (resume with resume_from_checkpoint=auto)"
    return (f"Interrupted {when}; no checkpoint saved in {Path(output_dir)} "
            f"(resume_from_checkpoint=auto starts the run again from step 0)")


@contextlib.contextmanager
def exit_on_interrupt(output_dir: Union[str, os.PathLike], steps_done: Callable[[], Optional[int]]) -> Iterator[None]:
    """Ends the process on Ctrl-C with :func:`interrupted_message` on stderr and exit status 130.

    Under ``torchrun`` every rank stops; rank 0 prints the line. ``LOGITLESS_DEBUG=1`` keeps the
    ``KeyboardInterrupt`` traceback.

    Args:
        output_dir: the run's output folder (its newest complete checkpoint is named).
        steps_done (Callable[[], Optional[int]]): optimizer steps completed when interrupted, read then
            (None before training starts).

    Raises:
        SystemExit: with :data:`INTERRUPTED_EXIT_CODE`, on ``KeyboardInterrupt``.

    Example:
        >>> recipe = SFTRecipe(cfg)
        >>> with exit_on_interrupt(cfg.output_dir, lambda: getattr(recipe, "step", None)):
        ...     recipe.run()
    """
    try:
        yield
    except KeyboardInterrupt:
        if settings.debug:
            raise
        close_progress_bars()  # the line starts below the bar, not on it
        if os.environ.get("RANK", "0") == "0":
            print(interrupted_message(output_dir, steps_done()), file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None


__all__ = ["INTERRUPTED_EXIT_CODE", "exit_on_interrupt", "interrupted_message"]
