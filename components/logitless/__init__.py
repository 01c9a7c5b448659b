"""logitless: LM-head losses that never hold the full logits, and the torchtune recipes that use them.

``import logitless`` is cheap: it registers the ``${logitless_asset:...}`` config resolver and
imports torch only when a loss, an op or a subpackage is first used, so the ``logitless`` command
(``logitless ls``, ``logitless --help``) answers at once.

Example:
    >>> import torch, logitless
    >>> hidden = torch.randn(4, 128, 64, requires_grad=True)
    >>> weight = torch.randn(32000, 64, requires_grad=True)
    >>> labels = torch.randint(0, 32000, (4, 128))
    >>> logitless.linear_cross_entropy(hidden, weight, labels).backward()
"""

import importlib
import importlib.util

# First, before anything imports torchao (through torchtune): drop its import-time cpp-extension notice.
from logitless._quiet_torchao import quiet_torchao_cpp_extension_notice

quiet_torchao_cpp_extension_notice()

from logitless.resources import register_resolvers  # noqa: E402

register_resolvers()  # ${logitless_asset:...} in configs, before any config is resolved

__version__ = "0.2.0"
__all__ = ["linear_cross_entropy", "linear_log_probs", "__version__"]

# The functional API lives in logitless.ops, which imports torch and Triton: loaded on first use.
_FROM_OPS = ("linear_cross_entropy", "linear_log_probs")


def __getattr__(name: str) -> object:
    if name in _FROM_OPS:
        value = getattr(importlib.import_module("logitless.ops"), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # logitless.ops, logitless.losses, ...
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_FROM_OPS))
