"""The one optimizer-step engine of every recipe: accumulate, reduce, clip, step, schedule.

:class:`TrainStep` runs a :class:`StepObjective` (SFT's :class:`~logitless.training.sft.SFTObjective`,
GRPO's ``logitless.rl.update.GRPOObjective``) over the micro-batches of one optimizer step:

1. counts every micro-batch's :class:`~logitless.losses.LossUnits` and sums them over all
   micro-batches and ranks, before any forward or backward;
2. runs forward and backward on each micro-batch; the objective returns its share of the step's
   loss, already normalised by that global total (the loss contract, ``docs/CONTRACT.md``), so
   the accumulated gradient is that of one big batch over every rank;
3. reduces the loss and metrics over the ranks, then lets
   :class:`~logitless.training.nonfinite.NonFiniteGuard` clip (the optimizer's own, possibly
   sharded, parameters), step the optimizer and the LR scheduler, or skip a non-finite step.

Every collective goes through one :class:`~logitless.training.distributed.Runtime` (identities on
one device). With FSDP2, which averages gradients over the ranks, each share is multiplied by the
world size before backward, so the reduced gradient is the sum of the ranks' shares.
"""

from __future__ import annotations

import abc
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from logitless.losses._base import LossOutput, LossUnits
from logitless.training.distributed import Runtime
from logitless.training.nonfinite import NonFiniteGuard


class StepObjective(abc.ABC):
    """What :class:`TrainStep` runs on each micro-batch: the model's forward and a loss contract call.

    Example:
        >>> class Objective(StepObjective):
        ...     def units(self, mb):
        ...         return loss_fn.loss_units(mb["labels"])
        ...     def __call__(self, mb, total):
        ...         return loss_fn.normalised_loss(model(mb["tokens"]), mb["labels"], total)
    """

    @abc.abstractmethod
    def units(self, micro_batch: Any) -> LossUnits:
        """The micro-batch's counts (from its labels; no forward)."""

    @abc.abstractmethod
    def __call__(self, micro_batch: Any, total: LossUnits) -> LossOutput:
        """Forward and the micro-batch's share of the step's loss and metrics, normalised by ``total``
        (the counts of every micro-batch on every rank), as :class:`~logitless.losses.LossOutput`."""


@dataclass
class StepResult:
    """What one optimizer step did.

    Attributes:
        loss (float): mean loss over every unit of the accumulated batch (all ranks).
        num_units (int): total loss tokens over all micro-batches and ranks.
        grad_norm (Optional[float]): total gradient norm before clipping (None when no units).
        stepped (bool): False when the optimizer step was skipped (no units, or non-finite).
        extras (Dict[str, float]): the objective's metrics over the whole step (the sums of their
            shares: global, unit-weighted means).
        skipped (bool): the step was skipped because its gradient norm or loss was NaN or inf.
        skipped_steps (int): non-finite steps skipped so far in the run.
        units (Optional[LossUnits]): the step's total counts (tokens, sequences, micro-batches).
    """

    loss: float
    num_units: int
    grad_norm: Optional[float] = None
    stepped: bool = True
    extras: Dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    skipped_steps: int = 0
    units: Optional[LossUnits] = None


class TrainStep:
    """Gradient accumulation, the reductions over ranks, clipping, optimizer and LR-scheduler step.

    Args:
        model (nn.Module): the model being trained (plain or FSDP2-sharded).
        optimizer (torch.optim.Optimizer): its optimizer.
        lr_scheduler (Optional[Any]): stepped once per optimizer step that is not skipped.
        clip_grad_norm (Optional[float]): max total gradient norm, or None for no clipping.
        runtime (Optional[Runtime]): the ranks the step's batch is split over; every collective of
            the step goes through it. None: one device (every reduction the identity).
        grads_averaged_over_ranks (bool): True when the data-parallel wrapper averages gradients over
            ranks (FSDP2): each share is then multiplied by the world size for an exact global mean.
        max_consecutive_skipped_steps (Optional[int]): a step whose gradient norm or loss is NaN or inf
            is skipped (see :class:`~logitless.training.nonfinite.NonFiniteGuard`); this many in a row
            raise ``NonFiniteStepsError``. None: never stop. Default 3.
        guard (Optional[NonFiniteGuard]): an existing guard whose counters continue (GRPO keeps one
            per run); when given, ``max_consecutive_skipped_steps`` is the guard's own.

    Example:
        >>> step = TrainStep(model, opt, clip_grad_norm=1.0, runtime=runtime)
        >>> res = step([mb1, mb2], SFTObjective(model, loss_fn))
        >>> res.loss, res.num_units, res.grad_norm
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Optional[Any] = None,
                 clip_grad_norm: Optional[float] = None, *, runtime: Optional[Runtime] = None,
                 grads_averaged_over_ranks: bool = True, max_consecutive_skipped_steps: Optional[int] = 3,
                 guard: Optional[NonFiniteGuard] = None):
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"TrainStep: clip_grad_norm must be > 0 or None, got {clip_grad_norm!r}")
        if runtime is not None and not isinstance(runtime, Runtime):
            raise TypeError(f"TrainStep: runtime must be a logitless.training.distributed.Runtime or None, "
                            f"got {type(runtime).__name__}")
        if guard is not None and not isinstance(guard, NonFiniteGuard):
            raise TypeError(f"TrainStep: guard must be a NonFiniteGuard or None, got {type(guard).__name__}")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.clip_grad_norm = clip_grad_norm
        self.runtime = runtime if runtime is not None else Runtime(torch.device("cpu"))
        self.grads_averaged_over_ranks = grads_averaged_over_ranks
        self.guard = guard if guard is not None else NonFiniteGuard(max_consecutive_skipped_steps)

    def __call__(self, micro_batches: Sequence[Any], objective: StepObjective,
                 step: Optional[int] = None) -> StepResult:
        """Runs forward/backward on every micro-batch, then one optimizer step.

        Args:
            micro_batches (Sequence): this rank's micro-batches of the step (already on device).
            objective (StepObjective): counts a micro-batch and returns its normalised share.
            step (Optional[int]): the recipe's step number, named if the run stops on NaN steps.

        Returns:
            StepResult: loss, units, grad norm, metrics, whether the step was skipped.

        Raises:
            TypeError: ``objective`` is not a :class:`StepObjective`, or returns something else
                than :class:`~logitless.losses.LossUnits` / :class:`~logitless.losses.LossOutput`.
            NonFiniteStepsError: after ``max_consecutive_skipped_steps`` non-finite steps in a row.
        """
        if not isinstance(objective, StepObjective):
            raise TypeError(f"TrainStep: objective must be a logitless.training.step.StepObjective (units(mb) -> "
                            f"LossUnits, objective(mb, total) -> LossOutput), got {_name(objective)}")
        if len(micro_batches) == 0:
            raise ValueError("TrainStep: got no micro-batches")
        total = self._total_units(micro_batches, objective)
        if total.tokens == 0:
            warnings.warn("TrainStep: the accumulated batch has no units (no label in the loss on any rank: "
                          "all ignored or masked); optimizer step skipped")
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss=0.0, num_units=0, grad_norm=None, stepped=False,
                              skipped_steps=self.guard.skipped_steps, units=total)
        rt = self.runtime
        scale = rt.world_size if rt.distributed and self.grads_averaged_over_ranks else 1
        # float64 sums of the shares, on the loss's device (no host sync per micro-batch)
        loss_sum: Optional[torch.Tensor] = None
        metric_sums: Dict[str, torch.Tensor] = {}
        for mb in micro_batches:
            out = objective(mb, total)
            if not isinstance(out, tuple) or len(out) != 2 or not isinstance(out[1], dict):
                raise TypeError(f"TrainStep: {_name(objective)} returned {type(out).__name__}; expected a "
                                f"logitless.losses.LossOutput(loss, metrics)")
            loss, metrics = out
            (loss * scale if scale != 1 else loss).backward()
            share = loss.detach().double()
            loss_sum = share if loss_sum is None else loss_sum + share
            for k, v in metrics.items():
                v = torch.as_tensor(v).detach().to(share.device, torch.float64)
                metric_sums[k] = metric_sums[k] + v if k in metric_sums else v
        keys = sorted(metric_sums)
        packed = rt.all_reduce(torch.stack([loss_sum, *(metric_sums[k] for k in keys)])).cpu()  # one sync
        loss_value = float(packed[0])
        decision = self.guard.step(self.optimizer, lr_scheduler=self.lr_scheduler,
                                   clip_grad_norm=self.clip_grad_norm, loss=loss_value, step=step)
        return StepResult(loss=loss_value, num_units=total.tokens, grad_norm=decision.grad_norm,
                          stepped=not decision.skipped, extras={k: float(packed[1 + i]) for i, k in enumerate(keys)},
                          skipped=decision.skipped, skipped_steps=self.guard.skipped_steps, units=total)

    def _total_units(self, micro_batches: Sequence[Any], objective: StepObjective) -> LossUnits:
        """Every micro-batch's counts summed over this rank's micro-batches and all ranks."""
        units = [objective.units(mb) for mb in micro_batches]
        for u in units:
            if not isinstance(u, LossUnits):
                raise TypeError(f"TrainStep: {_name(objective)}.units returned {type(u).__name__}; expected "
                                f"logitless.losses.LossUnits")
        device = _param_device(self.model)
        local = torch.stack([u.as_tensor(device) for u in units]).sum(dim=0)
        return LossUnits.from_tensor(self.runtime.all_reduce(local))


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
