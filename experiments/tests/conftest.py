"""The experiments' tests (not run by CI: ``python -m pytest experiments/tests``).

The scripts are not a package: their folder and benchmarks/ (whose helpers they use) go on
``sys.path``, and ``load_experiment`` loads a script by name. The fixtures of tests/conftest.py
(the Triton interpreter switch, its GPU-like rounding, ``compile_for_sm90``) are loaded from there.
"""

import importlib.util
import pathlib
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = EXPERIMENTS.parent
sys.path[:0] = [str(EXPERIMENTS), str(ROOT / "benchmarks")]


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = _load("_logitless_tests_conftest", ROOT / "tests" / "conftest.py")  # sets TRITON_INTERPRET off CUDA
compile_for_sm90 = _shared.compile_for_sm90
interpreter_rounds_to_nearest_even = _shared.interpreter_rounds_to_nearest_even


@pytest.fixture(scope="session", autouse=True)
def _interpreter_rounds_to_nearest_even(interpreter_rounds_to_nearest_even):
    yield


@pytest.fixture(scope="session")
def load_experiment():
    """``load_experiment("bench_decode_linear")`` -> the module ``experiments/bench_decode_linear.py``."""
    return lambda name: _load(name, EXPERIMENTS / f"{name}.py")
