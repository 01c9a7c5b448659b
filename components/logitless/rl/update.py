"""One GRPO policy update over a generation batch: the GRPO-specific preparation (old and
reference log-probs, advantages, micro-batches), then ``num_iterations`` optimizer steps of the
training engine (:class:`~logitless.training.TrainStep`, the same as SFT's).

The batch is a :class:`~logitless.rl.batch.PolicyBatch` (one row per completion) or a
:class:`~logitless.rl.shared_batch.SharedGroupBatch` (prompt once per group); both give the policy,
old and reference passes a response-only head through ``batch.forward(model)`` and
``batch.head_labels``, so every per-token tensor has the ``(N, T)`` completion layout.

Data parallel (``data_parallel``, an FSDP2 :class:`~logitless.training.distributed.Runtime`): each rank
holds a contiguous share of the batch, and the update equals the one-device update of the whole
batch: the engine counts the GLOBAL batch (its sequences, loss tokens and micro-batches) before any
backward, ``GRPOLoss`` normalises by those counts, and the engine scales for FSDP2's gradient
average, clips on the full DTensor gradients and reduces the metrics over the ranks.
"""

from typing import TYPE_CHECKING, Dict, Optional, Tuple, Union

import torch
from torch import nn

from logitless.losses._base import LossOutput, LossUnits
from logitless.losses.grpo import GRPOLoss
from logitless.rl.batch import PolicyBatch
from logitless.rl.reference import ReferencePolicy
from logitless.rl.shared_batch import SharedGroupBatch
from logitless.training.nonfinite import NonFiniteGuard
from logitless.training.step import StepObjective, TrainStep

if TYPE_CHECKING:
    from logitless.training.distributed import Runtime

TrainBatch = Union[PolicyBatch, SharedGroupBatch]
#: A micro-batch of the update: its rows of the generation batch, and the micro-batch itself.
RowsAndBatch = Tuple[slice, TrainBatch]
@torch.no_grad()
def batch_log_probs(model: nn.Module, loss_fn, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
    """Log-probs of the current policy on the training path (old log-probs), micro-batched.

    Args:
        model (nn.Module): the policy, output mode set by ``loss_fn.set_model_output``.
        loss_fn: a ``GRPOLoss``.
        batch (PolicyBatch | SharedGroupBatch): the whole generation batch.
        micro_batch_size (int): completions per forward.

    Returns:
        torch.Tensor: ``batch.head_labels``-shaped fp32 (``(N, T)`` with a response-only head).
    """
    return torch.cat([loss_fn.log_probs(mb.forward(model), mb.head_labels)
                      for mb in batch.micro_batches(micro_batch_size)])


def _check_loss(loss_fn) -> None:
    if not isinstance(loss_fn, GRPOLoss):
        raise TypeError(f"loss_fn: expected a logitless.losses.GRPOLoss, got "
                        f"{type(loss_fn).__module__}.{type(loss_fn).__qualname__}")


class GRPOObjective(StepObjective):
    """The GRPO policy loss of one micro-batch for :class:`~logitless.training.TrainStep`.

    Micro-batches are ``(rows, micro_batch)`` pairs: ``rows`` selects the micro-batch's completions
    in the per-completion tensors given here (advantages, old and reference log-probs).

    Args:
        model (nn.Module): the policy, output mode set by ``loss_fn.set_model_output``.
        loss_fn (GRPOLoss): the policy loss (called through its loss contract).
        advantages (torch.Tensor): ``(N,)`` or ``(N, T)`` for this rank's N completions.
        old_log_probs (Optional[torch.Tensor]): ``(N, T)``, or None (ratio 1).
        ref_log_probs (Optional[torch.Tensor]): ``(N, T)``, or None (no KL).

    Example:
        >>> obj = GRPOObjective(model, loss_fn, advantages)
        >>> step([(slice(0, 8), mb0), (slice(8, 16), mb1)], obj)
    """

    def __init__(self, model: nn.Module, loss_fn: GRPOLoss, advantages: torch.Tensor,
                 old_log_probs: Optional[torch.Tensor] = None, ref_log_probs: Optional[torch.Tensor] = None):
        _check_loss(loss_fn)
        self.model, self.loss_fn, self.advantages = model, loss_fn, advantages
        self.old_log_probs, self.ref_log_probs = old_log_probs, ref_log_probs

    def units(self, micro_batch: RowsAndBatch) -> LossUnits:
        _, mb = micro_batch
        return self.loss_fn.loss_units(mb.head_labels, mb.truncated)

    def __call__(self, micro_batch: RowsAndBatch, total: LossUnits) -> LossOutput:
        rows, mb = micro_batch
        return self.loss_fn.normalised_loss(
            mb.forward(self.model), mb.head_labels, total, advantages=self.advantages[rows],
            old_log_probs=None if self.old_log_probs is None else self.old_log_probs[rows],
            ref_log_probs=None if self.ref_log_probs is None else self.ref_log_probs[rows],
            truncated=mb.truncated)


def grpo_update(
    model: nn.Module,
    loss_fn,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    advantages: torch.Tensor,
    *,
    micro_batch_size: int,
    num_iterations: int = 1,
    reference: Optional[ReferencePolicy] = None,
    clip_grad_norm: Optional[float] = None,
    lr_scheduler=None,
    data_parallel: Optional["Runtime"] = None,
    guard: Optional[NonFiniteGuard] = None,
    step: Optional[int] = None,
) -> Dict[str, float]:
    """Runs ``num_iterations`` optimizer steps on one generation batch.

    Old log-probs are recomputed on the training path before the first step when
    ``num_iterations > 1`` (with one iteration they equal the current ones, ratio 1); reference
    log-probs are computed once when ``reference`` is given. Each optimizer step is one call of the
    training engine (:class:`~logitless.training.TrainStep` with a :class:`GRPOObjective`): it
    accumulates the gradients of all micro-batches, normalised by the counts of the whole batch.

    Args:
        model (nn.Module): the policy (train mode).
        loss_fn (GRPOLoss): the policy loss (any other object is a TypeError).
        optimizer (torch.optim.Optimizer): over the trainable parameters.
        batch (PolicyBatch | SharedGroupBatch): the generation batch (N completions).
        advantages (torch.Tensor): ``(N,)``.
        micro_batch_size (int): completions per forward/backward; must divide N (and be a multiple
            of G for a ``SharedGroupBatch``).
        num_iterations (int): optimizer steps on this batch (>= 1).
        reference (Optional[ReferencePolicy]): the KL reference (needed when ``loss_fn.beta > 0``).
        clip_grad_norm (Optional[float]): max total gradient norm.
        lr_scheduler: stepped after every optimizer step.
        data_parallel (Optional[Runtime]): the ranks the generation batch is split over (this
            rank's share is ``batch``; FSDP2 averages gradients over them); None on one device.
        guard (Optional[NonFiniteGuard]): skips optimizer steps whose gradient norm or loss is NaN
            or inf and stops after too many in a row; keep one per run so that it counts across
            calls. None: a fresh ``NonFiniteGuard()`` (counts within this call only).
        step (Optional[int]): the recipe's step, named if the run stops on non-finite steps.

    Returns:
        Dict[str, float]: token-weighted means of the loss metrics over the last iteration, plus
        ``loss`` (sum of micro-batch losses) and ``grad_norm`` (before clipping), all over the whole
        batch (every rank's share), ``num_loss_tokens``, ``skipped`` (optimizer steps of this call
        skipped as non-finite) and ``skipped_steps`` (the guard's total). A batch without any loss
        token (every completion masked) has nothing to learn from: its steps are skipped with a
        warning, ``grad_norm`` 0 and no loss metrics.

    Raises:
        NonFiniteStepsError: from the guard, after too many non-finite steps in a row.

    Example:
        >>> out = grpo_update(policy, loss_fn, optimizer, training_batch(rollout, prompt_sharing=False),
        ...                   advantages, micro_batch_size=8)
        >>> out["loss"], out["grad_norm"]
    """
    _check_loss(loss_fn)
    if num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {num_iterations}")
    if loss_fn.beta > 0 and reference is None:
        raise ValueError("loss_fn.beta > 0 needs a reference policy")
    n = len(batch)
    if micro_batch_size < 1 or n % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch of {n} completions")
    engine = TrainStep(model, optimizer, lr_scheduler, clip_grad_norm=clip_grad_norm, runtime=data_parallel,
                       guard=NonFiniteGuard() if guard is None else guard)
    micro = list(batch.micro_batches(micro_batch_size))
    loss_fn.set_model_output(model)
    old = batch_log_probs(model, loss_fn, batch, micro_batch_size) if num_iterations > 1 else None
    ref = None
    if reference is not None:
        ref = torch.cat([reference.log_probs(loss_fn, mb) for mb in micro])
        loss_fn.set_model_output(model)
    objective = GRPOObjective(model, loss_fn, advantages, old_log_probs=old, ref_log_probs=ref)
    micro_batches = [(slice(start, start + micro_batch_size), mb)
                     for start, mb in zip(range(0, n, micro_batch_size), micro)]
    skipped = 0
    for _ in range(num_iterations):
        res = engine(micro_batches, objective, step=step)
        skipped += res.skipped
    out = dict(res.extras)
    # no loss token in the whole batch: nothing to learn, the step is skipped with a zero gradient
    out.update(loss=res.loss, grad_norm=0.0 if res.grad_norm is None else res.grad_norm,
               num_loss_tokens=float(res.num_units), skipped=float(skipped),
               skipped_steps=float(engine.guard.skipped_steps))
    return out
