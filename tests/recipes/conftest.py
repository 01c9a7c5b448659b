"""Fixtures of the end-to-end recipe tests."""

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import weakref

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _default_sigint():
    """Runs in the child before exec: SIGINT as a terminal's process has it. An ignored SIGINT is
    inherited through exec, and an earlier test (or a library it loads) may leave this process
    ignoring it; the child would then never see the Ctrl-C the tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture
def tune_cli():
    """Starts ``tune run ...`` in a subprocess from the repo root and returns its ``Popen``.

    recipes/ and components/ go on the path, so the recipes run even without ``pip install -e .``.

    ``cwd`` runs it from another folder; ``env`` values of None remove that variable; ``log`` (a file
    path) takes its output instead of a pipe (a long run fills a pipe that nobody reads and blocks).

    Example:
        >>> p = tune_cli(["run", "grpo_single_device", "--config", "configs/tiny_grpo.yaml"], tmp_path)
        >>> log = p.communicate(timeout=300)[0]
    """
    def launch(args, out, env=None, cwd=REPO, log=None):
        path = os.pathsep.join([str(REPO / "recipes"), str(REPO / "components"), os.environ.get("PYTHONPATH", "")])
        # A free rendezvous port per launch (torchrun reads PET_MASTER_PORT): back-to-back
        # multi-process runs on the default 29500 can collide with a port still held by the last one.
        full_env = {**os.environ, "PYTHONPATH": path, "PET_MASTER_PORT": str(_free_port()), **(env or {})}
        stdout = subprocess.PIPE if log is None else open(log, "w")
        try:
            return subprocess.Popen([sys.executable, "-m", "torchtune._cli.tune", *args, f"output_dir={out}"],
                                    cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT, text=True,
                                    env={k: v for k, v in full_env.items() if v is not None},
                                    preexec_fn=_default_sigint)
        finally:
            if log is not None:
                stdout.close()  # the child has its own copy

    return launch


#: The line a recipe prints when Ctrl-C stops it (logitless.training.interrupt).
INTERRUPTED_LINE = re.compile(r"Interrupted after step (\d+); last checkpoint: (\S+) "
                              r"\(resume with resume_from_checkpoint=auto\)")


@pytest.fixture
def ctrl_c(tune_cli):
    """``ctrl_c(args, out, after_step)``: starts ``tune run ARGS`` like :func:`tune_cli`, sends it SIGINT
    (what Ctrl-C sends) once ``out`` holds the complete checkpoint of step ``after_step``, and returns
    ``(exit status, output, reports)``: ``reports`` holds ``(steps done, checkpoint path)`` of every
    output line ``Interrupted after step N; last checkpoint: PATH (resume with ...)``."""
    from logitless.training import complete_checkpoints
    from logitless.training.checkpoint import checkpoint_step

    def interrupt(args, out, after_step):
        p = tune_cli(args, out)
        deadline = time.time() + 300
        while p.poll() is None and time.time() < deadline:
            if any(checkpoint_step(d) >= after_step for d in complete_checkpoints(out)):
                break
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        log = p.communicate(timeout=300)[0]
        reports = [(int(m.group(1)), pathlib.Path(m.group(2))) for m in INTERRUPTED_LINE.finditer(log)]
        return p.returncode, log, reports

    return interrupt


@pytest.fixture
def one_rank_launch(monkeypatch):
    """The environment ``torchrun --nproc_per_node 1`` gives a rank, so a recipe with
    ``distributed=True`` runs in this process on a one-rank process group (left on return)."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def refs_at_cleanup(monkeypatch):
    """``refs_at_cleanup(recipe_class, *names)``: a list that, when a recipe of that class cleans up,
    fills with weak references to its ``names`` attributes (dead once the run is freed)."""
    def watch(recipe_class, *names):
        refs, cleanup = [], recipe_class.cleanup

        def watched(self):
            refs.extend(weakref.ref(getattr(self, name)) for name in names)
            cleanup(self)

        monkeypatch.setattr(recipe_class, "cleanup", watched)
        return refs

    return watch
