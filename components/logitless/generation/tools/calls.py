"""Tool calls parsed from the text of one model turn.

Two syntaxes, those the supported chat templates teach their models:

- ``"hermes"`` (Qwen2.5, Qwen3): each call is a JSON object inside ``<tool_call>...</tool_call>``,
  ``{"name": <function-name>, "arguments": <args-json-object>}``; several calls may follow each
  other in one turn; the text before the first call is the turn's content.
- ``"llama3_json"`` (Llama 3.1-3.3 custom tools): the whole turn is one JSON object
  ``{"name": <function-name>, "parameters": <args-json-object>}`` (``"arguments"`` accepted too),
  optionally after ``<|python_tag|>``; a turn that does not start with ``{`` is a plain answer.

A call the model writes wrong (not JSON, not an object, no name, arguments that are not an object,
an unclosed ``<tool_call>``) does not stop anything: it becomes an error message addressed to the
model (:attr:`ParsedTurn.errors`), which the environment answers as the tool's response, and it
counts as a tool error.

Example:
    >>> turn = parse_tool_calls('Let me add.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1, "b": 2}}\\n'
    ...                         '</tool_call>', "hermes")
    >>> turn.content, turn.calls[0].name, turn.calls[0].arguments
    ('Let me add.', 'add', {'a': 1, 'b': 2})
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List

__all__ = ["CALL_SYNTAXES", "ParsedTurn", "ToolCall", "parse_tool_calls"]

CALL_SYNTAXES = ("hermes", "llama3_json")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)" + re.escape(_HERMES_CLOSE), re.DOTALL)
_HERMES_EXPECTED = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
_LLAMA_TAG = "<|python_tag|>"
_LLAMA_EXPECTED = '{"name": <function-name>, "parameters": <args-json-object>}'


@dataclass(frozen=True)
class ToolCall:
    """One call the model made.

    Attributes:
        name (str): the tool's name.
        arguments (Dict[str, Any]): its keyword arguments, as the model wrote them (JSON values).
    """

    name: str
    arguments: Dict[str, Any]

    def as_message_entry(self) -> Dict[str, Any]:
        """The entry of an assistant message's ``tool_calls`` (the layout chat templates read)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """What one model turn says.

    Attributes:
        content (str): the text outside the calls (before the first one), stripped.
        calls (List[ToolCall]): the well-formed calls, in order.
        errors (List[str]): one message per malformed call, written for the model to read.
    """

    content: str
    calls: List[ToolCall] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)

    @property
    def num_calls(self) -> int:
        """Calls the model attempted: well-formed and malformed."""
        return len(self.calls) + len(self.errors)

    def assistant_message(self) -> Dict[str, Any]:
        """The turn as a chat message: ``{"role": "assistant", "content", "tool_calls"?, "tool_call_errors"?}``.

        ``tool_calls`` holds the well-formed calls in the layout chat templates render; the extra
        ``tool_call_errors`` key (ignored by templates) carries the malformed ones to the environment.
        """
        message: Dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [c.as_message_entry() for c in self.calls]
        if self.errors:
            message["tool_call_errors"] = list(self.errors)
        return message


def _call_from_json(text: str, index: int, argument_keys: tuple, expected: str):
    """A ToolCall, or the error message of a malformed one (``index`` counts from 1)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return f"Error: tool call {index} is not valid JSON ({e.msg} at character {e.pos}). Expected {expected}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f"Error: tool call {index} must be a JSON object with a \"name\" string. Expected {expected}"
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if not isinstance(arguments, dict):
        return (f"Error: tool call {index} ({obj['name']}): {key!r} must be a JSON object, got "
                f"{type(arguments).__name__}. Expected {expected}")
    return ToolCall(obj["name"], arguments)


def _parse_hermes(text: str) -> ParsedTurn:
    first = text.find(_HERMES_OPEN)
    if first < 0:
        return ParsedTurn(text.strip())
    turn = ParsedTurn(text[:first].strip())
    blocks = [m.group(1) for m in _HERMES_CALL.finditer(text)]
    closed_end = max((m.end() for m in _HERMES_CALL.finditer(text)), default=first)
    for index, block in enumerate(blocks, start=1):
        out = _call_from_json(block.strip(), index, ("arguments",), _HERMES_EXPECTED)
        (turn.calls if isinstance(out, ToolCall) else turn.errors).append(out)
    if _HERMES_OPEN in text[closed_end:]:
        turn.errors.append(f"Error: tool call {len(blocks) + 1} has no closing </tool_call>. Expected "
                           f"{_HERMES_EXPECTED}")
    return turn


def _parse_llama3_json(text: str) -> ParsedTurn:
    body = text.strip()
    if body.startswith(_LLAMA_TAG):
        body = body[len(_LLAMA_TAG):].strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip())
    out = _call_from_json(body, 1, ("parameters", "arguments"), _LLAMA_EXPECTED)
    if isinstance(out, ToolCall):
        return ParsedTurn("", calls=[out])
    return ParsedTurn("", errors=[out])


def parse_tool_calls(text: str, syntax: str) -> ParsedTurn:
    """The content and tool calls of one model turn (its text, without the end-of-turn token).

    Args:
        text (str): the decoded turn (special tokens kept: ``<tool_call>`` is one).
        syntax (str): ``"hermes"`` or ``"llama3_json"`` (see the module docstring).

    Returns:
        ParsedTurn: the content, the well-formed calls and one error message per malformed call.

    Raises:
        ValueError: an unknown ``syntax``.

    Example:
        >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "hermes").errors[0].split(".")[0]
        "Error: tool call 1 (f): 'arguments' must be a JSON object, got list"
    """
    if syntax == "hermes":
        return _parse_hermes(text)
    if syntax == "llama3_json":
        return _parse_llama3_json(text)
    raise ValueError(f"tool call syntax: expected one of {CALL_SYNTAXES}, got {syntax!r}")
