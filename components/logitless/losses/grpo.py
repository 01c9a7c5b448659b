"""GRPO policy loss on per-token log-probs computed by the fused/chunked head (never full logits).

Protocol (as every logitless loss)::

    loss_fn = GRPOLoss(epsilon=0.2, beta=0.04, loss_type="dapo", temperature=0.7)
    loss_fn.set_model_output(policy)                  # policy now returns a HeadInput
    with torch.no_grad():                             # once per generation batch
        old = loss_fn.log_probs(policy(tokens, ...), labels)          # if num_iterations > 1
        ref = loss_fn.log_probs(reference(tokens, ...), labels)       # if beta > 0
    loss, metrics = loss_fn(policy(tokens, ...), labels, advantages,
                            old_log_probs=old, ref_log_probs=ref, truncated=truncated,
                            total_sequences=N, total_tokens=loss_fn.num_loss_tokens(labels, truncated))
    loss.backward()

The training engine calls it through the loss contract (:class:`~logitless.losses._base.StepLoss`):
``loss_units(labels, truncated=...)`` counts a micro-batch, and ``normalised_loss(outputs, labels,
total, advantages=..., ...)`` passes the step's global ``total`` (tokens, sequences, micro-batches)
as the normalisers above and returns the metrics as shares of their token-weighted global means
(``logitless.rl.update.grpo_update`` runs it through ``logitless.training.TrainStep``).

``labels`` are the shifted completion tokens with ``ignore_index`` at every other position (see
``logitless.rl.batch.policy_batch``); every per-token tensor has the labels' shape, so the same call
works whether the hidden states cover whole sequences or only completion positions.

Per-token objective, with ``r = exp(logp - old)`` (token level) or ``exp(mean_t(logp - old))``
(sequence level, GSPO), advantage ``A`` and mask ``m``::

    L_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
          + beta * (exp(ref - logp) - (ref - logp) - 1)        # k3 estimator of KL(pi || ref)
          - entropy_coef * H_t

Reduction over the whole accumulated batch (``B_tot`` sequences, ``N_tot`` tokens, ``M`` micro-batches;
each micro-batch call returns its share so that the micro-batch losses add up to the batch loss):

- ``grpo``:    sum_i mean_t(L_it) / B_tot                (per-sequence mean, then mean)
- ``bnpo``:    sum(L m) / sum(m)_micro-batch / M          (token mean per micro-batch)
- ``dr_grpo``: sum(L m) / (B_tot * max_completion_length)
- ``dapo``:    sum(L m) / N_tot                           (token mean over the accumulated batch)

Each normalisation is a per-token weight known before the forward, so with token-level ratios the
loss is ``sum_t w_t L_t(logp_t, H_t)``: a sum of per-token terms of that token's log-prob and
entropy. The fused path (``fused=True``, the default at token level) hands ``L_t * w_t`` to
``logitless.ops.linear_token_objective``, which computes the head's gradients in its forward
(three GEMMs instead of forward + recompute). Both paths share :meth:`GRPOLoss.token_terms`.
"""

from typing import Dict, Optional, Tuple

import torch

from logitless.losses._base import LossOutput, LossUnits, ModelOutput, StepLoss, as_head_input
from logitless.modules import HeadInput  # noqa: F401  (public in signatures / doctest)
from logitless.ops import RowObjective, _validate, linear_log_probs, linear_token_objective

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def masked_like(mask: torch.Tensor, values: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``values`` inside ``mask``, the detached current log-prob outside: a log-ratio and a KL of 0
    there, computed from finite numbers whatever ``values`` holds outside the mask."""
    return torch.where(mask, values, logp.detach())
IMPORTANCE_LEVELS = ("token", "sequence")


class GRPOLoss(StepLoss):
    """PPO-clipped group-relative policy loss (GRPO, BNPO, Dr. GRPO, DAPO normalisations).

    Args:
        epsilon (float): lower clip range, ratio clipped below at ``1 - epsilon``. Default 0.2.
        epsilon_high (Optional[float]): upper clip range (DAPO's clip-higher); ``epsilon`` if None.
        beta (float): weight of the k3 KL to the reference policy; 0 disables it (no reference pass).
        loss_type (str): ``"grpo" | "bnpo" | "dr_grpo" | "dapo"``. Default ``"dapo"`` (as TRL).
        entropy_coef (float): entropy bonus weight (subtracted from the loss). Default 0.
        importance_sampling_level (str): ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO).
        mask_truncated_completions (bool): drop completions that hit the length limit from the loss.
        max_completion_length (Optional[int]): the normaliser of ``dr_grpo`` (required for it).
        temperature (float): the sampling temperature; divides the logits in every pass.
        impl (str): head implementation for ``logitless.linear_log_probs``
            (``"auto" | "triton" | "chunked" | "reference"``).
        ignore_index (int): label of positions without loss. Default -100.
        chunk_size (Optional[int]): rows per chunk for ``impl="chunked"``.
        gemm_backend (Optional[str]): the head's GEMMs under ``impl="triton"`` (``"auto"`` |
            ``"cublas"`` | ``"quack"`` | ``"triton"``); None = ``LOGITLESS_HEAD_GEMM``. YAML:
            ``loss.gemm_backend``.
        fused (Optional[bool]): compute the head's gradients in the forward through
            ``logitless.ops.linear_token_objective`` (same loss, gradients and metrics; 3 head
            GEMMs instead of 4). None (default): on with token-level ratios. The sequence-level
            ratio couples the tokens of a sequence, so ``fused=True`` with
            ``importance_sampling_level="sequence"`` is a ValueError.

    Example:
        >>> loss_fn = GRPOLoss(beta=0.0, loss_type="dapo", temperature=1.0, impl="reference")
        >>> hidden, weight = torch.randn(2, 4, 8, requires_grad=True), torch.randn(11, 8)
        >>> labels = torch.tensor([[-100, 3, 4, -100], [-100, 5, -100, -100]])
        >>> loss, metrics = loss_fn(HeadInput(hidden, weight), labels, torch.tensor([1.0, -1.0]))
        >>> loss.backward(); sorted(metrics)
        ['clip_ratio/high', 'clip_ratio/low', 'clip_ratio/region', 'entropy', 'num_tokens']
    """

    output_mode = "hidden"

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: Optional[float] = None,
        beta: float = 0.0,
        loss_type: str = "dapo",
        entropy_coef: float = 0.0,
        importance_sampling_level: str = "token",
        mask_truncated_completions: bool = False,
        max_completion_length: Optional[int] = None,
        temperature: float = 1.0,
        impl: str = "auto",
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        gemm_backend: Optional[str] = None,
        fused: Optional[bool] = None,
    ):
        super().__init__()
        epsilon_high = epsilon if epsilon_high is None else epsilon_high
        for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high), ("beta", beta),
                            ("entropy_coef", entropy_coef)):
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if importance_sampling_level not in IMPORTANCE_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_LEVELS}, "
                             f"got {importance_sampling_level!r}")
        if loss_type == "dr_grpo" and (not isinstance(max_completion_length, int) or max_completion_length < 1):
            raise ValueError(f"loss_type='dr_grpo' needs max_completion_length (a positive int), "
                             f"got {max_completion_length!r}")
        if fused is not None and not isinstance(fused, bool):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        if fused and importance_sampling_level == "sequence":
            raise ValueError(
                "fused=True needs importance_sampling_level='token': the sequence-level ratio "
                "exp(mean_t(logp - old)) couples the tokens of a sequence, so a token's gradient is "
                "not known from its own log-prob; use fused=False or None"
            )
        _validate.check_temperature(temperature)
        _validate.check_impl(impl)
        _validate.check_chunk_size(chunk_size)
        _validate.check_gemm_backend(gemm_backend)
        self.epsilon, self.epsilon_high, self.beta = float(epsilon), float(epsilon_high), float(beta)
        self.loss_type, self.entropy_coef = loss_type, float(entropy_coef)
        self.importance_sampling_level = importance_sampling_level
        self.mask_truncated_completions = mask_truncated_completions
        self.max_completion_length = max_completion_length
        self.temperature, self.impl = temperature, impl
        self.ignore_index, self.chunk_size, self.gemm_backend = ignore_index, chunk_size, gemm_backend
        self.fused = (importance_sampling_level == "token") if fused is None else fused

    # ------------------------------------------------------------------ helpers
    def log_probs(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs at the sampling temperature (old / reference passes; no entropy).

        Args:
            outputs (HeadInput): the model's hidden states and head weight.
            labels (torch.Tensor): ``(B, S)`` shifted labels.

        Returns:
            torch.Tensor: ``(B, S)`` fp32, 0 at ignored positions.
        """
        head = as_head_input(outputs, type(self).__name__)
        logp, _ = linear_log_probs(head.hidden, head.weight, labels, ignore_index=self.ignore_index,
                                   temperature=self.temperature, return_entropy=False,
                                   impl=self.impl, chunk_size=self.chunk_size, gemm_backend=self.gemm_backend)
        return logp

    def loss_mask(self, labels: torch.Tensor, truncated: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``(B, S)`` bool: positions that count in the loss (completion tokens, minus truncated
        completions when ``mask_truncated_completions``)."""
        mask = labels != self.ignore_index
        if self.mask_truncated_completions and truncated is not None:
            mask = mask & ~truncated.to(torch.bool)[:, None]
        return mask

    def num_loss_tokens(self, labels: torch.Tensor, truncated: Optional[torch.Tensor] = None) -> int:
        """Number of tokens in the loss: sum it over all micro-batches for ``total_tokens``."""
        return int(self.loss_mask(labels, truncated).sum())

    def loss_units(self, labels: torch.Tensor, truncated: Optional[torch.Tensor] = None) -> LossUnits:
        """This micro-batch's counts for the engine: loss tokens (:meth:`num_loss_tokens`, a 0-dim
        tensor), completions, one micro-batch."""
        return LossUnits(tokens=self.loss_mask(labels, truncated).sum(), sequences=labels.shape[0], micro_batches=1)

    def normalised_loss(
        self,
        outputs: ModelOutput,
        labels: torch.Tensor,
        total: LossUnits,
        *,
        advantages: torch.Tensor,
        old_log_probs: Optional[torch.Tensor] = None,
        ref_log_probs: Optional[torch.Tensor] = None,
        truncated: Optional[torch.Tensor] = None,
    ) -> LossOutput:
        """This micro-batch's share of the step's loss (the loss contract of the training engine).

        Args:
            outputs, labels, advantages, old_log_probs, ref_log_probs, truncated: as in :meth:`forward`.
            total (LossUnits): the whole step's counts, over every micro-batch and rank: the
                ``total_tokens``, ``total_sequences`` and ``num_micro_batches`` of :meth:`forward`.

        Returns:
            LossOutput: the loss share of :meth:`forward`; its metrics (``num_tokens`` aside), each a
            token-weighted share: ``metric * num_tokens / total.tokens`` in float64.
        """
        loss, metrics = self(outputs, labels, advantages, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                             truncated=truncated, total_sequences=int(total.sequences),
                             total_tokens=int(total.tokens), num_micro_batches=int(total.micro_batches))
        weight = metrics.pop("num_tokens").double() / max(int(total.tokens), 1)
        return LossOutput(loss, {k: v.double() * weight for k, v in metrics.items()})

    def _check(self, labels, advantages, old_log_probs, ref_log_probs, truncated) -> Tuple[torch.Tensor, torch.Tensor]:
        """Validates the call; returns the ``(B, S)`` advantages and the loss mask."""
        if labels.dim() != 2 or labels.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"labels must be (B, S) int64, got shape {tuple(labels.shape)} {labels.dtype}")
        b = labels.shape[0]
        if advantages.dim() == 1:
            advantages = advantages[:, None]
        if advantages.shape not in ((b, 1), labels.shape):
            raise ValueError(f"advantages must have shape ({b},) or {tuple(labels.shape)}, "
                             f"got {tuple(advantages.shape)}")
        for name, t in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs)):
            if t is not None and t.shape != labels.shape:
                raise ValueError(f"{name} must have the labels' shape {tuple(labels.shape)}, got {tuple(t.shape)}")
        if self.beta > 0 and ref_log_probs is None:
            raise ValueError(f"beta={self.beta} > 0 needs ref_log_probs (the reference policy's log-probs); "
                             f"pass them or set beta=0")
        if truncated is not None and truncated.shape != (b,):
            raise ValueError(f"truncated must have shape ({b},), got {tuple(truncated.shape)}")
        mask = self.loss_mask(labels, truncated)
        advantages = advantages.expand(labels.shape)
        # Only positions in the loss count: outside it, any value (NaN included) is ignored.
        bad = mask & ~torch.isfinite(advantages)
        n_bad = int(bad.sum())
        if n_bad:
            first = tuple(bad.nonzero()[0].tolist())
            raise ValueError(f"advantages contain NaN or inf at {n_bad} position(s) inside the loss mask, "
                             f"e.g. (row, position) {first}: {float(advantages[first])}; expected finite values")
        return advantages, mask

    # ------------------------------------------------------------------ loss
    def forward(
        self,
        outputs: ModelOutput,
        labels: torch.Tensor,
        advantages: torch.Tensor,
        *,
        old_log_probs: Optional[torch.Tensor] = None,
        ref_log_probs: Optional[torch.Tensor] = None,
        truncated: Optional[torch.Tensor] = None,
        total_sequences: Optional[int] = None,
        total_tokens: Optional[int] = None,
        num_micro_batches: int = 1,
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The micro-batch's share of the GRPO loss, and its metrics.

        Args:
            outputs (HeadInput): the policy's final hidden states ``(B, S, H)`` and head weight.
            labels (torch.Tensor): ``(B, S)`` shifted completion labels, ``ignore_index`` elsewhere.
            advantages (torch.Tensor): ``(B,)`` per completion or ``(B, S)`` per token.
            old_log_probs (Optional[torch.Tensor]): ``(B, S)`` log-probs of the policy that sampled
                (recomputed on the training path); None = the current ones detached (ratio 1, as
                with ``num_iterations == 1``).
            ref_log_probs (Optional[torch.Tensor]): ``(B, S)`` reference log-probs (needed if beta > 0).
            truncated (Optional[torch.Tensor]): ``(B,)`` bool completions without a stop token.
            total_sequences (Optional[int]): completions in the whole accumulated batch (default B).
            total_tokens (Optional[int]): loss tokens in the whole accumulated batch (default: this
                call's), see :meth:`num_loss_tokens`.
            num_micro_batches (int): micro-batches in the accumulated batch (``bnpo`` divides by it).

        Returns:
            Tuple[torch.Tensor, Dict[str, torch.Tensor]]: the scalar loss and detached metrics:
            ``kl`` (mean k3 per token, when a reference is given), ``clip_ratio/low``, ``/high``,
            ``/region`` (fractions of tokens), ``entropy`` (mean per token), ``num_tokens``.
        """
        head = as_head_input(outputs, type(self).__name__)
        advantages, mask = self._check(labels, advantages, old_log_probs, ref_log_probs, truncated)
        # The dtype the ops return log-probs in (float64 only for float64 reference inputs).
        dtype = torch.float64 if head.hidden.dtype == torch.float64 else torch.float32
        weights = self.token_weights(mask, total_sequences, total_tokens, num_micro_batches, dtype)
        # Outside the mask the advantage is 0 and (below) old = ref = the current log-prob: every
        # term there is exactly 0 BEFORE any arithmetic, whatever the caller's buffers hold
        # (-inf * 0 and exp(1e4) * 0 are NaN, and NaN would reach the gradients).
        advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
        if self.fused:
            loss, logp, ent = self._fused_loss(head, labels, mask, advantages, weights, old_log_probs,
                                               ref_log_probs)
        else:
            logp, ent = linear_log_probs(head.hidden, head.weight, labels, ignore_index=self.ignore_index,
                                         temperature=self.temperature, return_entropy=True,
                                         impl=self.impl, chunk_size=self.chunk_size,
                                         gemm_backend=self.gemm_backend)
        m = mask.to(logp.dtype)
        adv = advantages.to(logp.dtype)
        ref = None if ref_log_probs is None else masked_like(mask, ref_log_probs.to(logp.dtype), logp)
        # Metrics (and, unfused, the loss) from the per-token log-probs; fused they are detached.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.fused):
            old = logp.detach() if old_log_probs is None else masked_like(mask, old_log_probs.to(logp.dtype), logp)
            log_ratio = logp - old
            if self.importance_sampling_level == "sequence":
                seq_len = m.sum(dim=1).clamp(min=1)
                log_ratio = ((log_ratio * m).sum(dim=1) / seq_len)[:, None].expand_as(logp)
            per_token, ratio, kl = self.token_terms(logp, log_ratio, ent, ref, adv)
        if not self.fused:
            loss = (per_token * weights.to(logp.dtype)).sum()
        return loss, self._metrics(m, ratio, adv, kl, ent)

    def token_terms(self, logp, log_ratio, ent, ref, adv):
        """The per-token objective ``L_t`` (see the module docstring), shared by both paths.

        Args:
            logp (torch.Tensor): per-token log-probs (any shape).
            log_ratio (torch.Tensor): ``log(pi / pi_old)`` per token (token or sequence level).
            ent (Optional[torch.Tensor]): per-token entropy (needed when ``entropy_coef > 0``).
            ref (Optional[torch.Tensor]): reference log-probs, or None.
            adv (torch.Tensor): advantages, broadcastable to ``logp``.

        Returns:
            Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]: ``L_t``, the ratio and the k3
            KL estimate (None without ``ref``; added to ``L_t`` only when ``beta > 0``).
        """
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        kl = None
        if ref is not None:
            delta = ref - logp
            kl = torch.exp(delta) - delta - 1
            if self.beta > 0:
                per_token = per_token + self.beta * kl
        if self.entropy_coef > 0:
            per_token = per_token - self.entropy_coef * ent
        return per_token, ratio, kl

    def token_weights(self, mask, total_sequences=None, total_tokens=None, num_micro_batches=1,
                      dtype=torch.float32) -> torch.Tensor:
        """``(B, S)`` weights ``w`` with ``loss = sum(L_t * w_t)``: the loss_type's normalisation.

        Args:
            mask (torch.Tensor): ``(B, S)`` bool, see :meth:`loss_mask`.
            total_sequences, total_tokens, num_micro_batches: as in :meth:`forward`.
            dtype (torch.dtype): of the weights.

        Returns:
            torch.Tensor: ``(B, S)``, 0 outside the mask.
        """
        m = mask.to(dtype)
        total_sequences = m.shape[0] if total_sequences is None else total_sequences
        if self.loss_type == "grpo":  # per-sequence token mean, then mean over sequences
            return m / (m.sum(dim=1, keepdim=True).clamp(min=1) * total_sequences)
        if self.loss_type == "bnpo":
            return m / (m.sum().clamp(min=1) * num_micro_batches)
        if self.loss_type == "dr_grpo":
            return m / (total_sequences * self.max_completion_length)
        if total_tokens is None:
            return m / m.sum().clamp(min=1)
        return m / max(int(total_tokens), 1)

    def _fused_loss(self, head, labels, mask, advantages, weights, old_log_probs, ref_log_probs):
        objective = self.row_objective(advantages, weights, mask, old_log_probs, ref_log_probs)
        # Entropy always: the metrics report it (free in the Triton head's statistics).
        return linear_token_objective(head.hidden, head.weight, labels, objective,
                                      ignore_index=self.ignore_index, temperature=self.temperature,
                                      need_entropy=True, impl=self.impl, chunk_size=self.chunk_size,
                                      gemm_backend=self.gemm_backend)

    def row_objective(self, advantages: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor,
                      old_log_probs: Optional[torch.Tensor] = None,
                      ref_log_probs: Optional[torch.Tensor] = None) -> RowObjective:
        """The fused path's objective ``sum_t w_t L_t`` for ``linear_token_objective``.

        Its per-token constants are named (a :class:`~logitless.ops.RowObjective`), so that on CUDA
        the fused head replays one captured graph of it in every call with this loss's settings.

        Args:
            advantages (torch.Tensor): per-token advantages, the labels' shape (0 outside ``mask``).
            weights (torch.Tensor): per-token weights ``w`` (:meth:`token_weights`).
            mask (torch.Tensor): bool loss mask (:meth:`loss_mask`).
            old_log_probs, ref_log_probs (Optional[torch.Tensor]): as in :meth:`forward` (``ref``
                is read only with ``beta > 0``).

        Returns:
            RowObjective: ``f(logp, ent, rows)``.

        Example:
            >>> objective = loss_fn.row_objective(adv, loss_fn.token_weights(mask), mask, old)
            >>> loss, logp, ent = linear_token_objective(hidden, weight, labels, objective, need_entropy=True)
        """
        return RowObjective(
            self._row_objective,
            {"adv": advantages, "weight": weights, "mask": mask, "old": old_log_probs,
             "ref": ref_log_probs if self.beta > 0 else None},
            key=(self.epsilon, self.epsilon_high, self.beta, self.entropy_coef),
        )

    def _row_objective(self, lp, ent, c):
        """``sum_t w_t L_t`` of some rows from their log-probs, entropies and constants ``c``."""
        dt = lp.dtype
        # old absent: the current policy detached (ratio 1, gradient of the ratio 1); rows outside
        # the mask (truncated completions) see their own log-prob as old and ref, as unfused.
        old = lp.detach() if "old" not in c else masked_like(c["mask"], c["old"].to(dt), lp)
        ref = masked_like(c["mask"], c["ref"].to(dt), lp) if "ref" in c else None
        per_token, _, _ = self.token_terms(lp, lp - old, ent, ref, c["adv"].to(dt))
        return (per_token * c["weight"].to(dt)).sum()

    def _metrics(self, m, ratio, adv, kl, ent) -> Dict[str, torch.Tensor]:
        with torch.no_grad():
            n = m.sum().clamp(min=1)

            def mean(x: torch.Tensor) -> torch.Tensor:
                return torch.where(m > 0, x.to(m.dtype), 0.0).sum() / n

            # a token is clipped when the clip is active in the min (TRL's definition)
            low = (ratio < 1 - self.epsilon) & (adv < 0)
            high = (ratio > 1 + self.epsilon_high) & (adv > 0)
            out = {
                "clip_ratio/low": mean(low),
                "clip_ratio/high": mean(high),
                "clip_ratio/region": mean(low | high),
                "entropy": mean(ent.detach()),
                "num_tokens": m.sum().detach(),
            }
            if kl is not None:
                out["kl"] = mean(kl.detach())
            return out
