"""Dynamic sampling (DAPO): a step trains on groups whose rewards differ.

A group whose ``num_generations`` rewards are all equal has zero advantage under a group baseline:
it costs a full forward and backward and teaches nothing. With ``dynamic_sampling: true`` the GRPO
recipe samples a round of ``prompts_per_step`` prompts, drops such groups, and samples further
rounds (the next prompts of the same prompt stream, :func:`logitless.rl.prompt_sets.prompt_stream_indices`)
until it has ``prompts_per_step`` groups with a reward spread or has sampled
``dynamic_sampling_max_rounds`` rounds. A further round samples the missing groups divided by the
share kept so far (:meth:`GroupFill.next_round_size`), so it is expected to fill the step without
sampling a whole batch for a few missing groups. The step trains on the first ``prompts_per_step``
kept groups in stream order (a surplus is discarded, as in DAPO); when the rounds run out first it
trains on the groups it kept (a smaller step, said in the log and in
``dynamic_sampling/filled_fraction``), and when no group has a spread it takes no optimizer step.

On several ranks every rank samples its share of each round (one random stream per prompt, as
without dynamic sampling); the rounds' completions are gathered so that every rank selects the
groups one device would select from the same rounds, and each rank trains on its contiguous share
of them. Shares are equal: a refill round is rounded up and a short step's kept count down to a
multiple of the world size, so a refill can differ from one device's by up to ``world_size - 1``
prompts (the runs then continue on other prompts).

:class:`GroupFill` holds the rounds of one step; :class:`ScoredRollout` is what a round (or a
whole step) hands to the update.

Example:
    >>> fill = GroupFill(prompts_per_step=8, num_generations=4, runtime=runtime, pad_id=0)
    >>> for r in range(max_rounds):
    ...     fill.add(sample_round(fill.next_round_size()))
    ...     if fill.full:
    ...         break
    >>> batch, metrics = fill.batch(), fill.metrics()
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional, Sequence

import torch

from logitless.generation.result import Rollout
from logitless.training.distributed import Runtime

__all__ = ["GroupFill", "ScoredRollout", "concat_rollouts", "groups_with_spread", "micro_batch_size_for",
           "take_groups"]

# How each per-row field of a Rollout is padded to a common width: prompts are left-padded,
# completions right-padded. A field missing here is refused (its padding would be a guess).
_LEFT, _RIGHT = "left", "right"
_ROW_FIELDS = {"prompt_tokens": _LEFT, "prompt_mask": _LEFT, "completion_tokens": _RIGHT,
               "completion_mask": _RIGHT, "sampler_log_probs": _RIGHT, "truncated": None, "sampled_mask": _RIGHT}
# Per-row fields that are Python lists (a multi-turn rollout's trajectories), None in other rollouts.
_ROW_LISTS = ("trajectories",)


@dataclass
class ScoredRollout:
    """Sampled and scored groups: this rank's rows, and the per-completion values of the whole batch.

    Attributes:
        rollout (Rollout): this rank's completions (contiguous groups).
        prompts (List[str]): this rank's prompt text per completion.
        texts (List[str]): this rank's decoded completions.
        rewards (Dict[str, torch.Tensor]): this rank's rewards, ``{name: (n,)}`` and ``"total"``.
        values (Dict[str, torch.Tensor]): every rank's rewards (by name and ``"total"``), ``"length"``
            and ``"truncated"``, ``(N,)`` each in batch order (from ``gather_columns``).
        rows (slice): this rank's rows within ``values``.
    """

    rollout: Rollout
    prompts: List[str]
    texts: List[str]
    rewards: Dict[str, torch.Tensor]
    values: Dict[str, torch.Tensor]
    rows: slice


def groups_with_spread(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``(N / G,)`` bool: the groups whose rewards are not all equal (exactly: max != min).

    Example:
        >>> groups_with_spread(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
        tensor([ True, False])
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be 1-D whole groups of num_generations={num_generations}, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.view(-1, num_generations)
    return r.amax(dim=1) != r.amin(dim=1)


def _check_fields(rollout: Rollout) -> None:
    unknown = [f.name for f in fields(rollout)
               if f.name not in _ROW_FIELDS and f.name not in _ROW_LISTS and f.name != "num_generations"]
    if unknown:
        raise TypeError(f"dynamic sampling does not know how to pad the Rollout field(s) {unknown}; "
                        f"add them to logitless.rl.dynamic_sampling._ROW_FIELDS")


def _pad(t: Optional[torch.Tensor], width: int, side: Optional[str], value) -> Optional[torch.Tensor]:
    if t is None or side is None or t.shape[1] == width:  # None: an optional field this rollout lacks
        return t
    fill = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if side == _LEFT else [t, fill], dim=1)


def _pad_value(name: str, pad_id: int):
    return pad_id if name.endswith("tokens") else (False if name.endswith("mask") else 0.0)


def _padded(rollout: Rollout, prompt_width: int, completion_width: int, pad_id: int) -> Rollout:
    _check_fields(rollout)
    out = {}
    for name, side in _ROW_FIELDS.items():
        width = prompt_width if side == _LEFT else completion_width
        out[name] = _pad(getattr(rollout, name), width, side, _pad_value(name, pad_id))
    return replace(rollout, **out)


def concat_rollouts(rollouts: Sequence[Rollout], pad_id: int) -> Rollout:
    """The rows of ``rollouts`` in order, in one Rollout: prompts left-padded and completions
    right-padded with ``pad_id`` to the widest (masks False, sampler log-probs 0 there).

    Example:
        >>> both = concat_rollouts([round_0, round_1], pad_id=0)
    """
    if not rollouts:
        raise ValueError("concat_rollouts needs at least one rollout")
    g = {r.num_generations for r in rollouts}
    if len(g) != 1:
        raise ValueError(f"rollouts with different num_generations {sorted(g)} cannot be concatenated")
    pw = max(r.prompt_tokens.shape[1] for r in rollouts)
    cw = max(r.completion_tokens.shape[1] for r in rollouts)
    padded = [_padded(r, pw, cw, pad_id) for r in rollouts]
    return replace(padded[0], **{name: _cat([getattr(r, name) for r in padded]) for name in (*_ROW_FIELDS, *_ROW_LISTS)})


def _cat(parts: list):
    """The rows of ``parts`` in order: tensors concatenated, lists joined, None when every part is None."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("rollouts with and without tool turns cannot be concatenated")
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else [x for p in parts for x in p]


def _rows(value, rows: torch.Tensor):
    """Rows ``rows`` of a per-row field (a tensor or a list; None stays None)."""
    if value is None:
        return None
    return value.index_select(0, rows) if isinstance(value, torch.Tensor) else [value[i] for i in rows.tolist()]


def take_groups(rollout: Rollout, groups: Sequence[int]) -> Rollout:
    """The given groups of ``rollout``, in that order, without the padding columns no kept row uses
    (a step's widths are then those of its own rows).

    Example:
        >>> take_groups(rollout, [0, 2]).completion_tokens.shape[0] == 2 * rollout.num_generations
        True
    """
    _check_fields(rollout)
    g = rollout.num_generations
    rows = torch.tensor([gi * g + j for gi in groups for j in range(g)], dtype=torch.long,
                        device=rollout.prompt_tokens.device)
    picked = {name: _rows(getattr(rollout, name), rows) for name in (*_ROW_FIELDS, *_ROW_LISTS)}
    if rows.numel():
        real = picked["prompt_mask"].any(dim=0).nonzero()
        first = int(real[0]) if real.numel() else picked["prompt_mask"].shape[1]
        used = picked["completion_mask"].any(dim=0).nonzero()
        last = int(used[-1]) + 1 if used.numel() else 0
        for name, side in _ROW_FIELDS.items():
            if picked[name] is None:
                continue
            if side == _LEFT:
                picked[name] = picked[name][:, first:]
            elif side == _RIGHT:
                picked[name] = picked[name][:, :last]
    return replace(rollout, **picked)


def _gather_rollout(rollout: Rollout, runtime: Runtime, pad_id: int) -> Rollout:
    # Every rank's rows in rank order (equal row counts: each rank samples an equal share of a round).
    if not runtime.distributed:
        return rollout
    widths = runtime.all_reduce(torch.tensor([float(rollout.prompt_tokens.shape[1]),
                                              float(rollout.completion_tokens.shape[1])]), op="max")
    padded = _padded(rollout, int(widths[0]), int(widths[1]), pad_id)
    gathered = {name: runtime.all_gather(getattr(padded, name)) for name in _ROW_FIELDS
                if getattr(padded, name) is not None}
    for name in _ROW_LISTS:
        if getattr(padded, name) is not None:
            gathered[name] = runtime.all_gather_object(getattr(padded, name))
    return replace(padded, **gathered)


def micro_batch_size_for(num_completions: int, configured: int, num_generations: int) -> int:
    """The micro-batch size of a step of ``num_completions`` completions per rank: ``configured``
    when it divides them, else the largest divisor that is smaller (and whole groups when
    ``configured`` is: prompt sharing packs whole groups). The update's normalisers count the whole
    step, so only the number of forward/backward passes changes (``bnpo`` averages over them).

    Example:
        >>> micro_batch_size_for(40, 16, 4)  # 10 groups of 4, at most 4 groups per micro-batch
        8
    """
    if num_completions < 1:
        raise ValueError(f"a step needs at least one completion, got {num_completions}")
    unit = num_generations if configured % num_generations == 0 and num_completions % num_generations == 0 else 1
    for size in range(min(configured, num_completions) // unit * unit, 0, -unit):
        if num_completions % size == 0:
            return size
    return unit


class GroupFill:
    """The sampling rounds of one dynamic-sampling step and the groups it trains on.

    Args:
        prompts_per_step (int): groups the step wants (``prompts_per_step``), also the prompts of
            the first round and the most of any round.
        num_generations (int): G.
        runtime (Runtime): this rank and the world (a round's rows are gathered over the ranks).
        pad_id (int): filler token of rollouts padded to a common width.
    """

    def __init__(self, prompts_per_step: int, num_generations: int, *, runtime: Runtime, pad_id: int):
        self.prompts_per_step, self.num_generations = prompts_per_step, num_generations
        self.runtime, self.pad_id = runtime, pad_id
        self.rounds: List[ScoredRollout] = []
        self._rollouts: List[Rollout] = []  # every rank's rows of each round
        self._texts: List[List[str]] = []
        self._prompts: List[List[str]] = []
        self._spread: List[torch.Tensor] = []

    def next_round_size(self) -> int:
        """Prompts of the next round: ``prompts_per_step`` first, then the groups still missing
        divided by the share of groups kept so far (so that the round is expected to fill the step),
        at most ``prompts_per_step``, rounded up to whole shares of the ranks.

        Example:
            >>> fill.next_round_size()  # 44 wanted, 36 of 44 kept: 8 missing / (36 / 44) -> 10
            10
        """
        if not self.rounds:
            return self.prompts_per_step
        missing = self.prompts_per_step - self.kept
        if missing <= 0:
            return 0
        size = self.prompts_per_step
        if self.kept:  # missing / keep rate, in integers: ceil(missing * sampled / kept)
            size = min(size, -(-missing * self.sampled_groups // self.kept))
        world = self.runtime.world_size  # prompts_per_step is a multiple of it: so is the rounded size
        return -(-size // world) * world

    @property
    def sampled_groups(self) -> int:
        """Groups (prompts) sampled so far."""
        return int(sum(s.numel() for s in self._spread))

    def add(self, round_batch: ScoredRollout) -> None:
        """Adds one round (this rank's share of the round's prompts, scored and gathered).

        Every rank calls it (the round's rows are gathered)."""
        total = round_batch.values["total"]
        if total.numel() % (self.num_generations * self.runtime.world_size):
            raise ValueError(f"a round holds {total.numel()} completions, expected whole groups of "
                             f"num_generations={self.num_generations} in equal shares of {self.runtime.world_size} "
                             f"ranks")
        self.rounds.append(round_batch)
        self._rollouts.append(_gather_rollout(round_batch.rollout, self.runtime, self.pad_id))
        self._prompts.append(self.runtime.all_gather_object(round_batch.prompts))
        self._texts.append(self.runtime.all_gather_object(round_batch.texts))
        self._spread.append(groups_with_spread(total, self.num_generations))

    @property
    def kept(self) -> int:
        """Groups with a reward spread sampled so far."""
        return int(sum(int(s.sum()) for s in self._spread))

    @property
    def full(self) -> bool:
        """Whether the step has its ``prompts_per_step`` groups."""
        return self.kept >= self.prompts_per_step

    def _selected(self) -> List[int]:
        # positions in the concatenation of the rounds, stream order; equal shares over the ranks
        spread = torch.cat(self._spread)
        kept = spread.nonzero().flatten().tolist()[:self.prompts_per_step]
        return kept[:len(kept) - len(kept) % self.runtime.world_size]

    def sampled_values(self) -> Dict[str, torch.Tensor]:
        """Every completion sampled this step (all rounds, all ranks): rewards, length, truncated."""
        return {k: torch.cat([r.values[k] for r in self.rounds]) for k in self.rounds[0].values}

    def batch(self) -> Optional[ScoredRollout]:
        """The groups the step trains on (this rank's share), or None when no group has a spread."""
        groups = self._selected()
        if not groups:
            return None
        g, share = self.num_generations, len(groups) // self.runtime.world_size
        mine = groups[self.runtime.rank * share:(self.runtime.rank + 1) * share]
        everything = concat_rollouts(self._rollouts, self.pad_id)
        all_rows = [gi * g + j for gi in groups for j in range(g)]
        own_rows = [gi * g + j for gi in mine for j in range(g)]
        prompts = [p for ps in self._prompts for p in ps]
        texts = [t for ts in self._texts for t in ts]
        index = torch.tensor(all_rows, dtype=torch.long)
        values = {k: v.index_select(0, index) for k, v in self.sampled_values().items()}
        rows = slice(self.runtime.rank * share * g, (self.runtime.rank + 1) * share * g)
        rewards = {k: values[k][rows] for k in self.rounds[0].rewards}
        return ScoredRollout(take_groups(everything, mine), [prompts[i] for i in own_rows],
                             [texts[i] for i in own_rows], rewards, values, rows)

    def shortfall(self) -> str:
        """What the step trains on when the rounds ran out before it was full (for the log)."""
        trained = len(self._selected())
        what = (f"training on {trained} groups" if trained else "no optimizer step this step")
        if 0 < trained < self.kept:
            what += f" (a multiple of the {self.runtime.world_size} ranks)"
        return (f"dynamic sampling found {self.kept} of {self.prompts_per_step} groups with a reward spread in "
                f"{len(self.rounds)} rounds (dynamic_sampling_max_rounds); {what}")

    def metrics(self) -> Dict[str, float]:
        """``dynamic_sampling/rounds`` (sampled this step), ``sampled_groups`` (prompts sampled, all
        rounds), ``dropped_groups`` (no reward spread),
        ``surplus_groups`` (kept but beyond the step's groups), ``filled_fraction`` (groups trained on
        / ``prompts_per_step``)."""
        trained = len(self._selected())
        return {"dynamic_sampling/rounds": float(len(self.rounds)),
                "dynamic_sampling/sampled_groups": float(self.sampled_groups),
                "dynamic_sampling/dropped_groups": float(sum(int((~s).sum()) for s in self._spread)),
                "dynamic_sampling/surplus_groups": float(self.kept - trained),
                "dynamic_sampling/filled_fraction": trained / self.prompts_per_step}
