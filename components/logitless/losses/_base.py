"""The recipe/loss protocol shared by every loss component, and the training engine's loss contract.

Output mode (:class:`HeadLoss`): a recipe calls ``loss_fn.set_model_output(model)`` once and never
branches on the loss class: the loss decides what the model returns. The public, torchtune-style
call ``loss_fn(model(tokens), labels)`` returns the loss of those labels (a mean over their tokens).

Engine contract (:class:`StepLoss`, see ``docs/CONTRACT.md``, "The loss contract"): the training
step (:class:`logitless.training.TrainStep`) first counts every micro-batch's :class:`LossUnits`
(:meth:`StepLoss.loss_units`), sums them over all micro-batches and ranks, then calls
:meth:`StepLoss.normalised_loss` on each micro-batch with that global total. The loss returns a
:class:`LossOutput`: its share of the whole step's loss, already normalised by the global count,
and its metrics as shares of their global means, so that summing the shares of every micro-batch
and rank gives the step's loss and metrics (torchtitan's shape). The engine never divides.
"""

import abc
from dataclasses import dataclass, fields
from typing import Dict, List, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from logitless.modules import HeadInput, unwrap_compiled, wrap_output_head
from logitless.ops import _validate

ModelOutput = Union[HeadInput, torch.Tensor, Sequence[torch.Tensor]]
Count = Union[int, torch.Tensor]


@dataclass(frozen=True)
class LossUnits:
    """The counts a loss normalises by, of one micro-batch or (summed) of the whole step.

    A micro-batch's counts may be 0-dim tensors (no host sync while counting); the engine's global
    total, handed to :meth:`StepLoss.normalised_loss`, holds ints.

    Attributes:
        tokens (int | torch.Tensor): positions that carry loss (non-ignored labels, minus any the
            loss masks). A step whose total is 0 has nothing to learn from and is skipped.
        sequences (int | torch.Tensor): rows (sequences or completions).
        micro_batches (int | torch.Tensor): 1 per micro-batch (GRPO's ``bnpo`` divides by the total).

    Example:
        >>> total = LossUnits.total([LossUnits(5, 2, 1), LossUnits(3, 2, 1)])
        >>> total
        LossUnits(tokens=8, sequences=4, micro_batches=2)
    """

    tokens: Count = 0
    sequences: Count = 0
    micro_batches: Count = 0

    def as_tensor(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """The counts as a float64 vector (the engine all-reduces it), on ``device``."""
        return torch.stack([torch.as_tensor(getattr(self, f.name), dtype=torch.float64).to(device).reshape(())
                            for f in fields(self)])

    @classmethod
    def from_tensor(cls, counts: torch.Tensor) -> "LossUnits":
        """Ints from a vector made by :meth:`as_tensor` (or a sum of such vectors)."""
        return cls(*(int(round(v)) for v in counts.tolist()))

    @classmethod
    def total(cls, units: Sequence["LossUnits"]) -> "LossUnits":
        """The sum of several micro-batches' counts, as ints (one host sync)."""
        if not units:
            return cls()
        return cls.from_tensor(torch.stack([u.as_tensor(torch.device("cpu")) for u in units]).sum(dim=0))


class LossOutput(NamedTuple):
    """What :meth:`StepLoss.normalised_loss` returns for one micro-batch.

    Attributes:
        loss (torch.Tensor): scalar, this micro-batch's share of the step's loss: the shares of every
            micro-batch and rank add up to the loss of the whole accumulated batch.
        metrics (Dict[str, torch.Tensor]): detached scalars, each this micro-batch's share of the
            metric's global mean over the step (they add up the same way).
    """

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


class HeadLoss(nn.Module):
    """Base class of the loss components: knows which output mode it wants from the model.

    Subclasses set ``output_mode`` (``"hidden"`` or ``"logit_chunks"``) and implement ``forward``.
    """

    output_mode: str = "hidden"
    num_output_chunks: Optional[int] = None

    def set_model_output(self, model: nn.Module) -> nn.Module:
        """Wraps ``model`` (if needed) and sets what its forward returns for this loss.

        Args:
            model (nn.Module): a torchtune ``TransformerDecoder`` (possibly wrapped by torch.compile).

        Returns:
            nn.Module: the same model object.
        """
        inner = wrap_output_head(unwrap_compiled(model))
        inner.set_output_mode(self.output_mode, self.num_output_chunks)
        return model

    def set_head_options(self, *, impl: str, temperature: float, chunk_size: Optional[int],
                         gemm_backend: Optional[str]) -> None:
        """Checks and keeps what every head-op call of the loss takes, before any compute.

        Raises:
            ValueError: naming the argument, its value and what was expected.
        """
        _validate.check_impl(impl)
        _validate.check_temperature(temperature)
        _validate.check_chunk_size(chunk_size)
        _validate.check_gemm_backend(gemm_backend)
        self.impl, self.temperature, self.chunk_size, self.gemm_backend = impl, temperature, chunk_size, gemm_backend


class StepLoss(HeadLoss, abc.ABC):
    """The loss contract of the training engine: counts, then shares normalised by global counts.

    Subclasses implement :meth:`loss_units` and :meth:`normalised_loss`; the public call
    ``loss_fn(outputs, labels)`` keeps its own meaning (a mean over the labels given). Every SFT
    loss component (cross-entropy, entropy) and ``GRPOLoss`` is a ``StepLoss``; ``TokenLogProbs``
    returns per-token values, not a loss, and is not.

    Example:
        >>> units = [loss_fn.loss_units(labels) for labels in micro_batch_labels]
        >>> total = LossUnits.total(units)                       # and summed over the ranks
        >>> for outputs, labels in zip(micro_batch_outputs, micro_batch_labels):
        ...     loss, metrics = loss_fn.normalised_loss(outputs, labels, total)
        ...     loss.backward()                                  # the gradient of the step's mean
    """

    @abc.abstractmethod
    def loss_units(self, labels: torch.Tensor, **inputs) -> LossUnits:
        """This micro-batch's counts, computed from its labels (before any forward).

        Args:
            labels (torch.Tensor): the micro-batch's labels, shifted, ``ignore_index`` without loss.
            **inputs: the loss's other per-micro-batch inputs that change what counts (GRPO:
                ``truncated``).

        Returns:
            LossUnits: its tokens, sequences and micro-batches (1).
        """

    @abc.abstractmethod
    def normalised_loss(self, outputs: ModelOutput, labels: torch.Tensor, total: LossUnits,
                        **inputs) -> LossOutput:
        """This micro-batch's share of the step's loss and metrics, normalised by ``total``.

        Args:
            outputs: what the model returns in this loss's output mode.
            labels (torch.Tensor): the micro-batch's labels.
            total (LossUnits): the counts of the whole step (every micro-batch, every rank).
            **inputs: the loss's other per-micro-batch inputs (GRPO: advantages, old / reference
                log-probs, ``truncated``).

        Returns:
            LossOutput: the share of the loss and of each metric (see :class:`LossOutput`).
        """


class TokenMeanLoss(StepLoss):
    """A :class:`StepLoss` whose loss is a mean over the non-ignored tokens (cross-entropy, entropy).

    Subclasses set ``ignore_index`` and implement :meth:`token_mean`; the step's loss is the mean
    over every token of the step, so a micro-batch's share is its own mean weighted by its share of
    the tokens: ``token_mean * tokens / total.tokens``.
    """

    ignore_index: int = -100

    @abc.abstractmethod
    def token_mean(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss over the non-ignored tokens of ``labels`` (0.0 when there are none)."""

    def loss_units(self, labels: torch.Tensor, **inputs) -> LossUnits:
        """Non-ignored tokens (a 0-dim tensor), rows, one micro-batch."""
        if inputs:
            raise TypeError(f"{type(self).__name__}.loss_units: unexpected inputs {sorted(inputs)}; "
                            f"expected only labels")
        return LossUnits(tokens=(labels != self.ignore_index).sum(), sequences=labels.shape[0], micro_batches=1)

    def normalised_loss(self, outputs: ModelOutput, labels: torch.Tensor, total: LossUnits,
                        **inputs) -> LossOutput:
        """``token_mean(outputs, labels) * tokens / total.tokens``; no metrics.

        Example:
            >>> loss, _ = loss_fn.normalised_loss(model(tokens), labels, LossUnits(tokens=1000))
        """
        tokens = self.loss_units(labels, **inputs).tokens
        share = float(tokens) / max(int(total.tokens), 1)
        return LossOutput(self.token_mean(outputs, labels) * share, {})


def check_num_output_chunks(num_output_chunks: int) -> None:
    """Raises ValueError unless ``num_output_chunks`` (chunks of a logit-list output) is an int >= 1."""
    if isinstance(num_output_chunks, bool) or not isinstance(num_output_chunks, int) or num_output_chunks < 1:
        raise ValueError(f"num_output_chunks must be an int >= 1, got {num_output_chunks!r}")


def as_head_input(outputs: ModelOutput, loss_name: str) -> HeadInput:
    """Checks that the model returned hidden states (output mode ``"hidden"``)."""
    if isinstance(outputs, HeadInput):
        return outputs
    raise ValueError(
        f"{loss_name} needs the model's final hidden states (a logitless.modules.HeadInput), got "
        f"{type(outputs).__name__}; call loss_fn.set_model_output(model) before the forward"
    )


def logit_chunks(outputs: ModelOutput) -> List[torch.Tensor]:
    """Model logits as a list of ``[N_i, V]`` chunks (accepts one tensor or torchtune's list)."""
    chunks = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    return [c.reshape(-1, c.shape[-1]) for c in chunks]


def label_chunks(labels: torch.Tensor, chunks: List[torch.Tensor]) -> List[torch.Tensor]:
    """Splits ``[B, S]`` labels the way torchtune chunks logits (``chunk`` along the sequence)."""
    if len(chunks) == 1:
        return [labels.reshape(-1)]
    pieces = [c.reshape(-1) for c in labels.chunk(len(chunks), dim=-1)]
    if [p.numel() for p in pieces] != [c.shape[0] for c in chunks]:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match the {len(chunks)} logit chunks of "
            f"{[c.shape[0] for c in chunks]} rows"
        )
    return pieces
