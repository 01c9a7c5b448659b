"""Running tool calls: concurrently, each with a timeout, every failure turned into a tool message.

:class:`ToolExecutor` holds the tools of a run by name. :meth:`ToolExecutor.run` starts every call of
a turn at once and waits for them up to ``timeout_s`` each; whatever happens, each call gives a
:class:`ToolOutcome` whose ``content`` is what the model reads next as the tool's response:

- the tool's return value, when it is a string;
- ``Error: ...`` naming what went wrong otherwise, counted in ``error``: an unknown tool, arguments
  that do not fit its signature, an exception (its type and message), no answer within the timeout,
  or a return value that is not text (``int``, ``dict``, ``None``...: a tool returns the text the
  model reads, ``str(x)`` is the tool's decision).

Each call runs on its own daemon thread. A Python thread cannot be stopped: a call past its timeout
is abandoned (its answer, if it ever comes, is dropped) and keeps its thread until it returns, but a
daemon thread never holds the process open at exit, as a hung worker of
``concurrent.futures.ThreadPoolExecutor`` would (its workers are joined at exit). A tool that may
hang for good (running code) should put the work in a subprocess with its own timeout, as
:func:`logitless.generation.tools.builtin.python` does.

Example:
    >>> executor = ToolExecutor([add], timeout_s=5.0)
    >>> [o.content for o in executor.run([ToolCall("add", {"a": 1, "b": 2})])]
    ['3']
"""

from __future__ import annotations

import inspect
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from logitless.generation.tools.calls import ToolCall

__all__ = ["ERROR_KINDS", "ToolExecutor", "ToolOutcome", "start_daemon"]

#: What ``ToolOutcome.error`` can be.
ERROR_KINDS = ("unknown_tool", "bad_arguments", "raised", "timeout", "not_text", "malformed_call")


@dataclass
class ToolOutcome:
    """The result of one call.

    Attributes:
        name (str): the tool called.
        content (str): the tool message's content: the answer, or an ``Error: ...`` text for the model.
        error (Optional[str]): None on success, else one of :data:`ERROR_KINDS`.
        seconds (float): wall time from the call's start to its answer (the timeout when it had none).
    """

    name: str
    content: str
    error: Optional[str] = None
    seconds: float = 0.0


def start_daemon(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """Runs ``fn(*args, **kwargs)`` on a new daemon thread; its result or exception lands in the Future.

    Example:
        >>> start_daemon(sum, [1, 2]).result(timeout=1.0)
        3
    """
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def target():
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)
        else:
            future.set_result(result)

    threading.Thread(target=target, daemon=True, name=f"logitless-{getattr(fn, '__name__', 'task')}").start()
    return future


class ToolExecutor:
    """The tools of a run, called by name with a timeout.

    Args:
        tools (Sequence[Callable]): the callables; each is called by its ``__name__`` (names must be unique).
        timeout_s (float): seconds each call may take (> 0).

    Raises:
        ValueError: two tools with one name, or a timeout that is not a positive number.

    Example:
        >>> ToolExecutor([add]).names
        ['add']
    """

    def __init__(self, tools: Sequence[Callable], timeout_s: float = 10.0):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0 (seconds per tool call), got {timeout_s!r}")
        self.tools: Dict[str, Callable] = {}
        for fn in tools:
            name = getattr(fn, "__name__", None)
            if not name:
                raise ValueError(f"tool {fn!r} has no __name__; a tool is called by its name")
            if name in self.tools:
                raise ValueError(f"two tools are named {name!r}; the model calls a tool by its name, so names must "
                                 f"be unique")
            self.tools[name] = fn
        self.timeout_s = float(timeout_s)

    @property
    def names(self) -> List[str]:
        return list(self.tools)

    def _check(self, call: ToolCall) -> Optional[ToolOutcome]:
        """The outcome of a call that cannot start (unknown tool, arguments off its signature), else None."""
        fn = self.tools.get(call.name)
        if fn is None:
            return ToolOutcome(call.name, f"Error: there is no tool named {call.name!r}; the tools are "
                                          f"{self.names}.", "unknown_tool")
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return ToolOutcome(call.name, f"Error: wrong arguments for {call.name}: {e}.", "bad_arguments")
        return None

    def run(self, calls: Sequence[ToolCall]) -> List[ToolOutcome]:
        """Runs ``calls`` concurrently and returns their outcomes in order (never raises for a tool's fault).

        Args:
            calls (Sequence[ToolCall]): the turn's well-formed calls.

        Returns:
            List[ToolOutcome]: one per call.
        """
        started = []
        for call in calls:
            refused = self._check(call)
            started.append((call, refused, None if refused else start_daemon(self.tools[call.name],
                                                                              **call.arguments),
                            time.perf_counter()))
        outcomes = []
        for call, refused, future, t0 in started:
            if refused is not None:
                outcomes.append(refused)
                continue
            remaining = max(0.0, self.timeout_s - (time.perf_counter() - t0))
            try:
                value = future.result(timeout=remaining)
            except FutureTimeout:
                outcomes.append(ToolOutcome(call.name, f"Error: {call.name} did not answer within "
                                                       f"{self.timeout_s:g} s.", "timeout", self.timeout_s))
                continue
            except BaseException as e:  # noqa: BLE001 - raised in the tool's thread (SystemExit too): the model's information
                outcomes.append(ToolOutcome(call.name, f"Error: {call.name} raised {type(e).__name__}: {e}",
                                            "raised", time.perf_counter() - t0))
                continue
            seconds = time.perf_counter() - t0
            if not isinstance(value, str):
                outcomes.append(ToolOutcome(call.name, f"Error: {call.name} returned {type(value).__name__}, not "
                                                       f"text.", "not_text", seconds))
                continue
            outcomes.append(ToolOutcome(call.name, value, None, seconds))
        return outcomes
