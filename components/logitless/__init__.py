"""logitless: LM-head losses that never hold the full logits, and the torchtune recipes that use them.

Example:
    >>> import torch, logitless
    >>> hidden = torch.randn(4, 128, 64, requires_grad=True)
    >>> weight = torch.randn(32000, 64, requires_grad=True)
    >>> labels = torch.randint(0, 32000, (4, 128))
    >>> logitless.linear_cross_entropy(hidden, weight, labels).backward()
"""

# First, before anything imports torchao (through torchtune): drop its import-time cpp-extension notice.
from logitless._quiet_torchao import quiet_torchao_cpp_extension_notice

quiet_torchao_cpp_extension_notice()

from logitless.resources import register_resolvers  # noqa: E402

register_resolvers()  # ${logitless_asset:...} in configs, before any config is resolved

from logitless.ops import linear_cross_entropy, linear_log_probs  # noqa: E402

__version__ = "0.2.0"
__all__ = ["linear_cross_entropy", "linear_log_probs", "__version__"]
