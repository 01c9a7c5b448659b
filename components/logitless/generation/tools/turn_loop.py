"""The host side of a multi-turn rollout: which rows decode, when a tool starts, when its answer goes in.

:func:`drive_turns` runs a step function (:mod:`logitless.generation.tools.turn_step`: every row one
token per step, on its own schedule) and, every ``sync_every`` steps, reads which rows paused:

- a row that drew a stop token has ended its turn: the session parses it and starts the row's
  environment step on a thread of its own (:meth:`TurnSession.end_turn`), while the other rows go on
  decoding;
- a row whose environment has answered gets its continuation (the template's tokens for the new
  messages and the next assistant header) written into its outputs and is active again from the next
  step, which feeds the continuation one token per step (a long one, ``prefill_tokens`` or more, goes
  into the row's cache in one forward of that row instead): no row waits for another row's tool, and
  no turn waits for the slowest row's turn;
- when no row is decoding, the loop blocks until the first waiting row's environment answers.

A row ends when its environment is done, it has had ``max_turns`` turns, its next continuation does
not fit its budget, or the budget runs out mid-turn (the last two: ``truncated``); from then on its
cache columns are hidden (:func:`~logitless.generation.tools.turn_step.retire_rows`), so the steps
that remain read almost nothing for it.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from logitless.generation.result import Rollout
from logitless.generation.tools.session import TurnSession
from logitless.generation.tools.turn_step import TurnState, retire_rows

__all__ = ["drive_turns", "turn_rollout"]


def drive_turns(session: TurnSession, state: TurnState, step: Callable[[], None], *, sync_every: int,
                prefill: Optional[Callable[[int, List[int]], None]] = None,
                prefill_tokens: Optional[int] = None) -> Tuple[List[bool], int]:
    """Runs ``step`` until every row's trajectory is over (see the module docstring).

    Args:
        session (TurnSession): the rows' environments and conversations.
        state (TurnState): the rows, after their first token (:func:`~logitless.generation.tools.turn_step.advance`
            on the prefill's logits).
        step (Callable[[], None]): one decode step of every row, in place.
        sync_every (int): steps between the host's reads of the rows' flags (its only syncs).
        prefill (Optional[Callable[[int, List[int]], None]]): appends a continuation to a row in one
            forward (:func:`~logitless.generation.tools.turn_step.prefill_segment`), for continuations of
            at least ``prefill_tokens`` tokens; None (or ``prefill_tokens`` None): every continuation
            is fed one token per step.
        prefill_tokens (Optional[int]): see ``prefill``.

    Returns:
        Tuple[List[bool], int]: per row, whether the budget cut its trajectory; and the steps run.
    """
    n = len(session)
    budget = int(state["budget"])
    turn_start = [0] * n  # where each row's current turn begins in its completion
    truncated = [False] * n
    waiting: set = set()
    active = n
    steps = 0
    while True:
        if active:
            for _ in range(sync_every):
                step()
            steps += sync_every
        flags = torch.stack([state["active"], state["stopped"], state["cut"]]).cpu()
        length = state["length"].cpu().tolist()
        ended = (flags[1] | flags[2]).nonzero().squeeze(1).tolist()
        finished = []
        if ended:
            state["stopped"].zero_()
            state["cut"].zero_()
            outputs = state["out_tokens"][torch.as_tensor(ended, device=state["length"].device)].cpu()
            for i, b in enumerate(ended):
                cut = bool(flags[2, b])
                session.end_turn(b, outputs[i, turn_start[b]:length[b]].tolist(), last=cut)
                truncated[b] = cut
                if not cut and session.waiting(b):
                    waiting.add(b)
                else:
                    finished.append(b)
        active = int(flags[0].sum())
        if waiting and not active:
            session.wait_any(sorted(waiting))
        rows, columns, values, ends = [], [], [], []
        for b in sorted(waiting):
            if not session.ready(b):
                continue
            waiting.discard(b)
            ids = session.continuation(b, budget - length[b])
            if ids is None:
                truncated[b] = session.trajectories[b].out_of_budget
                finished.append(b)
                continue
            if prefill is not None and prefill_tokens is not None and len(ids) >= max(prefill_tokens, 2):
                prefill(b, ids)  # the row is active again, its answer in its cache
                turn_start[b] = length[b] + len(ids)
                active += 1
                continue
            rows += [b] * len(ids)
            columns += range(length[b], length[b] + len(ids))
            values += ids
            ends.append((b, length[b] + len(ids)))
            turn_start[b] = length[b] + len(ids)
        retire_rows(state, finished)
        if ends:
            device = state["length"].device
            state["out_tokens"].index_put_((torch.as_tensor(rows, device=device),
                                            torch.as_tensor(columns, device=device)),
                                           torch.as_tensor(values, dtype=torch.long, device=device))
            resumed = torch.as_tensor([b for b, _ in ends], device=device)
            state["forced_end"].index_put_((resumed,), torch.as_tensor([e for _, e in ends], device=device))
            state["active"].index_fill_(0, resumed, True)
            active += len(ends)
        if not active and not waiting:
            return truncated, steps


def turn_rollout(state: TurnState, prompt_tokens: torch.Tensor, prompt_mask: torch.Tensor, truncated: List[bool],
                 session: TurnSession) -> Rollout:
    """The :class:`~logitless.generation.result.Rollout` of a finished multi-turn ``state``: completions as
    long as the longest row, ``sampled_mask`` on the drawn tokens, the session's trajectories."""
    n = prompt_tokens.shape[0]
    steps = max(int(state["length"].max()), 1)
    return Rollout(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        completion_tokens=state["out_tokens"][:n, :steps].clone(),
        completion_mask=state["out_mask"][:n, :steps].clone(),
        truncated=torch.as_tensor(truncated, device=prompt_tokens.device),
        sampler_log_probs=state["out_logp"][:n, :steps].clone(),
        num_generations=session.num_generations,
        sampled_mask=state["out_sampled"][:n, :steps].clone(),
        trajectories=session.trajectories,
    )
