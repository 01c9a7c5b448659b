"""The turns of one batch of trajectories, independent of how the tokens are sampled.

A :class:`TurnSession` holds, for each row of a rollout (``prompts x num_generations``), its
environment, its conversation and its counters. A sampler drives it with token ids only:

1. :attr:`TurnSession.prompts`: one token list per prompt (the G rows of a group share it: every
   row's ``reset`` must render the same prompt), to prefill;
2. :meth:`TurnSession.end_turn` when a row samples a stop token: the turn is parsed and, unless the
   row is out of turns, its environment ``step`` starts at once on a thread of its own, so it runs
   while the other rows are still decoding;
3. :meth:`TurnSession.continuation` when the sampler takes the row on (once :meth:`TurnSession.ready`,
   or blocking: it waits for that step, :meth:`TurnSession.wait_any` for the first of several) and
   returns the tokens to append (the template's text for the new messages and the next assistant
   header, :meth:`~logitless.generation.tools.chat_format.ToolChat.continuation`), or None when the
   trajectory is over (done, out of turns, an environment error, or no room left in the row's
   token budget).

Every row is answered, whatever its environment does: a ``step`` that raises or exceeds
``step_timeout_s`` ends the trajectory and counts as an environment error.

Example:
    >>> session = TurnSession(chat, lambda: ToolEnvironment(executor), rows, num_generations=4, max_turns=3)
    >>> rollout = generate_turns(model, session, max_new_tokens=256, ...)
    >>> session.trajectories[0].messages[-1]["content"]
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from logitless.generation.tools.chat_format import ToolChat
from logitless.generation.tools.execution import start_daemon

__all__ = ["Trajectory", "TurnSession"]

Message = Dict[str, Any]


@dataclass
class Trajectory:
    """One row's conversation and counters.

    Attributes:
        messages (List[Message]): the conversation the model saw: the prompt's messages, each model
            turn (``{"role": "assistant", "content", "tool_calls"?}``) and the environment's answers.
        num_prompt_messages (int): how many of ``messages`` are the prompt's.
        info (Dict[str, Any]): the environment's step infos merged (later keys win); ``error`` holds
            an environment failure.
        turns (int): model turns sampled.
        tool_calls (int): calls the model made (malformed ones included).
        tool_errors (int): malformed calls plus the errors the environment reported (``tool_errors`` of
            its infos: raised, timed out, non-text, unknown tool, bad arguments).
        environment_errors (int): steps that raised or timed out (each ends the trajectory).
        tool_seconds (float): wall time of the environment's steps.
        out_of_budget (bool): the trajectory stopped because the next turn did not fit its token budget.
    """

    messages: List[Message]
    num_prompt_messages: int = 0
    info: Dict[str, Any] = field(default_factory=dict)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    environment_errors: int = 0
    tool_seconds: float = 0.0
    out_of_budget: bool = False

    @property
    def turn_messages(self) -> List[Message]:
        """The messages after the prompt: the model's turns and what the environment answered."""
        return self.messages[self.num_prompt_messages:]

    @property
    def final_answer(self) -> str:
        """The content of the model's last turn."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return message.get("content", "")
        return ""


class TurnSession:
    """The environments and conversations of one rollout's rows (see the module docstring).

    Args:
        chat (ToolChat): renders prompts and continuations, parses turns.
        environment_factory (Callable[[], Any]): makes one environment (``reset`` / ``step``) per row.
        rows (Sequence[Mapping]): the dataset rows, one per prompt.
        num_generations (int): rows per prompt (G); row ``r`` belongs to prompt ``r // G``.
        max_turns (int): model turns per row (>= 1); after the last one no step is taken.
        stop_ids (Sequence[int]): the sampler's stop tokens (a turn's final one is not part of its text).
        step_timeout_s (float): seconds an environment step may take.

    Raises:
        ValueError: bad arguments, or the G environments of a prompt rendering different prompts.
    """

    def __init__(self, chat: ToolChat, environment_factory: Callable[[], Any], rows: Sequence[Mapping[str, Any]], *,
                 num_generations: int, max_turns: int, stop_ids: Sequence[int] = (), step_timeout_s: float = 60.0):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s!r}")
        self.chat, self.max_turns, self.step_timeout_s = chat, max_turns, float(step_timeout_s)
        self.stop_ids = [int(s) for s in stop_ids]
        self.num_generations = num_generations
        self.environments = [environment_factory() for _ in range(len(rows) * num_generations)]
        self.trajectories: List[Trajectory] = []
        self.prompts: List[List[int]] = []
        self.prompt_texts: List[str] = []
        for p, row in enumerate(rows):
            for g in range(num_generations):
                messages = [dict(m) for m in self.environments[p * num_generations + g].reset(row)]
                ids, text = chat.prompt(messages)
                if g == 0:
                    self.prompts.append(ids)
                    self.prompt_texts.append(text)
                elif ids != self.prompts[p]:
                    raise ValueError(f"environment.reset gave rows {p * num_generations} and {p * num_generations + g} "
                                     f"of prompt {p} different prompts; the {num_generations} rows of a GRPO group "
                                     f"share one prompt (make reset(row) depend on the row only)")
                self.trajectories.append(Trajectory(messages, num_prompt_messages=len(messages)))
        self._pending: Dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self.trajectories)

    def end_turn(self, row: int, turn_ids: Sequence[int], *, last: bool = False) -> None:
        """Records the row's turn and starts its environment step, unless it was the row's last turn.

        Args:
            row (int): the row.
            turn_ids (Sequence[int]): the tokens the model sampled for the turn (its stop token included).
            last (bool): the row has no room left (the turn was cut by the budget): record it, take no step.
        """
        traj = self.trajectories[row]
        turn = self.chat.parse(turn_ids, self.stop_ids)
        traj.turns += 1
        traj.messages.append(turn.assistant_message())
        if last:  # cut mid-turn: its calls were never finished, they are not counted
            traj.out_of_budget = True
            return
        traj.tool_calls += turn.num_calls
        traj.tool_errors += len(turn.errors)
        if traj.turns >= self.max_turns:
            return
        self._pending[row] = (start_daemon(_timed_step, self.environments[row], list(traj.messages)),
                              time.perf_counter())

    def waiting(self, row: int) -> bool:
        """Whether the row's environment step was started and its continuation not yet taken."""
        return row in self._pending

    def ready(self, row: int) -> bool:
        """Whether :meth:`continuation` would return at once: the row's step has finished (or has
        run past ``step_timeout_s``), or the row has none."""
        if row not in self._pending:
            return True
        future, started = self._pending[row]
        return future.done() or time.perf_counter() - started >= self.step_timeout_s

    def wait_any(self, rows: Sequence[int]) -> None:
        """Blocks until one of ``rows`` is :meth:`ready` (at once when one is, or none is waiting)."""
        waiting = [r for r in rows if r in self._pending]
        if not waiting or any(self.ready(r) for r in waiting):
            return
        deadline = min(self._pending[r][1] for r in waiting) + self.step_timeout_s
        futures_wait([self._pending[r][0] for r in waiting], timeout=max(0.0, deadline - time.perf_counter()),
                     return_when=FIRST_COMPLETED)

    def continuation(self, row: int, room: int) -> Optional[List[int]]:
        """The tokens to append to the row after its turn, or None when its trajectory is over.

        Args:
            row (int): the row.
            room (int): tokens left in the row's budget; a continuation needs ``room >= len + 1``
                (one token for the model's next turn), else the trajectory stops (``out_of_budget``).

        Returns:
            Optional[List[int]]: the continuation's tokens, or None.
        """
        if row not in self._pending:
            return None
        future, started = self._pending.pop(row)
        traj = self.trajectories[row]
        outcome, seconds = self._wait(future, started)
        traj.tool_seconds += seconds
        if outcome is None or isinstance(outcome, BaseException):
            traj.environment_errors += 1
            traj.info["error"] = (f"environment step timed out after {self.step_timeout_s:g} s" if outcome is None
                                  else f"environment step raised {type(outcome).__name__}: {outcome}")
            return None
        new_messages, done, info = outcome
        info = dict(info or {})
        traj.tool_errors += int(info.pop("tool_errors", 0))
        traj.info.update(info)
        if done:
            return None
        new_messages = [dict(m) for m in new_messages]
        ids, _ = self.chat.continuation(traj.messages, new_messages)
        if len(ids) + 1 > room:
            traj.out_of_budget = True
            return None
        traj.messages.extend(new_messages)
        return ids

    def _wait(self, future: Future, started: float):
        """``(outcome, seconds)``: the step's ``(messages, done, info)``, its exception, or None on
        timeout; and the step's own wall time (the timeout when it had none)."""
        try:
            result, seconds = future.result(timeout=max(0.0, self.step_timeout_s - (time.perf_counter() - started)))
        except FutureTimeout:
            return None, self.step_timeout_s
        except BaseException as e:  # noqa: BLE001 - raised on the step's thread: the row's failure, not the run's
            return e, time.perf_counter() - started
        if not (isinstance(result, tuple) and len(result) == 3):
            result = TypeError(f"environment.step must return (new_messages, done, info), got "
                               f"{type(result).__name__}")
        return result, seconds


def _timed_step(environment: Any, messages: List[Message]):
    """``(environment.step(messages), seconds)``, run on the step's own thread."""
    started = time.perf_counter()
    result = environment.step(messages)
    return result, time.perf_counter() - started
