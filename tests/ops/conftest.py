"""The head's kernels: Triton's CPU interpreter rounds fp32 -> bf16 like the GPU here
(``interpreter_rounds_to_nearest_even`` in tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _interpreter_rounds_to_nearest_even(interpreter_rounds_to_nearest_even):
    yield
