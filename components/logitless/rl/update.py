"""One GRPO policy update over a generation batch: old/reference log-probs, micro-batched
backward with gradient accumulation, ``num_iterations`` optimizer steps.

The batch is a :class:`~logitless.rl.batch.PolicyBatch` (one row per completion) or a
:class:`~logitless.rl.shared_batch.SharedGroupBatch` (prompt once per group); both give the policy,
old and reference passes a response-only head through ``batch.forward(model)`` and
``batch.head_labels``, so every per-token tensor has the ``(N, T)`` completion layout.

Data parallel (``data_parallel``, an FSDP2 :class:`~logitless.training.distributed.Runtime`): each rank
holds a contiguous share of the batch, and the update equals the one-device update of the whole
batch. The loss's normalisers count the GLOBAL batch (its sequences, its loss tokens, its
micro-batches); since FSDP2 averages gradients over the ranks, each rank's loss is multiplied by
the world size before backward, so the reduced gradient is the sum of the ranks' shares; the
gradient norm (clipping) is that of the full DTensor gradients; metrics are global.
"""

from typing import TYPE_CHECKING, Dict, Optional, Union

import torch
from torch import nn

from logitless.rl.batch import PolicyBatch
from logitless.rl.reference import ReferencePolicy
from logitless.rl.shared_batch import SharedGroupBatch
from logitless.training.nonfinite import NonFiniteGuard

if TYPE_CHECKING:
    from logitless.training.distributed import Runtime

TrainBatch = Union[PolicyBatch, SharedGroupBatch]


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
    log-probs are computed once when ``reference`` is given. Each optimizer step accumulates the
    gradients of all micro-batches; the loss's normalisers count the whole batch.

    Args:
        model (nn.Module): the policy (train mode).
        loss_fn: ``logitless.losses.GRPOLoss``.
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
        skipped as non-finite) and ``skipped_steps`` (the guard's total).

    Raises:
        NonFiniteStepsError: from the guard, after too many non-finite steps in a row.

    Example:
        >>> out = grpo_update(policy, loss_fn, optimizer, training_batch(rollout, prompt_sharing=False),
        ...                   advantages, micro_batch_size=8)
        >>> out["loss"], out["grad_norm"]
    """
    if num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {num_iterations}")
    if getattr(loss_fn, "beta", 0) > 0 and reference is None:
        raise ValueError("loss_fn.beta > 0 needs a reference policy")
    n = len(batch)
    if micro_batch_size < 1 or n % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch of {n} completions")
    micro = list(batch.micro_batches(micro_batch_size))
    ranks = 1 if data_parallel is None else data_parallel.world_size
    reduce = (lambda t: t) if data_parallel is None else data_parallel.all_reduce
    loss_fn.set_model_output(model)
    starts = range(0, n, micro_batch_size)
    old = batch_log_probs(model, loss_fn, batch, micro_batch_size) if num_iterations > 1 else None
    ref = None
    if reference is not None:
        ref = torch.cat([reference.log_probs(loss_fn, mb) for mb in micro])
        loss_fn.set_model_output(model)
    local_tokens = loss_fn.num_loss_tokens(batch.head_labels, batch.truncated)
    total_tokens = int(reduce(torch.tensor(local_tokens, dtype=torch.float64)).item())
    guard = NonFiniteGuard() if guard is None else guard
    skipped = 0
    for _ in range(num_iterations):
        sums: Dict[str, float] = {}
        weights: Dict[str, float] = {}
        loss_total = 0.0
        for start, mb in zip(starts, micro):
            rows = slice(start, start + micro_batch_size)
            loss, metrics = loss_fn(
                mb.forward(model), mb.head_labels, advantages[rows],
                old_log_probs=None if old is None else old[rows],
                ref_log_probs=None if ref is None else ref[rows],
                truncated=mb.truncated, total_sequences=n * ranks, total_tokens=total_tokens,
                num_micro_batches=len(micro) * ranks,
            )
            (loss * ranks if ranks > 1 else loss).backward()
            loss_total += float(loss.detach())
            w = float(metrics["num_tokens"])
            for k, v in metrics.items():
                if k != "num_tokens":
                    sums[k] = sums.get(k, 0.0) + float(v) * w
                    weights[k] = weights.get(k, 0.0) + w
        # The norm over all shards (the optimizer's own, sharded parameters under FSDP2) and the
        # loss over all ranks: every rank takes the same skip decision.
        global_loss = float(reduce(torch.tensor(loss_total, dtype=torch.float64)))
        decision = guard.step(optimizer, lr_scheduler=lr_scheduler, clip_grad_norm=clip_grad_norm,
                              loss=global_loss, step=step)
        grad_norm, skipped = decision.grad_norm, skipped + decision.skipped
    keys = sorted(sums)
    totals = reduce(torch.tensor([loss_total] + [sums[k] for k in keys] + [weights[k] for k in keys],
                                 dtype=torch.float64)).tolist()
    out = {k: totals[1 + i] / max(totals[1 + len(keys) + i], 1.0) for i, k in enumerate(keys)}
    out.update(loss=totals[0], grad_norm=float(grad_norm), num_loss_tokens=float(total_tokens),
               skipped=float(skipped), skipped_steps=float(guard.skipped_steps))
    return out
