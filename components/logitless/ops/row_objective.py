"""A token objective whose per-row constants are named: the form a CUDA graph can keep across calls.

``linear_token_objective`` takes any ``f(logp, ent, rows) -> scalar`` that gathers its own
constants as ``const[rows]``. Such a closure hides which tensors it reads, so the fused head's
CUDA graph of the per-chunk objective call (``logitless.ops.triton.token_objective``) can only be
replayed within the call that captured it: the next call's closure reads other tensors. A
:class:`RowObjective` names them instead: the head copies them into the graph's own buffers at the
start of each call and replays one graph, captured once, in every later call whose ``key`` (the
other values ``fn`` reads) is equal.
"""

from typing import Callable, Dict, Hashable, Mapping, Optional

import torch

RowFn = Callable[[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]], torch.Tensor]


class RowObjective:
    """``f(logp, ent, rows) = fn(logp, ent, {name: const[rows]})``: a token objective with named constants.

    Callable as any token objective, so every ``impl`` of ``linear_token_objective`` takes it; on
    CUDA the Triton head keeps its per-chunk graph across calls (see the module docstring).

    Args:
        fn (Callable): ``fn(logp, ent, constants) -> scalar tensor``: the summed objective of some
            rows from their fp32 log-probs and entropies (``ent`` None unless the call needs it) and
            ``constants``, the rows' values of each named constant. It must read no other tensor:
            a graph replayed in a later call reads the constants that call passes, and any other
            tensor as it was at the capture.
        constants (Mapping[str, Optional[torch.Tensor]]): per-row constants, each with one value
            per label (any shape of ``labels.numel()`` elements, taken flattened); None entries
            are left out (``fn`` sees no such key).
        key (Hashable): every other value ``fn``'s result depends on (clip range, coefficients,
            which constants exist). Calls with the same ``fn`` code and an equal key share a graph.

    Raises:
        ValueError: a constant that is not a tensor, or a key that cannot be hashed.

    Example:
        >>> adv = torch.randn(2, 16)
        >>> obj = RowObjective(lambda lp, ent, c: -(c["adv"] * lp).sum(), {"adv": adv}, key="pg")
        >>> loss, logp, _ = linear_token_objective(hidden, weight, labels, obj)
    """

    def __init__(self, fn: RowFn, constants: Mapping[str, Optional[torch.Tensor]], key: Hashable):
        if not callable(fn):
            raise ValueError(f"RowObjective: fn must be callable as fn(logp, ent, constants), got {type(fn).__name__}")
        for name, value in constants.items():
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(f"RowObjective: constant {name!r} must be a tensor or None, got {type(value).__name__}")
        try:
            hash(key)
        except TypeError as exc:
            raise ValueError(f"RowObjective: key must be hashable (a tuple of numbers, strings), got {key!r}") from exc
        self.fn, self.key = fn, key
        self.constants = {name: value.reshape(-1) for name, value in constants.items() if value is not None}

    @property
    def signature(self) -> tuple:
        """What a graph of this objective depends on besides the constants' values: the code of
        ``fn``, ``key``, and each constant's name and dtype."""
        code = getattr(getattr(self.fn, "__func__", self.fn), "__code__", self.fn)
        return code, self.key, tuple((name, value.dtype) for name, value in sorted(self.constants.items()))

    def check_rows(self, n_rows: int, device: torch.device) -> None:
        """Raises ValueError unless every constant has ``n_rows`` values on ``device``."""
        for name, value in self.constants.items():
            if value.numel() != n_rows:
                raise ValueError(
                    f"RowObjective: constant {name!r} has {value.numel()} values, expected one per label "
                    f"({n_rows})"
                )
            if value.device != device:
                raise ValueError(f"RowObjective: constant {name!r} is on {value.device}, the head on {device}")

    def __call__(self, logp: torch.Tensor, ent: Optional[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        return self.fn(logp, ent, {name: value[rows] for name, value in self.constants.items()})
