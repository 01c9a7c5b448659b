"""The rollout metrics a GRPO step logs: rewards per function, completion lengths, truncation, the
sampler-trainer mismatch of the sampled tokens' log-probs, and the model FLOPs of the update (for its
MFU).

Computed from the whole step's rollout (on several ranks, from the gathered per-completion values or
reduced sums), so a data-parallel run logs the same numbers as one device sampling the same
completions.
"""

from typing import Callable, Dict, Optional

import torch

from logitless.training.flops import DecoderFlops, causal_pairs


def rollout_metrics(rewards: Dict[str, torch.Tensor], lengths: torch.Tensor,
                    truncated: torch.Tensor) -> Dict[str, float]:
    """Mean and std of every reward, completion length mean / max, truncated fraction.

    Args:
        rewards (Dict[str, torch.Tensor]): ``{name: (N,)}`` from ``compute_rewards`` (``"total"``
            is the weighted sum, logged as ``reward/mean`` and ``reward/std``).
        lengths (torch.Tensor): ``(N,)`` completion lengths in tokens.
        truncated (torch.Tensor): ``(N,)`` bool, completions without a stop token.

    Returns:
        Dict[str, float]: ``reward/mean``, ``reward/std``, ``reward/<name>/mean|std``,
        ``completion_length/mean|max``, ``truncated_fraction``.

    Example:
        >>> rollout_metrics({"total": torch.tensor([1.0, 0.0])}, torch.tensor([3, 5]),
        ...                 torch.tensor([False, True]))["completion_length/mean"]
        4.0
    """
    out: Dict[str, float] = {}
    for name, values in rewards.items():
        prefix = "reward" if name == "total" else f"reward/{name}"
        out[f"{prefix}/mean"] = float(values.mean())
        out[f"{prefix}/std"] = float(values.std())
    lengths = lengths.float()
    out.update({"completion_length/mean": float(lengths.mean()), "completion_length/max": float(lengths.max()),
                "truncated_fraction": float(truncated.float().mean())})
    return out


#: Per-trajectory columns of a multi-turn rollout (:func:`turn_columns`), gathered like the rewards.
TURN_COLUMNS = ("turns", "tool_calls", "tool_errors", "environment_errors", "tool_seconds", "sampled_tokens")


def turn_columns(rollout) -> Dict[str, torch.Tensor]:
    """``{name: (N,)}`` of :data:`TURN_COLUMNS` for a multi-turn rollout (empty for one turn).

    Args:
        rollout (Rollout): from a sampler; ``trajectories`` set by the turn sampler.

    Returns:
        Dict[str, torch.Tensor]: model turns, tool calls, tool errors, environment errors, tool
        seconds and the tokens the policy sampled, per trajectory.
    """
    if rollout.trajectories is None:
        return {}
    t = rollout.trajectories
    return {"turns": torch.tensor([float(x.turns) for x in t]),
            "tool_calls": torch.tensor([float(x.tool_calls) for x in t]),
            "tool_errors": torch.tensor([float(x.tool_errors) for x in t]),
            "environment_errors": torch.tensor([float(x.environment_errors) for x in t]),
            "tool_seconds": torch.tensor([float(x.tool_seconds) for x in t]),
            "sampled_tokens": rollout.loss_mask.sum(1).float().cpu()}


def turn_metrics(columns: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """The logged metrics of gathered :func:`turn_columns` (the whole batch).

    Returns:
        Dict[str, float]: ``turns/mean|max``, ``tools/calls_per_row``, ``tools/errors_per_row``,
        ``tools/error_rate`` (errors per call; 0 without calls), ``tools/environment_errors`` (total),
        ``tools/seconds_per_row`` (environment step time), ``tools/seconds_total``,
        ``sampled_tokens/mean`` (the policy's own tokens; the rest of ``completion_length`` is context).

    Example:
        >>> turn_metrics({"turns": torch.tensor([1., 3.]), "tool_calls": torch.tensor([0., 2.]),
        ...               "tool_errors": torch.tensor([0., 1.]), "environment_errors": torch.zeros(2),
        ...               "tool_seconds": torch.tensor([0., .5]), "sampled_tokens": torch.tensor([4., 9.])}
        ...              )["tools/error_rate"]
        0.5
    """
    if not columns:
        return {}
    calls = float(columns["tool_calls"].sum())
    return {"turns/mean": float(columns["turns"].mean()), "turns/max": float(columns["turns"].max()),
            "tools/calls_per_row": float(columns["tool_calls"].mean()),
            "tools/errors_per_row": float(columns["tool_errors"].mean()),
            "tools/error_rate": float(columns["tool_errors"].sum()) / calls if calls else 0.0,
            "tools/environment_errors": float(columns["environment_errors"].sum()),
            "tools/seconds_per_row": float(columns["tool_seconds"].mean()),
            "tools/seconds_total": float(columns["tool_seconds"].sum()),
            "sampled_tokens/mean": float(columns["sampled_tokens"].mean())}


def gather_columns(columns: Dict[str, torch.Tensor], all_gather: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Dict[str, torch.Tensor]:
    """Every rank's per-completion values, in batch order, with one collective for all columns.

    Args:
        columns (Dict[str, torch.Tensor]): ``{name: (n,)}`` for this rank's completions.
        all_gather (Callable): ``Runtime.all_gather`` (concatenates the ranks' rows in rank order).

    Returns:
        Dict[str, torch.Tensor]: ``{name: (N,)}`` float32 on the CPU, N completions over all ranks.

    Example:
        >>> gather_columns({"total": torch.tensor([1.0, 0.0])}, lambda t: t)["total"]
        tensor([1., 0.])
    """
    names = list(columns)
    table = all_gather(torch.stack([columns[k].float().cpu() for k in names], dim=1))
    return {k: table[:, i] for i, k in enumerate(names)}


def sampler_mismatch_metrics(trainer_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, mask: torch.Tensor,
                             loss_fn, all_reduce: Optional[Callable[..., torch.Tensor]] = None) -> Dict[str, float]:
    """How far the sampler's distribution is from the trainer's on the sampled tokens.

    With ``d = log pi_trainer(y) - log pi_sampler(y)`` per sampled token (inside ``mask``; a NaN
    sampler log-prob counts as ``d = 0``, as the importance weight treats it):

    - ``sampling/logp_difference/mean|max``: mean and max of ``|d|``;
    - ``sampling/kl``: the k3 estimate of ``KL(pi_sampler || pi_trainer)`` from the sampler's own
      samples, the mean of ``exp(d) - 1 - d`` (>= 0, 0 when the two agree);
    - ``sampling/ratio_outside_cap``: the fraction of tokens whose ratio ``exp(d)`` leaves
      ``[1/C, C]`` (``[clip_min, C]`` when ``loss_fn.sampler_correction_clip_min`` is set; C its
      ``sampler_correction_clip_max``, no upper bound when None);
    - with ``loss_fn.sampler_correction`` on, ``sampling/importance_sampling_ratio/min|mean|max``:
      the weights the loss applies (after truncation or masking), over tokens for ``token_*``
      modes and over completions for ``sequence_*`` modes (TRL's metrics of the same names).

    Args:
        trainer_log_probs (torch.Tensor): ``(N, T)`` old log-probs recomputed on the training path.
        sampler_log_probs (torch.Tensor): ``(N, T)`` the sampler's (``Rollout.sampler_log_probs``).
        mask (torch.Tensor): ``(N, T)`` bool loss mask (``GRPOLoss.loss_mask``).
        loss_fn (GRPOLoss): gives the correction's mode and bounds.
        all_reduce (Optional[Callable]): ``Runtime.all_reduce`` (``f(tensor, op)``, ``"sum"`` or
            ``"max"``) over data-parallel ranks; None on one device.

    Returns:
        Dict[str, float]: the metrics above (means over every rank's tokens); {} when no token.

    Example:
        >>> sampler_mismatch_metrics(old, rollout.sampler_log_probs, loss_fn.loss_mask(labels), loss_fn)
    """
    reduce = all_reduce or (lambda t, op="sum": t)
    with torch.no_grad():
        d = loss_fn.sampler_log_ratio(trainer_log_probs, sampler_log_probs, mask).double()
        m = mask.to(d.dtype)
        ratio = torch.exp(d)
        hi = loss_fn.sampler_correction_clip_max
        lo = loss_fn.sampler_correction_clip_min if loss_fn.sampler_correction_clip_min is not None else (
            1.0 / hi if hi else None)
        outside = torch.zeros_like(mask)
        if hi is not None:
            outside = outside | (ratio > hi)
        if lo is not None:
            outside = outside | (ratio < lo)
        sums = [m.sum(), (d.abs() * m).sum(), ((ratio - 1 - d) * m).sum(), (outside & mask).to(d.dtype).sum()]
        maxes = [torch.where(mask, d.abs(), 0.0).max() if d.numel() else d.new_zeros(())]
        correct = loss_fn.sampler_correction
        if correct:
            weights = loss_fn.sampler_weights(d).double()
            per_sequence = weights.shape[1] == 1 and loss_fn.sampler_correction_mode.startswith("sequence")
            wm = torch.ones_like(weights, dtype=torch.bool) if per_sequence else mask
            sums += [wm.to(d.dtype).sum(), torch.where(wm, weights, 0.0).sum()]
            maxes += [torch.where(wm, weights, -torch.inf).max(), torch.where(wm, -weights, -torch.inf).max()]
        sums = reduce(torch.stack(sums), "sum").tolist()
        maxes = reduce(torch.stack(maxes), "max").tolist()
    if sums[0] == 0:
        return {}
    out = {"sampling/logp_difference/mean": sums[1] / sums[0], "sampling/logp_difference/max": maxes[0],
           "sampling/kl": sums[2] / sums[0], "sampling/ratio_outside_cap": sums[3] / sums[0]}
    if correct:
        out.update({"sampling/importance_sampling_ratio/min": -maxes[2],
                    "sampling/importance_sampling_ratio/mean": sums[5] / max(sums[4], 1.0),
                    "sampling/importance_sampling_ratio/max": maxes[1]})
    return out


def update_flops(flops: "DecoderFlops", prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor, *,
                 group_size: int, prompt_once: bool, num_iterations: int, reference: bool,
                 old_pass: Optional[bool] = None) -> float:
    """Model FLOPs of one GRPO update (:func:`logitless.rl.update.grpo_update`) on a rollout.

    Counted on the real tokens of each row (padding is not model work), with the convention of
    :mod:`logitless.training.flops`: ``num_iterations`` forward + backward passes of the policy
    (the head on the completion positions only, as the response-only head runs), plus one
    forward-only pass for the old log-probs when the update recomputes them and one for the reference
    log-probs (a frozen copy, or the LoRA policy with its adapters off: counted as the policy's
    forward). With ``prompt_once`` a group's prompt goes through the layers once and its
    completions attend to it.

    Args:
        flops (DecoderFlops): the policy's counts.
        prompt_lengths (torch.Tensor): ``(N,)`` prompt tokens of each completion's row.
        completion_lengths (torch.Tensor): ``(N,)`` completion tokens.
        group_size (int): completions per prompt (G); groups are contiguous rows.
        prompt_once (bool): the update packs each group's prompt once (prompt sharing).
        num_iterations (int): optimizer steps on the batch.
        reference (bool): reference log-probs are computed (KL term).
        old_pass (Optional[bool]): old log-probs are recomputed before the first step
            (``GRPOLoss.needs_old_log_probs``); None: when ``num_iterations > 1``.

    Returns:
        float: FLOPs of the update.

    Example:
        >>> update_flops(DecoderFlops(model), torch.tensor([4, 4]), torch.tensor([2, 3]), group_size=2,
        ...              prompt_once=False, num_iterations=1, reference=False)
    """
    p = prompt_lengths.long().tolist()
    c = completion_lengths.long().tolist()
    prompts = p[::group_size] if prompt_once else p
    tokens = sum(prompts) + sum(c)
    pairs = causal_pairs(prompts) + sum(ci * pi + ci * (ci + 1) // 2 for pi, ci in zip(p, c))
    size = dict(tokens=tokens, head_tokens=sum(c), pairs=pairs)
    forward_only = int(num_iterations > 1 if old_pass is None else old_pass) + int(reference)
    return num_iterations * flops.training(**size) + forward_only * flops.forward(**size)
