"""What a multi-turn rollout talks to between the model's turns.

An environment is any object with two methods (subclassing :class:`Environment` is optional):

- ``reset(row) -> messages``: the conversation a trajectory starts from, for one dataset row (the
  chat messages the prompt is rendered from, e.g. ``[system, user]``);
- ``step(messages) -> (new_messages, done, info)``: called after each model turn with the whole
  conversation, whose last message is the model's turn (``{"role": "assistant", "content",
  "tool_calls"?}``, the calls as parsed, malformed ones under ``tool_call_errors``); returns the
  messages to append (tool answers, a user's reply, a game's observation), whether the trajectory
  is over, and information for the rewards (merged into the trajectory's ``info``).

One environment object is made per trajectory (``num_generations`` per prompt), so it may keep
state across its turns. The rollout calls ``step`` on a thread of its own, concurrently with the
decoding of the other rows; a ``step`` that raises or runs past its timeout ends its trajectory and
counts as an environment error, the run goes on.

:class:`ToolEnvironment` is the environment of a ``tools:`` list: the row's prompt messages, and
each step runs the turn's calls (:class:`~logitless.generation.tools.execution.ToolExecutor`) and
answers each with a ``tool`` message; a turn without calls ends the trajectory.

Example:
    >>> env = ToolEnvironment(ToolExecutor([add]))
    >>> messages = env.reset({"prompt_messages": [{"role": "user", "content": "1+2?"}]})
    >>> env.step(messages + [{"role": "assistant", "content": "", "tool_calls": [
    ...     {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}])[0]
    [{'role': 'tool', 'name': 'add', 'content': '3'}]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, List, Mapping, Tuple

from logitless.generation.tools.calls import ToolCall
from logitless.generation.tools.execution import ToolExecutor

__all__ = ["Environment", "ToolEnvironment", "check_environment_class"]

Message = Dict[str, Any]
#: The row key holding a conversational prompt's messages (written by logitless.rl.prompts).
PROMPT_MESSAGES = "prompt_messages"


class Environment(ABC):
    """The interface of an environment (see the module docstring); subclassing it is optional."""

    @abstractmethod
    def reset(self, row: Mapping[str, Any]) -> List[Message]:
        """The messages a trajectory for ``row`` starts from."""

    @abstractmethod
    def step(self, messages: List[Message]) -> Tuple[List[Message], bool, Dict[str, Any]]:
        """``(new messages, done, info)`` after the model's turn (``messages[-1]``)."""


def check_environment_class(cls: Any, key: str = "environment") -> None:
    """Raises ValueError unless ``cls`` is a class with callable ``reset`` and ``step``.

    Args:
        cls: what the config names.
        key (str): its config key, for the message.
    """
    if not isinstance(cls, type):
        raise ValueError(f"config key {key!r}: expected a class with reset(row) and step(messages), got "
                         f"{type(cls).__name__} {cls!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"config key {key!r}: {cls.__module__}.{cls.__qualname__} has no {' / '.join(missing)} "
                         f"method; an environment needs reset(row) -> messages and step(messages) -> "
                         f"(new_messages, done, info)")


class ToolEnvironment(Environment):
    """The environment of a ``tools:`` list (see the module docstring).

    Args:
        executor (ToolExecutor): runs the calls.

    ``info`` of a step: ``tool_errors`` (calls whose outcome is an error).
    """

    def __init__(self, executor: ToolExecutor):
        self.executor = executor

    def reset(self, row: Mapping[str, Any]) -> List[Message]:
        messages = row.get(PROMPT_MESSAGES)
        if not messages:
            raise ValueError(f"a tool rollout starts from the row's chat messages ({PROMPT_MESSAGES!r}), and this "
                             f"row has none (keys: {sorted(row)}); use a conversational prompt dataset (chat: true) "
                             f"or an environment whose reset(row) builds the messages")
        return [dict(m) for m in messages]

    def step(self, messages: List[Message]) -> Tuple[List[Message], bool, Dict[str, Any]]:
        turn = messages[-1]
        calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in turn.get("tool_calls", [])]
        malformed = list(turn.get("tool_call_errors", []))
        if not calls and not malformed:
            return [], True, {}
        outcomes = self.executor.run(calls)
        answers = [{"role": "tool", "name": o.name, "content": o.content} for o in outcomes]
        answers += [{"role": "tool", "content": error} for error in malformed]
        return answers, False, {"tool_errors": sum(o.error is not None for o in outcomes)}
