"""The module under a ``torch.compile`` wrapper: where code needs the model's own attributes."""

from torch import nn


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module under a ``torch.compile`` wrapper (``OptimizedModule``), or ``model`` itself.

    Args:
        model (nn.Module): a model, compiled with ``torch.compile(model)`` or not.

    Returns:
        nn.Module: the original module, whose attributes (``caches_are_setup``, ``max_seq_len``,
        output mode) the wrapper does not forward reliably.

    Example:
        >>> unwrap_compiled(torch.compile(model)) is model
        True
    """
    return getattr(model, "_orig_mod", model)
