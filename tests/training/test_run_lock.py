"""The output-folder lock (logitless.training.run_lock): exclusive between processes, names its holder,
gone when the holder is killed, and invisible to the checks that a folder is empty."""

import json
import os
import shlex
import signal
import socket
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from logitless.training import ConfigError
from logitless.training.distributed import Runtime
from logitless.training.resume import start_run
from logitless.training.run_lock import LOCK_FILE, OutputDirInUseError, OutputDirLock

def _hold(out):
    """The pid of a separate (forked) process that takes the lock on ``out`` and keeps it."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lock, report, wait to be killed
        try:
            lock = OutputDirLock(out).acquire()  # noqa: F841 (held while the child lives)
            os.write(ready_w, b"1")
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    return pid


def test_a_second_process_is_refused_naming_the_holder_and_kill_9_frees_the_folder(tmp_path):
    out = tmp_path / "out"
    holder = _hold(out)
    try:
        with pytest.raises(OutputDirInUseError) as e:
            OutputDirLock(out).acquire()
        msg = str(e.value)
        assert isinstance(e.value, ConfigError)
        assert msg.startswith(f"config key 'output_dir': '{out}' is in use by another run: pid {holder} on host "
                              f"{socket.gethostname()}, started 20"), msg
        assert f"command: {shlex.join(sys.orig_argv)}. " in msg and "another output_dir" in msg
        recorded = json.loads((out / LOCK_FILE).read_text())
        assert recorded["pid"] == holder and recorded["host"] == socket.gethostname()
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    # the kernel dropped the lock with the process: no stale lock, although its file is still there
    assert (out / LOCK_FILE).exists()
    lock = OutputDirLock(out).acquire()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(OutputDirInUseError, match=f"pid {os.getpid()} "):  # exclusive in one process too
        OutputDirLock(out).acquire()
    lock.release()
    assert not (out / LOCK_FILE).exists() and out.is_dir()  # the folder was not created by this lock: kept


def test_release_removes_what_the_lock_made_and_the_lock_file_is_not_run_output(tmp_path):
    out = tmp_path / "new"
    with OutputDirLock(out):
        assert (out / LOCK_FILE).is_file()
        cfg = OmegaConf.create({"output_dir": str(out), "resume_from_checkpoint": False, "resume_allow_changes": []})
        start = start_run(cfg, fixed_keys=(), runtime=Runtime(torch.device("cpu")))  # the folder counts as empty
        assert start.checkpoint is None
    assert sorted(p.name for p in out.iterdir()) == ["logitless_run.json"]
    with OutputDirLock(tmp_path / "unused"):
        pass
    assert not (tmp_path / "unused").exists()  # created for the lock alone: removed with it


def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl
    import logging

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING):
        lock = OutputDirLock(tmp_path).acquire()
    assert not lock.held and not (tmp_path / LOCK_FILE).exists()
    assert f"output_dir '{tmp_path}' is on a file system without file locks" in caplog.text
