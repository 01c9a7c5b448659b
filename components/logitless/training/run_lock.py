"""One writer per output folder: an exclusive OS lock on ``output_dir`` for the life of a run.

A run takes the lock first thing in set-up, before any dataset, model or checkpoint is built, and
keeps it until it ends. The lock is ``fcntl.flock`` on ``output_dir/.logitless.lock``: the kernel
drops it when the process exits in any way (an exception, SIGTERM, ``kill -9``, a crash), so a
stopped run never leaves a stale lock behind. Under ``torchrun`` rank 0 holds it for the job and
the other ranks learn the outcome through the runtime's broadcast.

A second process that finds the folder locked, whatever its ``resume_from_checkpoint``, stops at
once with a :class:`OutputDirInUseError` naming the holder (host, pid, start time, command line),
which the lock file records. A run that ends normally removes the lock file (and ``output_dir``
itself when the run wrote nothing else there). On a file system without file locks (some network
and FUSE mounts) the run warns and goes on unlocked.

Example:
    >>> lock = OutputDirLock("outputs/run")
    >>> lock.acquire()            # raises OutputDirInUseError when another process holds it
    >>> ...                       # set up, train, save
    >>> lock.release()
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

from torchtune.utils import get_logger

from logitless.training.config import ConfigError

log = get_logger()

#: The lock file inside ``output_dir``: it is not run output (a new run ignores it when it checks
#: that the folder is empty).
LOCK_FILE = ".logitless.lock"
# A holder writes its details right after it takes the lock: a reader that comes in between waits
# this long for them before naming an unknown holder.
_HOLDER_WAIT_S = 2.0
# flock on a file system that has no locks (some network and FUSE mounts)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


class OutputDirInUseError(ConfigError):
    """``output_dir`` is locked by another running process (a ConfigError: one line, exit status 2)."""


def holder_info() -> Dict[str, Any]:
    """What the lock file records about this process: host, pid, start time (UTC) and command line."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(getattr(sys, "orig_argv", sys.argv))}


def _describe(holder: Optional[Dict[str, Any]]) -> str:
    if not holder:
        return "a process that has not recorded itself yet"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}, "
            f"command: {holder.get('command')}")


class OutputDirLock:
    """An exclusive, non-blocking OS lock on one output folder (see the module docstring).

    Args:
        output_dir: the run's output folder (created by :meth:`acquire` when missing).

    Example:
        >>> lock = OutputDirLock(cfg.output_dir)
        >>> lock.acquire(runtime)     # rank 0 locks; every rank raises if it could not
        >>> lock.release()
    """

    def __init__(self, output_dir: Union[str, os.PathLike]):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._fd: Optional[int] = None
        self._created_dir = False

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def _try_lock(self) -> Optional[OutputDirInUseError]:
        """Locks (rank 0's part of :meth:`acquire`); returns the error instead of raising it."""
        self._created_dir = not self.output_dir.exists()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in _NO_LOCKS:  # the run goes on; refusing to train here would help nobody
                    self.path.unlink(missing_ok=True)
                    log.warning(f"output_dir {str(self.output_dir)!r} is on a file system without file locks "
                                f"({os.strerror(e.errno)}): nothing stops another run from writing there meanwhile")
                    return None
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                return OutputDirInUseError(
                    f"config key 'output_dir': {str(self.output_dir)!r} is in use by another run: "
                    f"{_describe(self._read_holder())}. One run writes into one output_dir at a time; wait for "
                    f"that run to end (resume_from_checkpoint=auto then continues it), or choose another output_dir.")
            # The file we locked may have been removed by a holder that released it in between: then
            # the lock guards nothing and a fresh file is locked instead.
            try:
                on_disk = os.stat(self.path)
            except FileNotFoundError:
                on_disk = None
            mine = os.fstat(fd)
            if on_disk is not None and (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino):
                break
            os.close(fd)
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder_info()) + "\n").encode(), 0)
        return None

    def _read_holder(self) -> Optional[Dict[str, Any]]:
        deadline = time.monotonic() + _HOLDER_WAIT_S
        while True:
            try:
                holder = json.loads(self.path.read_text())
                if isinstance(holder, dict):
                    return holder
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def acquire(self, runtime: Any = None) -> "OutputDirLock":
        """Takes the lock, or raises naming the process that holds it.

        Args:
            runtime: the :class:`~logitless.training.distributed.Runtime`; with several ranks, rank 0
                locks and broadcasts the outcome (None: this process locks).

        Returns:
            OutputDirLock: self.

        Raises:
            OutputDirInUseError: another process holds the lock (on every rank).
        """
        error = None
        if runtime is None or runtime.is_rank_zero:
            error = self._try_lock()
        if runtime is not None:
            error = runtime.broadcast_object(error)
        if error is not None:
            raise error
        return self

    def release(self) -> None:
        """Removes the lock file and drops the lock (idempotent; a no-op when not held).

        ``output_dir`` is removed too when this lock created it and nothing else was written there.
        """
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.path.unlink(missing_ok=True)  # while still locked: nobody else can be using it
        finally:
            os.close(fd)
        if self._created_dir:
            try:
                self.output_dir.rmdir()
            except OSError:
                pass  # the run wrote something: the folder stays

    def __enter__(self) -> "OutputDirLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


__all__ = ["LOCK_FILE", "OutputDirInUseError", "OutputDirLock", "holder_info"]
