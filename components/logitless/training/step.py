"""One optimizer step over several micro-batches, normalised over the whole accumulated batch.

The step is generic: a recipe passes ``loss_fn(micro_batch) -> mean loss over that micro-batch's
units`` and ``count_fn(micro_batch) -> number of units`` (non-ignored tokens for SFT, completion
tokens or sequences for GRPO). Each micro-batch's loss is weighted by ``count / total`` where
``total`` is counted over ALL micro-batches (and all data-parallel ranks) before any backward, so
the gradient equals that of one big batch with a mean over every unit.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from logitless.training.nonfinite import NonFiniteGuard


@dataclass
class StepResult:
    """What one optimizer step did.

    Attributes:
        loss (float): mean loss over every unit of the accumulated batch (all ranks).
        num_units (int): total units (e.g. non-ignored tokens) over all micro-batches and ranks.
        grad_norm (Optional[float]): total gradient norm before clipping (None when no units).
        stepped (bool): False when the optimizer step was skipped (no units, or non-finite).
        skipped (bool): the step was skipped because its gradient norm or loss was NaN or inf.
        skipped_steps (int): non-finite steps skipped so far in the run.
        extras (Dict[str, float]): unit-weighted means of extra scalars that ``loss_fn`` returned.
    """

    loss: float
    num_units: int
    grad_norm: Optional[float] = None
    stepped: bool = True
    extras: Dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    skipped_steps: int = 0


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class TrainStep:
    """Gradient accumulation, clipping, optimizer and LR-scheduler step.

    Args:
        model (nn.Module): the model being trained (plain or FSDP2-sharded).
        optimizer (torch.optim.Optimizer): its optimizer.
        lr_scheduler (Optional[Any]): stepped once per optimizer step.
        clip_grad_norm (Optional[float]): max total gradient norm, or None for no clipping.
        grads_averaged_over_ranks (bool): True when the data-parallel wrapper averages gradients over
            ranks (FSDP2, DDP): the step then multiplies by the world size to get an exact global mean.
        max_consecutive_skipped_steps (Optional[int]): a step whose gradient norm or loss is NaN or inf
            is skipped (see :class:`~logitless.training.nonfinite.NonFiniteGuard`); this many in a row
            raise ``NonFiniteStepsError``. None: never stop. Default 3.

    Example:
        >>> step = TrainStep(model, opt, clip_grad_norm=1.0)
        >>> res = step([mb1, mb2], loss_fn=objective, count_fn=objective.count)
        >>> res.loss, res.num_units
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Optional[Any] = None,
                 clip_grad_norm: Optional[float] = None, grads_averaged_over_ranks: bool = True,
                 max_consecutive_skipped_steps: Optional[int] = 3):
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"TrainStep: clip_grad_norm must be > 0 or None, got {clip_grad_norm!r}")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.clip_grad_norm = clip_grad_norm
        self.grads_averaged_over_ranks = grads_averaged_over_ranks
        self.guard = NonFiniteGuard(max_consecutive_skipped_steps)

    def __call__(
        self,
        micro_batches: Sequence[Any],
        loss_fn: Callable[[Any], Any],
        count_fn: Callable[[Any], torch.Tensor | int],
        step: Optional[int] = None,
    ) -> StepResult:
        """Runs forward/backward on every micro-batch, then one optimizer step.

        Args:
            micro_batches (Sequence): the micro-batches of this step (already on device).
            loss_fn (Callable): ``loss_fn(mb)`` returns the MEAN loss over the units of ``mb`` (a
                scalar tensor), or ``(loss, extras_dict)`` whose scalars are averaged the same way.
            count_fn (Callable): ``count_fn(mb)`` returns the number of units of ``mb``.
            step (Optional[int]): the recipe's step number, named if the run stops on NaN steps.

        Returns:
            StepResult: loss, units, grad norm, whether the step was skipped as non-finite.

        Raises:
            NonFiniteStepsError: after ``max_consecutive_skipped_steps`` non-finite steps in a row.
        """
        if len(micro_batches) == 0:
            raise ValueError("TrainStep: got no micro-batches")
        counts = [torch.as_tensor(count_fn(mb), dtype=torch.float64).reshape(()) for mb in micro_batches]
        local_total = torch.stack(counts).sum()
        dev = _param_device(self.model)
        total = _all_reduce_sum(local_total.to(dev)).cpu()
        n_total = int(total.item())
        scale_ranks = _world_size() if self.grads_averaged_over_ranks else 1
        loss_sum = torch.zeros((), dtype=torch.float64)
        extras_sum: Dict[str, torch.Tensor] = {}
        for mb, count in zip(micro_batches, counts):
            out = loss_fn(mb)
            loss, extras = (out if isinstance(out, tuple) else (out, {}))
            w = float(count) / max(n_total, 1)
            (loss * (w * scale_ranks)).backward()
            loss_sum += loss.detach().double().cpu() * float(count)
            for k, v in extras.items():
                extras_sum[k] = extras_sum.get(k, 0) + torch.as_tensor(v).detach().double().cpu() * float(count)
        # global means over all units on all ranks
        packed = torch.stack([loss_sum] + [extras_sum[k] for k in sorted(extras_sum)]).to(dev)
        packed = (_all_reduce_sum(packed) / max(n_total, 1)).cpu()
        extras = {k: float(packed[i + 1]) for i, k in enumerate(sorted(extras_sum))}
        if n_total == 0:
            warnings.warn("TrainStep: the accumulated batch has no units (all labels ignored); "
                          "optimizer step skipped")
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss=0.0, num_units=0, grad_norm=None, stepped=False, extras=extras,
                              skipped_steps=self.guard.skipped_steps)
        loss = float(packed[0])
        decision = self.guard.step(self.optimizer, lr_scheduler=self.lr_scheduler,
                                   clip_grad_norm=self.clip_grad_norm, loss=loss, step=step)
        return StepResult(loss=loss, num_units=n_total, grad_norm=decision.grad_norm,
                          stepped=not decision.skipped, extras=extras, skipped=decision.skipped,
                          skipped_steps=self.guard.skipped_steps)


def _param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
