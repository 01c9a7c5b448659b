"""Set-up shared by the whole test session.

Without CUDA the Triton kernels run in Triton's CPU interpreter, and triton chooses interpreted or
compiled kernels when it is first imported. torchtune and torchao import it, so the choice has to be
made here, before any test module is collected; the kernel tests then run in-process in CI.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

SLOW_LIST = pathlib.Path(__file__).with_name("slow_tests.txt")


def slow_test_ids() -> set:
    """The node ids listed in ``tests/slow_tests.txt`` (one per line, then its measured seconds)."""
    lines = SLOW_LIST.read_text().splitlines()
    return {line.split()[0] for line in lines if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    """Marks the tests of ``slow_tests.txt`` as ``slow``: the default run (``-m "not slow"`` in
    pyproject's addopts) keeps to the fast ones on a 2-core CI machine."""
    slow = slow_test_ids()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def listed_slow_ids() -> set:
    """:func:`slow_test_ids`, for the test that checks the list."""
    return slow_test_ids()


@pytest.fixture
def peft_usable():
    """Skips (naming why) where peft cannot build LoRA layers: peft >= 0.19 refuses them next to
    torchao < 0.16, which torchtune 0.6.1 needs; the dev extra pins peft < 0.19."""
    peft = pytest.importorskip("peft")
    from peft.import_utils import is_torchao_available

    try:
        is_torchao_available()
    except ImportError as e:
        pytest.skip(f"peft {peft.__version__} cannot run here: {e}")


def _round_like_the_gpu(monkeypatch):
    """Compiled Triton rounds fp32 -> bf16 to nearest even (``x.to(tl.bfloat16)``, the PTX ``cvt.rn``);
    the interpreter (triton 3.x, ``interpreter._convert_float``) truncates the mantissa instead. A
    truncated dlogits doubles the rounding error of dh and dW at bf16 and, being biased toward zero,
    leaves the row sum of dlogits away from 0, so the accuracy tests would measure the interpreter
    rather than the kernels. Under ``TRITON_INTERPRET=1`` that one conversion is replaced by torch's
    round-to-nearest-even."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    truncating = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return truncating(data, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


@pytest.fixture(scope="session")
def interpreter_rounds_to_nearest_even():
    """Triton's CPU interpreter rounds fp32 -> bf16 like the GPU for the rest of the session (see
    :func:`_round_like_the_gpu`); the kernel test folders turn it on for their tests."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        _round_like_the_gpu(mp)
        yield


@pytest.fixture
def compile_for_sm90():
    """``compile_for_sm90(script)`` runs ``script`` (Python that builds kernels with ``triton.compile``
    for ``GPUTarget("cuda", 90, 32)`` and prints "compiled") in a fresh process without the
    interpreter: Triton's own ptxas, no device needed, so a change that only a GPU compile rejects
    fails on the CPU too. Skips where Triton has no NVIDIA backend."""
    pytest.importorskip("triton.backends.nvidia.compiler")

    def run(script: str, timeout: int = 600) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]

    return run
