"""Fixtures of the end-to-end recipe tests."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def tune_cli():
    """Starts ``tune run ...`` in a subprocess from the repo root and returns its ``Popen``.

    recipes/ and components/ go on the path, so the recipes run even without ``pip install -e .``.

    Example:
        >>> p = tune_cli(["run", "grpo_single_device", "--config", "configs/tiny_grpo.yaml"], tmp_path)
        >>> log = p.communicate(timeout=300)[0]
    """
    def launch(args, out, env=None):
        path = os.pathsep.join([str(REPO / "recipes"), str(REPO / "components"), os.environ.get("PYTHONPATH", "")])
        return subprocess.Popen([sys.executable, "-m", "torchtune._cli.tune", *args, f"output_dir={out}"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": path, **(env or {})})

    return launch
