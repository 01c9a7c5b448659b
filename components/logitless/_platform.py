"""Where the Triton kernels run: the CPU interpreter switch and the GPU's streaming multiprocessors.

Shared by the head's kernels (:mod:`logitless.ops`) and the decode kernels
(:mod:`logitless.generation.kernels`), which import nothing else from each other.
"""

import os

import torch

#: Streaming multiprocessors assumed off CUDA (an H200's), so that launch planning on the CPU
#: (tests under the interpreter) cuts the grids a GPU of that size would get.
DEFAULT_SM_COUNT = 132


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``, how CI runs them).

    Example:
        >>> triton_interpreting() in (True, False)
        True
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; :data:`DEFAULT_SM_COUNT` elsewhere.

    Example:
        >>> sm_count(torch.device("cpu"))
        132
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT
