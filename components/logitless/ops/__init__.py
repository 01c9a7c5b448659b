"""Differentiable LM-head primitives: ``reference`` (oracle), ``chunked`` (PyTorch), ``triton`` (fused)."""

# Public: __all__ (docs/CONTRACT.md). The other names are internal, imported here for the recipes and tests.
from logitless.ops.dispatch import (
    linear_cross_entropy,
    linear_log_probs,
    linear_token_objective,
    resolve_impl,
)
from logitless.ops.row_objective import RowObjective

__all__ = ["linear_cross_entropy", "linear_log_probs", "linear_token_objective", "RowObjective"]
