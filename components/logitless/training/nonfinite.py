"""Non-finite steps: skip them, count them, stop after too many in a row; never save NaN weights.

The policy of the training engine (``TrainStep``, for SFT and GRPO): after the backward of all
micro-batches, :meth:`NonFiniteGuard.step` computes the total gradient norm (always, with or
without clipping), and

- when the norm (or the step's loss) is NaN or inf: zeroes the gradients and steps neither the
  optimizer nor the LR scheduler -- the step is *skipped* and counted;
- otherwise: clips (when asked) and steps both.

After ``max_consecutive_skipped_steps`` skipped steps in a row it raises
:class:`NonFiniteStepsError`, naming the step: a run whose every step is NaN stops instead of
spinning. The norm is that of the optimizer's own parameters (under FSDP2 the sharded DTensors
that hold the gradients), reduced over every shard with ``full_tensor``, so every rank takes the
same decision.

:func:`check_finite_weights` refuses a checkpoint whose weights hold NaN or inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

import torch


class NonFiniteStepsError(FloatingPointError):
    """Too many optimizer steps in a row had a non-finite gradient norm or loss."""


class NonFiniteWeightsError(FloatingPointError):
    """Weights about to be saved hold NaN or inf."""


@dataclass
class StepDecision:
    """What :meth:`NonFiniteGuard.step` did.

    Attributes:
        grad_norm (float): total gradient norm before clipping (NaN or inf when skipped).
        skipped (bool): the optimizer and LR scheduler were not stepped, the gradients were zeroed.
    """

    grad_norm: float
    skipped: bool


def _parameters(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    # The optimizer's own parameters: under FSDP2 a no-grad forward leaves the root unit gathered,
    # and model.parameters() would then list its unsharded tensors, not the sharded ones that hold
    # the gradients.
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def total_grad_norm(parameters: Iterable[torch.Tensor]):
    """The 2-norm of all gradients, as a (possibly DTensor) tensor, without clipping.

    Args:
        parameters (Iterable[torch.Tensor]): parameters whose ``.grad`` count (None grads skipped).

    Returns:
        torch.Tensor: the norm; a DTensor when the gradients are (call ``full_tensor()``).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)


class NonFiniteGuard:
    """Skips optimizer steps with a non-finite gradient norm or loss; stops after too many in a row.

    Args:
        max_consecutive_skipped_steps (Optional[int]): raise :class:`NonFiniteStepsError` when this
            many steps in a row were skipped; None never stops. Default 3.

    Attributes:
        skipped_steps (int): skipped steps in the run (restored by :meth:`load_state_dict`).
        consecutive_skipped (int): skipped steps since the last one that stepped.

    Example:
        >>> guard = NonFiniteGuard(max_consecutive_skipped_steps=3)
        >>> loss.backward()
        >>> decision = guard.step(optimizer, lr_scheduler=sched, clip_grad_norm=1.0, step=12)
        >>> decision.grad_norm, decision.skipped, guard.skipped_steps
    """

    def __init__(self, max_consecutive_skipped_steps: Optional[int] = 3):
        if max_consecutive_skipped_steps is not None and (
                isinstance(max_consecutive_skipped_steps, bool) or not isinstance(max_consecutive_skipped_steps, int)
                or max_consecutive_skipped_steps < 1):
            raise ValueError(f"max_consecutive_skipped_steps must be a positive int or None, "
                             f"got {max_consecutive_skipped_steps!r}")
        self.max_consecutive_skipped_steps = max_consecutive_skipped_steps
        self.skipped_steps = 0
        self.consecutive_skipped = 0
        self._skipped_at: List[str] = []

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        lr_scheduler: Optional[Any] = None,
        clip_grad_norm: Optional[float] = None,
        loss: Optional[float] = None,
        step: Optional[Any] = None,
    ) -> StepDecision:
        """Ends one optimizer step after the backward of all its micro-batches.

        Args:
            optimizer (torch.optim.Optimizer): holds the parameters and their gradients.
            lr_scheduler (Optional[Any]): stepped only when the optimizer is.
            clip_grad_norm (Optional[float]): max total norm, or None for no clipping (the norm is
                computed either way).
            loss (Optional[float]): the step's loss, the same on every rank (a non-finite one skips
                the step even if the gradients happen to be finite).
            step (Optional[Any]): names the step in the error message (e.g. the recipe's step).

        Returns:
            StepDecision: the gradient norm and whether the step was skipped.

        Raises:
            NonFiniteStepsError: after ``max_consecutive_skipped_steps`` skipped steps in a row.
        """
        params = _parameters(optimizer)
        norm = total_grad_norm(params)
        norm_full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        grad_norm = float(norm_full)  # one host sync; the same value on every rank
        finite = math.isfinite(grad_norm) and (loss is None or math.isfinite(loss))
        if finite:
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(params, clip_grad_norm, norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if lr_scheduler is not None:
                lr_scheduler.step()
            self.consecutive_skipped = 0
            self._skipped_at = []
            return StepDecision(grad_norm=grad_norm, skipped=False)
        optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.consecutive_skipped += 1
        where = f"step {step}" if step is not None else "this step"
        self._skipped_at.append(f"{where} (grad norm {grad_norm}, loss {loss})")
        limit = self.max_consecutive_skipped_steps
        if limit is not None and self.consecutive_skipped >= limit:
            raise NonFiniteStepsError(
                f"{self.consecutive_skipped} optimizer steps in a row had a non-finite gradient norm or "
                f"loss, the last at {where}: " + "; ".join(self._skipped_at[-limit:]) +
                f". Each was skipped (gradients zeroed, no optimizer or LR-scheduler step); the run stops at "
                f"max_consecutive_skipped_steps={limit}. The weights are those of the last finite step; "
                f"lower the learning rate, enable clip_grad_norm, or check the data of these steps.")
        return StepDecision(grad_norm=grad_norm, skipped=True)

    def state_dict(self) -> Dict[str, int]:
        """The counters, for the recipe state of a checkpoint."""
        return {"skipped_steps": self.skipped_steps, "consecutive_skipped": self.consecutive_skipped}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restores :meth:`state_dict` (resume)."""
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skipped = int(state.get("consecutive_skipped", 0))


def check_finite_weights(state: Mapping[str, torch.Tensor], *, what: str = "checkpoint",
                         all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
    """Raises :class:`NonFiniteWeightsError` when a tensor of ``state`` holds NaN or inf.

    Args:
        state (Mapping[str, torch.Tensor]): name -> tensor (a state dict, or a model's
            ``named_parameters()``; DTensor shards are checked locally).
        what (str): names what would have been written, for the message.
        all_reduce (Optional[Callable]): sums a tensor over the ranks (``Runtime.all_reduce``), so
            that every rank raises together when any shard is bad (no rank left at a barrier).

    Raises:
        NonFiniteWeightsError: naming the first bad tensors and their counts, before anything is written.

    Example:
        >>> check_finite_weights(model.state_dict(), what="checkpoint step_000010")
    """
    names = list(state)
    counts = []
    for name in names:
        t = state[name]
        t = t.to_local() if hasattr(t, "to_local") else t
        counts.append((~torch.isfinite(t.detach())).sum().double().cpu() if t.is_floating_point()
                      else torch.zeros((), dtype=torch.float64))
    bad = torch.stack(counts) if counts else torch.zeros(0, dtype=torch.float64)
    if all_reduce is not None:
        bad = all_reduce(bad)
    hits = [(names[i], int(bad[i])) for i in torch.nonzero(bad).flatten().tolist()]
    if hits:
        listed = ", ".join(f"{n!r} ({c} values)" for n, c in hits[:5])
        raise NonFiniteWeightsError(
            f"refusing to write {what}: {len(hits)} weight tensor(s) hold NaN or inf, e.g. {listed}; "
            f"nothing was written (the previous checkpoints are intact)")
