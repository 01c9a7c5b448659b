"""Set-up shared by the whole test session.

Without CUDA the Triton kernels run in Triton's CPU interpreter, and triton chooses interpreted or
compiled kernels when it is first imported. torchtune and torchao import it, so the choice has to be
made here, before any test module is collected; the kernel tests then run in-process in CI.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


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
