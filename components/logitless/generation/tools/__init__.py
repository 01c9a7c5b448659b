"""Tool and environment turns: tools as Python callables, their JSON schemas, tool calls parsed from
the policy's text, executed with a timeout, and the conversation continued through the chat template.

Example:
    >>> from logitless.generation.tools import CHAT_FORMATS, ToolChat, ToolExecutor, tool_schema
    >>> chat = ToolChat(CHAT_FORMATS["qwen2_5"], tokenizer, tools=[tool_schema(add)])
"""

from logitless.generation.tools.calls import CALL_SYNTAXES, ParsedTurn, ToolCall, parse_tool_calls
from logitless.generation.tools.chat_format import (CHAT_FORMATS, ChatFormat, ToolChat, chat_format_for,
                                                    encode_with_special_tokens, render_template)
from logitless.generation.tools.execution import ToolExecutor, ToolOutcome
from logitless.generation.tools.schema import ToolSchemaError, tool_schema

__all__ = [
    "CALL_SYNTAXES", "CHAT_FORMATS", "ChatFormat", "ParsedTurn", "ToolCall", "ToolChat", "ToolExecutor",
    "ToolOutcome", "ToolSchemaError", "chat_format_for", "encode_with_special_tokens", "parse_tool_calls",
    "render_template", "tool_schema",
]
