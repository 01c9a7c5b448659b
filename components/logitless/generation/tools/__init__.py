"""Tool and environment turns: tools as Python callables, their JSON schemas, tool calls parsed from
the policy's text, executed with a timeout, and the conversation continued through the chat template."""

from logitless.generation.tools.schema import ToolSchemaError, tool_schema

__all__ = ["ToolSchemaError", "tool_schema"]
