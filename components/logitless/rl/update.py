"""One GRPO policy update over a generation batch: the GRPO-specific preparation (old and
reference log-probs, the sampler-trainer mismatch and importance weights, the high-entropy token
mask, advantages, micro-batches), then ``num_iterations`` optimizer steps of the training engine
(:class:`~logitless.training.TrainStep`, the same as SFT's).

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
from logitless.rl.metrics import sampler_mismatch_metrics
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
    return batch_log_probs_and_entropy(model, loss_fn, batch, micro_batch_size, return_entropy=False)[0]


@torch.no_grad()
def batch_log_probs_and_entropy(model: nn.Module, loss_fn, batch: TrainBatch, micro_batch_size: int, *,
                                return_entropy: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`batch_log_probs` and the entropies, from the same pass over the head.

    Args:
        model, loss_fn, batch, micro_batch_size: as in :func:`batch_log_probs`.
        return_entropy (bool): also return the entropies (else None).

    Returns:
        Tuple[torch.Tensor, Optional[torch.Tensor]]: ``batch.head_labels``-shaped fp32 log-probs
        and entropies.
    """
    parts = [loss_fn.log_probs_and_entropy(mb.forward(model), mb.head_labels, return_entropy=return_entropy)
             for mb in batch.micro_batches(micro_batch_size)]
    return torch.cat([lp for lp, _ in parts]), (torch.cat([e for _, e in parts]) if return_entropy else None)


def _all_values(values: torch.Tensor, runtime: Optional["Runtime"]) -> torch.Tensor:
    """Every rank's 1-D ``values`` (different lengths allowed), concatenated."""
    if runtime is None or not runtime.distributed:
        return values
    longest = int(runtime.all_reduce(torch.tensor([values.numel()], device=values.device), "max"))
    padded = torch.full((longest,), float("nan"), dtype=values.dtype, device=values.device)
    padded[:values.numel()] = values
    everything = runtime.all_gather(padded)
    return everything[~torch.isnan(everything)]


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
        sampler_log_probs (Optional[torch.Tensor]): ``(N, T)`` the sampler's log-probs of the
            sampled tokens (the importance weight), or None.
        entropy_mask (Optional[torch.Tensor]): ``(N, T)`` bool high-entropy tokens, or None.
        total_selected_tokens (Optional[int]): tokens inside ``entropy_mask`` over the whole batch.

    Example:
        >>> obj = GRPOObjective(model, loss_fn, advantages)
        >>> step([(slice(0, 8), mb0), (slice(8, 16), mb1)], obj)
    """

    def __init__(self, model: nn.Module, loss_fn: GRPOLoss, advantages: torch.Tensor,
                 old_log_probs: Optional[torch.Tensor] = None, ref_log_probs: Optional[torch.Tensor] = None, *,
                 sampler_log_probs: Optional[torch.Tensor] = None, entropy_mask: Optional[torch.Tensor] = None,
                 total_selected_tokens: Optional[int] = None):
        _check_loss(loss_fn)
        self.model, self.loss_fn, self.advantages = model, loss_fn, advantages
        self.old_log_probs, self.ref_log_probs = old_log_probs, ref_log_probs
        self.sampler_log_probs, self.entropy_mask = sampler_log_probs, entropy_mask
        self.total_selected_tokens = total_selected_tokens

    def units(self, micro_batch: RowsAndBatch) -> LossUnits:
        _, mb = micro_batch
        return self.loss_fn.loss_units(mb.head_labels, mb.truncated)

    def __call__(self, micro_batch: RowsAndBatch, total: LossUnits) -> LossOutput:
        rows, mb = micro_batch
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return self.loss_fn.normalised_loss(
            mb.forward(self.model), mb.head_labels, total, advantages=self.advantages[rows],
            old_log_probs=pick(self.old_log_probs), ref_log_probs=pick(self.ref_log_probs),
            sampler_log_probs=pick(self.sampler_log_probs), entropy_mask=pick(self.entropy_mask),
            total_selected_tokens=self.total_selected_tokens, truncated=mb.truncated)


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
    sampler_log_probs: Optional[torch.Tensor] = None,
) -> Dict[str, float]:
    """Runs ``num_iterations`` optimizer steps on one generation batch.

    Old log-probs are recomputed on the training path before the first step when
    ``loss_fn.needs_old_log_probs`` says so: ``num_iterations > 1`` (with one iteration they equal
    the current ones, ratio 1), the sampler-trainer importance weight (``sampler_log_probs`` given
    and ``loss_fn.sampler_correction``), or ``top_entropy_quantile < 1`` (the same pass returns
    the entropies; the threshold is the quantile over every loss token of the batch, on every
    rank). With the old log-probs and the sampler's, the mismatch metrics of
    :func:`~logitless.rl.metrics.sampler_mismatch_metrics` are logged. Reference log-probs are
    computed once when ``reference`` is given. Each optimizer step is one call of the training
    engine (:class:`~logitless.training.TrainStep` with a :class:`GRPOObjective`): it accumulates
    the gradients of all micro-batches, normalised by the counts of the whole batch.

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
        sampler_log_probs (Optional[torch.Tensor]): ``(N, T)`` the sampler's log-probs of this
            rank's sampled tokens (``Rollout.sampler_log_probs``, the ``head_labels`` layout).

    Returns:
        Dict[str, float]: token-weighted means of the loss metrics over the last iteration, plus
        ``loss`` (sum of micro-batch losses) and ``grad_norm`` (before clipping), all over the whole
        batch (every rank's share), ``num_loss_tokens``, ``skipped`` (optimizer steps of this call
        skipped as non-finite) and ``skipped_steps`` (the guard's total); ``sampling/*`` (the
        mismatch, when old and sampler log-probs exist) and ``top_entropy/threshold`` (with
        ``top_entropy_quantile < 1``). A batch without any loss token (every completion masked)
        has nothing to learn from: its steps are skipped with a warning, ``grad_norm`` 0 and no
        loss metrics.

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
    mask = torch.cat([loss_fn.loss_mask(mb.head_labels, mb.truncated) for mb in micro])
    if sampler_log_probs is not None and sampler_log_probs.shape != mask.shape:
        raise ValueError(f"sampler_log_probs must have the batch's head_labels shape {tuple(mask.shape)} (one row "
                         f"per completion, one column per completion token), got {tuple(sampler_log_probs.shape)}")
    loss_fn.set_model_output(model)
    old = entropies = None
    if loss_fn.needs_old_log_probs(num_iterations, sampler_log_probs is not None):
        old, entropies = batch_log_probs_and_entropy(model, loss_fn, batch, micro_batch_size,
                                                     return_entropy=loss_fn.top_entropy_quantile < 1)
    ref = None
    if reference is not None:
        ref = torch.cat([reference.log_probs(loss_fn, mb) for mb in micro])
        loss_fn.set_model_output(model)
    prepared: Dict[str, float] = {}
    all_reduce = data_parallel.all_reduce if data_parallel is not None else None
    if sampler_log_probs is not None and old is not None:
        sampler_log_probs = sampler_log_probs.to(old.device)
        prepared.update(sampler_mismatch_metrics(old, sampler_log_probs, mask, loss_fn, all_reduce))
    entropy_mask = selected = None
    if entropies is not None:
        threshold = loss_fn.entropy_threshold(_all_values(entropies[mask], data_parallel))
        entropy_mask = loss_fn.high_entropy_mask(entropies, mask, threshold)
        count = entropy_mask.sum().reshape(1).double()
        selected = int((all_reduce(count) if all_reduce else count).item())
        prepared["top_entropy/threshold"] = float(threshold)
    objective = GRPOObjective(model, loss_fn, advantages, old_log_probs=old, ref_log_probs=ref,
                              sampler_log_probs=sampler_log_probs if loss_fn.sampler_correction else None,
                              entropy_mask=entropy_mask, total_selected_tokens=selected)
    micro_batches = [(slice(start, start + micro_batch_size), mb)
                     for start, mb in zip(range(0, n, micro_batch_size), micro)]
    skipped = 0
    for _ in range(num_iterations):
        res = engine(micro_batches, objective, step=step)
        skipped += res.skipped
    out = {**prepared, **res.extras}
    # no loss token in the whole batch: nothing to learn, the step is skipped with a zero gradient
    out.update(loss=res.loss, grad_norm=0.0 if res.grad_norm is None else res.grad_norm,
               num_loss_tokens=float(res.num_units), skipped=float(skipped),
               skipped_steps=float(engine.guard.skipped_steps))
    return out
