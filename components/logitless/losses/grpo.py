"""GRPO policy loss on per-token log-probs computed by the fused/chunked head (never full logits).

Protocol (as every logitless loss)::

    loss_fn = GRPOLoss(epsilon=0.2, beta=0.04, loss_type="dapo", temperature=0.7)
    loss_fn.set_model_output(policy)                  # policy now returns a HeadInput
    with torch.no_grad():                             # once per generation batch
        old = loss_fn.log_probs(policy(tokens, ...), labels)          # if loss_fn.needs_old_log_probs(...)
        ref = loss_fn.log_probs(reference(tokens, ...), labels)       # if beta > 0
    loss, metrics = loss_fn(policy(tokens, ...), labels, advantages,
                            old_log_probs=old, ref_log_probs=ref, sampler_log_probs=rollout_logp,
                            truncated=truncated, total_sequences=N,
                            total_tokens=loss_fn.num_loss_tokens(labels, truncated))
    loss.backward()

The training engine calls it through the loss contract (:class:`~logitless.losses._base.StepLoss`):
``loss_units(labels, truncated=...)`` counts a micro-batch, and ``normalised_loss(outputs, labels,
total, advantages=..., ...)`` passes the step's global ``total`` (tokens, sequences, micro-batches)
as the normalisers above and returns the metrics as shares of their global means
(``logitless.rl.update.grpo_update`` runs it through ``logitless.training.TrainStep``).

``labels`` are the shifted completion tokens with ``ignore_index`` at every other position (see
``logitless.rl.batch.policy_batch``); every per-token tensor has the labels' shape, so the same call
works whether the hidden states cover whole sequences or only completion positions.

Per token, with ``r = exp(logp - old)`` (token level) or ``exp(mean_t(logp - old))`` (sequence
level, GSPO), advantage ``A``, loss mask ``m``::

    L_t = g_t * P_t(r, A) + beta * KL_t

    P_t = -min(min(r, delta) A, clip(r, 1 - epsilon, 1 + epsilon_high) A)    grpo, bnpo, dr_grpo, dapo
        = -sg(min(r, epsilon_high)) * A * logp                               cispo (MiniMax-M1)
        = -sigmoid(tau (r - 1)) * 4 / tau * A,  tau = tau_pos if A > 0 else tau_neg     sapo
    KL_t = k1: logp - ref | k2: (logp - ref)^2 / 2 | k3: exp(ref - logp) - (ref - logp) - 1
           | low_var_kl: k3 clamped (verl); times r with use_bias_correction_kl (DeepSeek-V3.2)
    g_t  = the sampler-trainer importance weight (``sampler_correction``, from the sampler's
           log-probs of the sampled tokens) times the high-entropy token mask
           (``top_entropy_quantile``); 1 without them

(``delta`` None: no upper cap on ``r A``.) Reduction over the whole accumulated batch (``B_tot``
sequences, ``N_tot`` tokens, ``M`` micro-batches; each micro-batch call returns its share so that
the micro-batch losses add up to the batch loss):

- ``grpo``, ``sapo``:  sum_i mean_t(L_it) / B_tot            (per-sequence mean, then mean)
- ``bnpo``:            sum(L m) / sum(m)_micro-batch / M     (token mean per micro-batch)
- ``dr_grpo``:         sum(L m) / (B_tot * max_completion_length)
- ``dapo``, ``cispo``: sum(L m) / N_tot                      (token mean over the accumulated batch)

and the entropy bonus, the same for every ``loss_type``: ``- entropy_coef * sum(H e) / sum(e)`` over
the accumulated batch, ``e`` the tokens that carry the policy gradient (all loss tokens, or the
selected high-entropy ones).

Each normalisation and each ``g_t`` is a per-token constant known before the forward, so with
token-level ratios the loss is ``sum_t w_t L_t(logp_t) - c_t H_t``: a sum of per-token terms of
that token's log-prob and entropy. The fused path (``fused=True``, the default at token level) hands
it to ``logitless.ops.linear_token_objective`` as a :class:`~logitless.ops.RowObjective`, which
computes the head's gradients in its forward (three GEMMs instead of forward + recompute). Both
paths share :meth:`GRPOLoss.token_terms`.
"""

import math
from typing import Dict, Optional, Tuple

import torch

from logitless.losses._base import LossOutput, LossUnits, ModelOutput, StepLoss, as_head_input
from logitless.modules import HeadInput  # noqa: F401  (public in signatures / doctest)
from logitless.ops import RowObjective, _validate, linear_log_probs, linear_token_objective

#: Loss types whose policy term is the PPO clip (``delta`` applies to them).
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LOSS_TYPES = CLIP_LOSS_TYPES + ("cispo", "sapo")
IMPORTANCE_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: verl's clamps of the low-variance KL estimator: the log-ratio, then the estimate.
LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_CLAMP = 20.0, 10.0


def masked_like(mask: torch.Tensor, values: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``values`` inside ``mask``, the detached current log-prob outside: a log-ratio and a KL of 0
    there, computed from finite numbers whatever ``values`` holds outside the mask."""
    return torch.where(mask, values, logp.detach())


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class GRPOLoss(StepLoss):
    """Group-relative policy loss: PPO clip (GRPO, BNPO, Dr. GRPO, DAPO), CISPO and SAPO, with the
    sampler-trainer importance correction, high-entropy token selection and a choice of KL estimator.

    Args:
        epsilon (float): lower clip range, ratio clipped below at ``1 - epsilon``. Default 0.2.
        epsilon_high (Optional[float]): upper clip range (DAPO's clip-higher); ``epsilon`` if None.
            With ``loss_type="cispo"`` it is the cap of the importance weight itself (a ratio >= 1,
            5.0 in ScaleRL; TRL's meaning) and must be given.
        beta (float): weight of the KL to the reference policy; 0 disables it (no reference pass).
        loss_type (str): ``"grpo" | "bnpo" | "dr_grpo" | "dapo" | "cispo" | "sapo"``. Default
            ``"dapo"`` (as TRL). ``cispo`` normalises as ``dapo``, ``sapo`` as ``grpo`` (as TRL).
        entropy_coef (float): entropy bonus weight: the loss minus ``entropy_coef`` times the mean
            entropy per token of the accumulated batch, whatever the ``loss_type``. Default 0.
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
        delta (Optional[float]): INTELLECT-2's two-sided clip: the ratio is capped at ``delta``
            (> 1) before the min, so tokens with a negative advantage cannot push ``r A`` below
            ``delta A``. Clip loss types only. None (default): off.
        sapo_temperature_pos (float): SAPO's gate temperature for tokens with ``A > 0``. Default 1.0.
        sapo_temperature_neg (float): SAPO's gate temperature for tokens with ``A <= 0``. Default 1.05.
        kl_estimator (str): ``"k3"`` (default, TRL's), ``"k1"``, ``"k2"`` or ``"low_var_kl"``
            (k3 with its log-ratio clamped to +-20 and its value to +-10, verl's).
        use_bias_correction_kl (bool): multiply the KL estimate by the (differentiable) ratio
            ``r``, which makes its gradient the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's
            option of the same name, on by default there). Default False.
        top_entropy_quantile (float): keep the policy term only on the top ``q`` fraction of the
            batch's loss tokens by entropy ("Beyond the 80/20 rule"; 0.2 in the paper). The
            entropies come from the old-policy pass and the threshold is over the whole
            accumulated batch (``logitless.rl.update.grpo_update``; a direct call passes
            ``entropy_mask``). 1.0 (default): every token.
        sampler_correction (bool): weight the policy term by the importance ratio of the trainer's
            old log-probs to the sampler's log-probs of the sampled tokens, when the call passes
            ``sampler_log_probs`` (TRL's ``vllm_importance_sampling_correction``). Default True.
        sampler_correction_mode (str): ``"token_truncate"``, ``"token_mask"``,
            ``"sequence_truncate"`` or ``"sequence_mask"`` (default, as TRL): a weight per token or
            one per sequence (``exp`` of the summed log-ratio), clamped to the bounds
            (truncate) or set to 0 outside them (mask).
        sampler_correction_clip_max (Optional[float]): upper bound C of the importance weight.
            Default 3.0 (TRL's).
        sampler_correction_clip_min (Optional[float]): lower bound. Default None (none, as TRL).

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
        delta: Optional[float] = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        kl_estimator: str = "k3",
        use_bias_correction_kl: bool = False,
        top_entropy_quantile: float = 1.0,
        sampler_correction: bool = True,
        sampler_correction_mode: str = "sequence_mask",
        sampler_correction_clip_max: Optional[float] = 3.0,
        sampler_correction_clip_min: Optional[float] = None,
    ):
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if loss_type == "cispo" and (not _is_number(epsilon_high) or epsilon_high < 1):
            raise ValueError(f"epsilon_high is the cap of the importance weight with loss_type='cispo' (a ratio >= 1, "
                             f"e.g. 5.0 as in ScaleRL; TRL's meaning), got {epsilon_high!r}: set it explicitly")
        epsilon_high = epsilon if epsilon_high is None else epsilon_high
        for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high), ("beta", beta),
                            ("entropy_coef", entropy_coef)):
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name, value in (("sapo_temperature_pos", sapo_temperature_pos),
                            ("sapo_temperature_neg", sapo_temperature_neg)):
            if not _is_number(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if delta is not None:
            if loss_type not in CLIP_LOSS_TYPES:
                raise ValueError(f"delta caps the ratio of the clipped objective ({CLIP_LOSS_TYPES}); "
                                 f"loss_type={loss_type!r} has none: set delta=None")
            if not _is_number(delta) or delta <= 1:
                raise ValueError(f"delta must be None or a finite number > 1 (INTELLECT-2 uses 4), got {delta!r}")
        if importance_sampling_level not in IMPORTANCE_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_LEVELS}, "
                             f"got {importance_sampling_level!r}")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
        for name, value in (("use_bias_correction_kl", use_bias_correction_kl),
                            ("sampler_correction", sampler_correction),
                            ("mask_truncated_completions", mask_truncated_completions)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if not _is_number(top_entropy_quantile) or not 0 <= top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile must be a number in [0, 1] (1 keeps every token), "
                             f"got {top_entropy_quantile!r}")
        self._check_sampler_correction(sampler_correction_mode, sampler_correction_clip_min,
                                       sampler_correction_clip_max)
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
        self.delta = None if delta is None else float(delta)
        self.sapo_temperature_pos, self.sapo_temperature_neg = float(sapo_temperature_pos), float(sapo_temperature_neg)
        self.kl_estimator, self.use_bias_correction_kl = kl_estimator, use_bias_correction_kl
        self.top_entropy_quantile = float(top_entropy_quantile)
        self.sampler_correction, self.sampler_correction_mode = sampler_correction, sampler_correction_mode
        self.sampler_correction_clip_min = None if sampler_correction_clip_min is None else float(sampler_correction_clip_min)
        self.sampler_correction_clip_max = None if sampler_correction_clip_max is None else float(sampler_correction_clip_max)

    @staticmethod
    def _check_sampler_correction(mode, clip_min, clip_max) -> None:
        if mode not in SAMPLER_CORRECTION_MODES:
            raise ValueError(f"sampler_correction_mode must be one of {SAMPLER_CORRECTION_MODES}, got {mode!r}")
        for name, value in (("sampler_correction_clip_min", clip_min), ("sampler_correction_clip_max", clip_max)):
            if value is not None and (not _is_number(value) or value < 0):
                raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}")
        if clip_min is not None and clip_max is not None and clip_min >= clip_max:
            raise ValueError(f"sampler_correction_clip_min ({clip_min}) must be below sampler_correction_clip_max "
                             f"({clip_max})")
        if mode.endswith("truncate") and clip_min is None and clip_max is None:
            raise ValueError(f"sampler_correction_mode={mode!r} clamps the weight: set sampler_correction_clip_max "
                             f"and/or sampler_correction_clip_min")

    # ------------------------------------------------------------------ helpers
    def log_probs(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs at the sampling temperature (old / reference passes; no entropy).

        Args:
            outputs (HeadInput): the model's hidden states and head weight.
            labels (torch.Tensor): ``(B, S)`` shifted labels.

        Returns:
            torch.Tensor: ``(B, S)`` fp32, 0 at ignored positions.
        """
        return self.log_probs_and_entropy(outputs, labels, return_entropy=False)[0]

    def log_probs_and_entropy(self, outputs: ModelOutput, labels: torch.Tensor, *,
                              return_entropy: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Per-token log-probs and entropies at the sampling temperature, from one pass over the head
        (the old-policy pass when ``top_entropy_quantile < 1`` needs the entropies).

        Args:
            outputs (HeadInput): the model's hidden states and head weight.
            labels (torch.Tensor): ``(B, S)`` shifted labels.
            return_entropy (bool): also compute the entropy (else None).

        Returns:
            Tuple[torch.Tensor, Optional[torch.Tensor]]: ``(B, S)`` fp32 log-probs and entropies,
            0 at ignored positions.
        """
        head = as_head_input(outputs, type(self).__name__)
        return linear_log_probs(head.hidden, head.weight, labels, ignore_index=self.ignore_index,
                                temperature=self.temperature, return_entropy=return_entropy,
                                impl=self.impl, chunk_size=self.chunk_size,
                                gemm_backend=self.gemm_backend)

    def needs_old_log_probs(self, num_iterations: int, has_sampler_log_probs: bool) -> bool:
        """Whether an update must recompute old log-probs on the training path before its first step:
        for the clipped ratio (``num_iterations > 1``), for the sampler-trainer importance weight
        (``sampler_correction`` with the sampler's log-probs), or for the entropies of
        ``top_entropy_quantile < 1``."""
        return (num_iterations > 1 or (self.sampler_correction and has_sampler_log_probs)
                or self.top_entropy_quantile < 1)

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

    # ------------------------------------------------------- sampler correction and token selection
    def sampler_log_ratio(self, old_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
        """``log(pi_old / pi_sampler)`` of each sampled token: 0 outside ``mask`` (whatever the
        buffers hold there) and where the sampler's log-prob is NaN (unscored: ratio 1, as TRL).

        Args:
            old_log_probs (torch.Tensor): ``(B, S)`` the trainer's log-probs of the sampled tokens.
            sampler_log_probs (torch.Tensor): ``(B, S)`` the sampler's.
            mask (torch.Tensor): ``(B, S)`` bool loss mask.

        Returns:
            torch.Tensor: ``(B, S)`` in the dtype of ``old_log_probs`` (at least fp32).
        """
        dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
        diff = old_log_probs.to(dtype) - sampler_log_probs.to(dtype)
        return torch.where(mask & ~torch.isnan(diff), diff, torch.zeros_like(diff))

    def sampler_weights(self, log_ratio: torch.Tensor) -> torch.Tensor:
        """The importance weight of ``sampler_correction_mode`` from the per-token log-ratios.

        Args:
            log_ratio (torch.Tensor): ``(B, S)`` from :meth:`sampler_log_ratio` (0 outside the mask).

        Returns:
            torch.Tensor: ``(B, S)`` per token for ``token_*`` modes, ``(B, 1)`` per sequence
            (``exp`` of the sequence's summed log-ratio) for ``sequence_*`` modes.
        """
        mode, lo, hi = self.sampler_correction_mode, self.sampler_correction_clip_min, self.sampler_correction_clip_max
        if mode.startswith("sequence"):
            log_ratio = log_ratio.sum(dim=1, keepdim=True)
        ratio = torch.exp(log_ratio)
        if mode.endswith("truncate"):
            return torch.clamp(ratio, min=lo, max=hi)
        outside = torch.zeros_like(ratio, dtype=torch.bool)
        if lo is not None:
            outside = outside | (ratio < lo)
        if hi is not None:
            outside = outside | (ratio > hi)
        return torch.where(outside, torch.zeros_like(ratio), ratio)

    def entropy_threshold(self, entropies: torch.Tensor) -> torch.Tensor:
        """The ``1 - top_entropy_quantile`` quantile of the loss tokens' entropies (linear
        interpolation, as ``torch.quantile``, in fp32 as TRL), at any size.

        Args:
            entropies (torch.Tensor): 1-D, every loss token of the accumulated batch (all ranks).

        Returns:
            torch.Tensor: 0-dim fp32 threshold (``inf`` when there is no token: none selected).
        """
        values = entropies.reshape(-1).float()
        n = values.numel()
        if n == 0:
            return torch.full((), float("inf"), device=values.device)
        ordered = values.sort().values
        # torch.quantile's arithmetic (the rank in fp32), which refuses inputs above 2**24 values
        rank = torch.tensor(1.0 - self.top_entropy_quantile, dtype=torch.float32, device=values.device) * (n - 1)
        below, above = rank.long(), rank.ceil().long()
        return torch.lerp(ordered[below], ordered[above], rank - below)

    def high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor,
                          threshold: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``(B, S)`` bool: loss tokens whose entropy is at least the threshold.

        Args:
            entropies (torch.Tensor): ``(B, S)`` per-token entropies (the old policy's).
            mask (torch.Tensor): ``(B, S)`` bool loss mask.
            threshold (Optional[torch.Tensor]): from :meth:`entropy_threshold` over the whole
                accumulated batch; None: over this call's loss tokens.

        Returns:
            torch.Tensor: ``(B, S)`` bool, False outside ``mask``.

        Example:
            >>> keep = loss_fn.high_entropy_mask(ent, loss_fn.loss_mask(labels))   # top 20% with q=0.2
        """
        if threshold is None:
            threshold = self.entropy_threshold(entropies[mask])
        return (entropies >= threshold.to(entropies.device)) & mask

    def policy_weights(self, mask: torch.Tensor, old_log_probs: Optional[torch.Tensor] = None,
                       sampler_log_probs: Optional[torch.Tensor] = None,
                       entropy_mask: Optional[torch.Tensor] = None,
                       dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
        """``g_t`` of the module docstring: the sampler importance weight times the entropy mask.

        Args:
            mask (torch.Tensor): ``(B, S)`` bool loss mask.
            old_log_probs, sampler_log_probs (Optional[torch.Tensor]): ``(B, S)``; the weight is
                applied when ``sampler_correction`` is on and the sampler's log-probs are given.
            entropy_mask (Optional[torch.Tensor]): ``(B, S)`` bool, :meth:`high_entropy_mask`.
            dtype (torch.dtype): of the result.

        Returns:
            Optional[torch.Tensor]: ``(B, S)``, finite everywhere; None when neither applies.
        """
        weight = None
        if self.sampler_correction and sampler_log_probs is not None:
            if old_log_probs is None:
                raise ValueError("sampler_log_probs with sampler_correction=True needs old_log_probs: the trainer's "
                                 "log-probs of the sampled tokens, recomputed on the training path before the update "
                                 "(GRPOLoss.needs_old_log_probs); pass them or set sampler_correction=False")
            ratio = self.sampler_weights(self.sampler_log_ratio(old_log_probs, sampler_log_probs, mask))
            weight = ratio.to(dtype).expand(mask.shape)
        if entropy_mask is not None:
            keep = (entropy_mask & mask).to(dtype)
            weight = keep if weight is None else weight * keep
        return weight

    def _check(self, labels, advantages, old_log_probs, ref_log_probs, truncated, sampler_log_probs=None,
               entropy_mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Validates the call; returns the ``(B, S)`` advantages and the loss mask."""
        if labels.dim() != 2 or labels.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"labels must be (B, S) int64, got shape {tuple(labels.shape)} {labels.dtype}")
        b = labels.shape[0]
        if advantages.dim() == 1:
            advantages = advantages[:, None]
        if advantages.shape not in ((b, 1), labels.shape):
            raise ValueError(f"advantages must have shape ({b},) or {tuple(labels.shape)}, "
                             f"got {tuple(advantages.shape)}")
        for name, t in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs),
                        ("sampler_log_probs", sampler_log_probs), ("entropy_mask", entropy_mask)):
            if t is not None and t.shape != labels.shape:
                raise ValueError(f"{name} must have the labels' shape {tuple(labels.shape)}, got {tuple(t.shape)}")
        if entropy_mask is not None and entropy_mask.dtype != torch.bool:
            raise ValueError(f"entropy_mask must be a bool tensor (GRPOLoss.high_entropy_mask), got {entropy_mask.dtype}")
        if self.beta > 0 and ref_log_probs is None:
            raise ValueError(f"beta={self.beta} > 0 needs ref_log_probs (the reference policy's log-probs); "
                             f"pass them or set beta=0")
        if truncated is not None and truncated.shape != (b,):
            raise ValueError(f"truncated must have shape ({b},), got {tuple(truncated.shape)}")
        mask = self.loss_mask(labels, truncated)
        advantages = advantages.expand(labels.shape)
        # Only positions in the loss count: outside it, any value (NaN included) is ignored.
        checked = [(name, values) for name, values in (("advantages", advantages), ("sampler_log_probs",
                                                                                    sampler_log_probs))
                   if values is not None]
        bad = [mask & ~torch.isfinite(values) for _, values in checked]
        counts = torch.stack([where.sum() for where in bad]).tolist()  # one host sync for every check
        for (name, values), where, n_bad in zip(checked, bad, counts):
            if n_bad:
                first = tuple(where.nonzero()[0].tolist())
                raise ValueError(f"{name} contain NaN or inf at {n_bad} position(s) inside the loss mask, "
                                 f"e.g. (row, position) {first}: {float(values[first])}; expected finite values")
        return advantages, mask

    def normalised_loss(self, outputs: ModelOutput, labels: torch.Tensor, total: LossUnits, *,
                        advantages: torch.Tensor, **inputs) -> LossOutput:
        """This micro-batch's share of the step's loss (the loss contract of the training engine).

        Args:
            outputs, labels, advantages: as in :meth:`forward`.
            total (LossUnits): the whole step's counts, over every micro-batch and rank: the
                ``total_tokens``, ``total_sequences`` and ``num_micro_batches`` of :meth:`forward`.
            **inputs: the other per-micro-batch inputs of :meth:`forward` (``old_log_probs``,
                ``ref_log_probs``, ``sampler_log_probs``, ``entropy_mask``, ``total_selected_tokens``,
                ``truncated``).

        Returns:
            LossOutput: the loss share of :meth:`forward`; its metrics (``num_tokens`` aside), each a
            share in float64: ``metric * num_tokens / total.tokens`` for token means,
            ``metric * B / total.sequences`` for the sequence means (clip ratios of
            sequence-level ratios with per-completion advantages).
        """
        loss, metrics, per_sequence = self._loss_and_metrics(
            outputs, labels, advantages, total_sequences=int(total.sequences), total_tokens=int(total.tokens),
            num_micro_batches=int(total.micro_batches), **inputs)
        by_tokens = metrics.pop("num_tokens").double() / max(int(total.tokens), 1)
        by_sequences = labels.shape[0] / max(int(total.sequences), 1)
        return LossOutput(loss, {k: v.double() * (by_sequences if k in per_sequence else by_tokens)
                                 for k, v in metrics.items()})

    # ------------------------------------------------------------------ loss
    def forward(
        self,
        outputs: ModelOutput,
        labels: torch.Tensor,
        advantages: torch.Tensor,
        *,
        old_log_probs: Optional[torch.Tensor] = None,
        ref_log_probs: Optional[torch.Tensor] = None,
        sampler_log_probs: Optional[torch.Tensor] = None,
        entropy_mask: Optional[torch.Tensor] = None,
        total_selected_tokens: Optional[int] = None,
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
            sampler_log_probs (Optional[torch.Tensor]): ``(B, S)`` the sampler's log-probs of the
                sampled tokens (``Rollout.sampler_log_probs``): with ``sampler_correction`` the
                policy term is weighted by their importance ratio to ``old_log_probs`` (required
                then). Must be finite inside the loss mask.
            entropy_mask (Optional[torch.Tensor]): ``(B, S)`` bool, the tokens that keep the policy
                term (:meth:`high_entropy_mask` over the accumulated batch); None: every token.
            total_selected_tokens (Optional[int]): loss tokens of the accumulated batch inside
                ``entropy_mask`` (the entropy bonus's normaliser; default: ``total_tokens``
                without an entropy mask, this call's count with one).
            truncated (Optional[torch.Tensor]): ``(B,)`` bool completions without a stop token.
            total_sequences (Optional[int]): completions in the whole accumulated batch (default B).
            total_tokens (Optional[int]): loss tokens in the whole accumulated batch (default: this
                call's), see :meth:`num_loss_tokens`.
            num_micro_batches (int): micro-batches in the accumulated batch (``bnpo`` divides by it).

        Returns:
            Tuple[torch.Tensor, Dict[str, torch.Tensor]]: the scalar loss and detached metrics:
            ``kl`` (mean KL estimate per token, when a reference is given), ``clip_ratio/low``,
            ``/high``, ``/region`` (clip loss types: fractions of tokens, or of completions for
            sequence-level ratios with per-completion advantages, as TRL), ``cispo_clip_ratio``
            (``cispo``), ``entropy`` (mean per token), ``num_tokens``.
        """
        loss, metrics, _ = self._loss_and_metrics(
            outputs, labels, advantages, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
            sampler_log_probs=sampler_log_probs, entropy_mask=entropy_mask,
            total_selected_tokens=total_selected_tokens, truncated=truncated, total_sequences=total_sequences,
            total_tokens=total_tokens, num_micro_batches=num_micro_batches)
        return loss, metrics

    def _loss_and_metrics(self, outputs, labels, advantages, *, old_log_probs=None, ref_log_probs=None,
                          sampler_log_probs=None, entropy_mask=None, total_selected_tokens=None, truncated=None,
                          total_sequences=None, total_tokens=None, num_micro_batches=1):
        head = as_head_input(outputs, type(self).__name__)
        # one advantage per completion: the raw (B,) values, for the per-completion clip metrics
        row_adv = advantages.reshape(-1) if advantages.dim() == 1 or advantages.shape[-1] == 1 else None
        advantages, mask = self._check(labels, advantages, old_log_probs, ref_log_probs, truncated,
                                       sampler_log_probs, entropy_mask)
        # The dtype the ops return log-probs in (float64 only for float64 reference inputs).
        dtype = torch.float64 if head.hidden.dtype == torch.float64 else torch.float32
        weights = self.token_weights(mask, total_sequences, total_tokens, num_micro_batches, dtype)
        policy_weight = self.policy_weights(mask, old_log_probs, sampler_log_probs, entropy_mask, dtype)
        entropy_weight = None
        if self.entropy_coef > 0:
            selected = mask if entropy_mask is None else mask & entropy_mask
            count = total_tokens if entropy_mask is None else total_selected_tokens
            entropy_weight = selected.to(dtype) / (selected.sum().clamp(min=1) if count is None else max(int(count), 1))
        # Outside the mask the advantage is 0 and (below) old = ref = the current log-prob: every
        # term there is exactly 0 BEFORE any arithmetic, whatever the caller's buffers hold
        # (-inf * 0 and exp(1e4) * 0 are NaN, and NaN would reach the gradients).
        advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
        if self.fused:
            objective = self.row_objective(advantages, weights, mask, old_log_probs, ref_log_probs,
                                           policy_weight=policy_weight, entropy_weight=entropy_weight)
            # Entropy always: the metrics report it (free in the Triton head's statistics).
            loss, logp, ent = linear_token_objective(
                head.hidden, head.weight, labels, objective, ignore_index=self.ignore_index,
                temperature=self.temperature, need_entropy=True, impl=self.impl, chunk_size=self.chunk_size,
                gemm_backend=self.gemm_backend)
        else:
            logp, ent = linear_log_probs(head.hidden, head.weight, labels, ignore_index=self.ignore_index,
                                         temperature=self.temperature, return_entropy=True,
                                         impl=self.impl, chunk_size=self.chunk_size,
                                         gemm_backend=self.gemm_backend)
        m = mask.to(logp.dtype)
        adv = advantages.to(logp.dtype)
        ref = None if ref_log_probs is None else masked_like(mask, ref_log_probs.to(logp.dtype), logp)
        pw = None if policy_weight is None else policy_weight.to(logp.dtype)
        # Metrics (and, unfused, the loss) from the per-token log-probs; fused they are detached.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.fused):
            old = logp.detach() if old_log_probs is None else masked_like(mask, old_log_probs.to(logp.dtype), logp)
            log_ratio = logp - old
            sequence_level = self.importance_sampling_level == "sequence"
            if sequence_level:
                seq_len = m.sum(dim=1).clamp(min=1)
                log_ratio = ((log_ratio * m).sum(dim=1) / seq_len)[:, None].expand_as(logp)
            per_token, ratio, kl = self.token_terms(logp, log_ratio, ref, adv, pw)
        if not self.fused:
            loss = (per_token * weights.to(logp.dtype)).sum()
            if entropy_weight is not None:
                loss = loss - self.entropy_coef * (ent * entropy_weight.to(logp.dtype)).sum()
        if sequence_level and row_adv is not None:
            # a completion without loss tokens has ratio 1 and may hold any advantage (NaN included)
            row_adv = torch.where(torch.isfinite(row_adv), row_adv, torch.zeros_like(row_adv)).to(logp.dtype)
            metrics = self._metrics(m, ratio[:, :1], row_adv[:, None], kl, ent, per_sequence=True)
            return loss, metrics, self._ratio_metric_names()
        return loss, self._metrics(m, ratio, adv, kl, ent), ()

    def token_terms(self, logp, log_ratio, ref, adv, policy_weight=None):
        """The per-token objective ``L_t`` without the entropy bonus (see the module docstring),
        shared by both paths.

        Args:
            logp (torch.Tensor): per-token log-probs (any shape).
            log_ratio (torch.Tensor): ``log(pi / pi_old)`` per token (token or sequence level).
            ref (Optional[torch.Tensor]): reference log-probs, or None.
            adv (torch.Tensor): advantages, broadcastable to ``logp``.
            policy_weight (Optional[torch.Tensor]): ``g_t`` (:meth:`policy_weights`), or None.

        Returns:
            Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]: ``L_t``, the ratio ``r`` and
            the KL estimate (None without ``ref``; added to ``L_t`` only when ``beta > 0``).
        """
        ratio = torch.exp(log_ratio)
        if self.loss_type == "cispo":
            # MiniMax-M1: the clipped weight is a constant; the gradient flows through logp only.
            per_token = -torch.clamp(ratio, max=self.epsilon_high).detach() * adv * logp
        elif self.loss_type == "sapo":
            tau = torch.where(adv > 0, torch.full_like(ratio, self.sapo_temperature_pos),
                              torch.full_like(ratio, self.sapo_temperature_neg))
            per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
        else:
            capped = ratio if self.delta is None else torch.clamp(ratio, max=self.delta)
            clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
            per_token = -torch.min(capped * adv, clipped * adv)
        if policy_weight is not None:
            per_token = per_token * policy_weight
        kl = None
        if ref is not None:
            kl = self.kl_terms(logp, ref, ratio)
            if self.beta > 0:
                per_token = per_token + self.beta * kl
        return per_token, ratio, kl

    def kl_terms(self, logp: torch.Tensor, ref: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
        """The per-token estimate of ``KL(pi || ref)`` of ``kl_estimator`` (times ``ratio`` with
        ``use_bias_correction_kl``)."""
        if self.kl_estimator == "k1":
            kl = logp - ref
        elif self.kl_estimator == "k2":
            kl = 0.5 * (logp - ref) ** 2
        elif self.kl_estimator == "k3":
            delta = ref - logp
            kl = torch.exp(delta) - delta - 1
        else:
            delta = torch.clamp(ref - logp, -LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
            kl = torch.clamp(torch.exp(delta) - delta - 1, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
        return kl * ratio if self.use_bias_correction_kl else kl

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
        if self.loss_type in ("grpo", "sapo"):  # per-sequence token mean, then mean over sequences
            return m / (m.sum(dim=1, keepdim=True).clamp(min=1) * total_sequences)
        if self.loss_type == "bnpo":
            return m / (m.sum().clamp(min=1) * num_micro_batches)
        if self.loss_type == "dr_grpo":
            return m / (total_sequences * self.max_completion_length)
        if total_tokens is None:
            return m / m.sum().clamp(min=1)
        return m / max(int(total_tokens), 1)

    def row_objective(self, advantages: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor,
                      old_log_probs: Optional[torch.Tensor] = None,
                      ref_log_probs: Optional[torch.Tensor] = None, *,
                      policy_weight: Optional[torch.Tensor] = None,
                      entropy_weight: Optional[torch.Tensor] = None) -> RowObjective:
        """The fused path's objective ``sum_t w_t L_t - c_t H_t`` for ``linear_token_objective``.

        Its per-token constants are named (a :class:`~logitless.ops.RowObjective`), so that on CUDA
        the fused head replays one captured graph of it in every call with this loss's settings.
        Every term is a function of the token's own log-prob and entropy and of constants: the
        importance weight and the entropy mask come in folded into ``policy_weight``.

        Args:
            advantages (torch.Tensor): per-token advantages, the labels' shape (0 outside ``mask``).
            weights (torch.Tensor): per-token weights ``w`` (:meth:`token_weights`).
            mask (torch.Tensor): bool loss mask (:meth:`loss_mask`).
            old_log_probs, ref_log_probs (Optional[torch.Tensor]): as in :meth:`forward` (``ref``
                is read only with ``beta > 0``).
            policy_weight (Optional[torch.Tensor]): ``g_t`` (:meth:`policy_weights`), or None.
            entropy_weight (Optional[torch.Tensor]): the entropy bonus's per-token weight ``c_t /
                entropy_coef`` (1 / the selected tokens of the batch on each of them), or None.

        Returns:
            RowObjective: ``f(logp, ent, rows)``.

        Example:
            >>> objective = loss_fn.row_objective(adv, loss_fn.token_weights(mask), mask, old)
            >>> loss, logp, ent = linear_token_objective(hidden, weight, labels, objective, need_entropy=True)
        """
        return RowObjective(
            self._row_objective,
            {"adv": advantages, "weight": weights, "mask": mask, "old": old_log_probs,
             "ref": ref_log_probs if self.beta > 0 else None, "policy_weight": policy_weight,
             "entropy_weight": entropy_weight if self.entropy_coef > 0 else None},
            key=(self.loss_type, self.epsilon, self.epsilon_high, self.delta, self.beta, self.kl_estimator,
                 self.use_bias_correction_kl, self.sapo_temperature_pos, self.sapo_temperature_neg,
                 self.entropy_coef),
        )

    def _row_objective(self, lp, ent, c):
        """``sum_t w_t L_t - c_t H_t`` of some rows from their log-probs, entropies and constants ``c``."""
        dt = lp.dtype
        # old absent: the current policy detached (ratio 1, gradient of the ratio 1); rows outside
        # the mask (truncated completions) see their own log-prob as old and ref, as unfused.
        old = lp.detach() if "old" not in c else masked_like(c["mask"], c["old"].to(dt), lp)
        ref = masked_like(c["mask"], c["ref"].to(dt), lp) if "ref" in c else None
        pw = c["policy_weight"].to(dt) if "policy_weight" in c else None
        per_token, _, _ = self.token_terms(lp, lp - old, ref, c["adv"].to(dt), pw)
        value = (per_token * c["weight"].to(dt)).sum()
        if "entropy_weight" in c:
            value = value - self.entropy_coef * (ent * c["entropy_weight"].to(dt)).sum()
        return value

    def _ratio_metric_names(self) -> Tuple[str, ...]:
        if self.loss_type == "cispo":
            return ("cispo_clip_ratio",)
        if self.loss_type == "sapo":
            return ()
        return ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region")

    def _metrics(self, m, ratio, adv, kl, ent, per_sequence=False) -> Dict[str, torch.Tensor]:
        """Detached metrics; ``per_sequence``: ``ratio`` and ``adv`` are ``(B, 1)``, one per
        completion, and the ratio metrics average over every completion of the batch (TRL's
        definition for sequence-level ratios), the others over tokens."""
        with torch.no_grad():
            n = m.sum().clamp(min=1)

            def mean(x: torch.Tensor) -> torch.Tensor:
                return torch.where(m > 0, x.to(m.dtype), 0.0).sum() / n

            def ratio_mean(x: torch.Tensor) -> torch.Tensor:
                return x.to(m.dtype).mean() if per_sequence else mean(x)

            out = {"entropy": mean(ent.detach()), "num_tokens": m.sum().detach()}
            ratio = ratio.detach()
            # a token is clipped when the clip is active in the min (TRL's definition)
            if self.loss_type == "cispo":
                out["cispo_clip_ratio"] = ratio_mean((ratio > self.epsilon_high) & (adv > 0))
            elif self.loss_type != "sapo":
                capped = ratio if self.delta is None else torch.clamp(ratio, max=self.delta)
                low = (capped < 1 - self.epsilon) & (adv < 0)
                high = (capped > 1 + self.epsilon_high) & (adv > 0)
                out.update({"clip_ratio/low": ratio_mean(low), "clip_ratio/high": ratio_mean(high),
                            "clip_ratio/region": ratio_mean(low | high)})
            if kl is not None:
                out["kl"] = mean(kl.detach())
            return out
