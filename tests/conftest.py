"""Set-up shared by the whole test session.

Without CUDA the Triton kernels run in Triton's CPU interpreter, and triton chooses interpreted or
compiled kernels when it is first imported. torchtune and torchao import it, so the choice has to be
made here, before any test module is collected; the kernel tests then run in-process in CI.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
