"""A tool's JSON schema from its Python signature and Google-style docstring.

A tool is a plain Python callable with type hints and a docstring that describes every argument::

    def add(a: int, b: int) -> str:
        '''Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        '''

:func:`tool_schema` turns it into the ``{"type": "function", "function": {...}}`` mapping chat
templates render in their tools block, the same mapping as transformers'
``transformers.utils.get_json_schema`` (what ``apply_chat_template(..., tools=[add])`` renders), so
a model sees the tools in the layout it was tuned on:

- the description is the docstring before ``Args:`` / ``Returns:`` / ``Raises:``;
- each argument's description comes from ``Args:`` (a trailing ``(choices: [...])`` becomes an
  ``enum``); an argument without a type hint or a description is an error;
- types: ``int`` -> integer, ``float`` -> number, ``str``, ``bool``, ``None`` -> null, ``list[T]`` ->
  array of T, ``tuple[A, B]`` -> array with ``prefixItems``, ``dict[str, T]`` -> object with
  ``additionalProperties``, ``Literal`` / ``Enum`` -> enum, ``Optional`` -> ``nullable``, other unions
  -> a list of types (or ``anyOf`` when a member has more than a type);
- arguments without a default are ``required``; a convertible return hint is ``return`` (with the
  ``Returns:`` text as its description).

Example:
    >>> tool_schema(add)["function"]["parameters"]["required"]
    ['a', 'b']
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["ToolSchemaError", "tool_schema"]

#: JSON type names of the Python scalars a JSON value can hold (the members of an ``enum``).
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
#: Bare (unparameterised) hints and their schema.
_BARE = {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"},
         bool: {"type": "boolean"}, type(None): {"type": "null"}, list: {"type": "array"},
         tuple: {"type": "array"}, dict: {"type": "object"}, typing.Any: {}}

#: Section headers of a Google-style docstring, each alone on its line.
_SECTIONS = ("Args:", "Returns:", "Raises:")
#: The first line of an argument's entry: ``name: text`` or ``name (type): text``.
_ARG_LINE = re.compile(r"^(\w+)(?:[ \t]*\([^()\n]*\))?:[ \t]*(.*)$")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


class ToolSchemaError(ValueError):
    """A tool's signature or docstring cannot be written as a JSON schema (the message names the tool)."""


def _enum(values: list, where: str) -> Dict[str, Any]:
    if not values:
        raise ToolSchemaError(f"{where}: an enum needs at least one value")
    bad = [v for v in values if type(v) not in _SCALARS]
    if bad:
        raise ToolSchemaError(f"{where}: enum values must be int, float, str, bool or None, got {bad!r}")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def _hint_schema(hint: Any, where: str) -> Dict[str, Any]:
    """The JSON schema of one type hint (see the module docstring for the mapping)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum([member.value for member in hint], f"{where} (Enum {hint.__name__})")
        try:
            known = _BARE.get(hint)
        except TypeError:  # an unhashable hint
            known = None
        if known is None:
            raise ToolSchemaError(f"{where}: cannot write the type hint {hint!r} as JSON; use int, float, str, bool, "
                                  f"None, Enum, Literal, or list / tuple / dict / Union of those")
        return dict(known)
    if origin is typing.Union or origin is types.UnionType:
        members = [_hint_schema(a, where) for a in args if a is not type(None)]
        if len(members) == 1:
            out = members[0]
        elif all(set(m) == {"type"} and isinstance(m["type"], str) for m in members):
            names = sorted({m["type"] for m in members})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": members}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal:
        return _enum(list(args), where)
    if origin is list:
        return {"type": "array", "items": _hint_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or Ellipsis in args:
            raise ToolSchemaError(f"{where}: tuple hints need two or more fixed members (got {hint!r}); "
                                  f"use list[...] for a variable length")
        return {"type": "array", "prefixItems": [_hint_schema(a, where) for a in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _hint_schema(args[1], where)
        return out
    raise ToolSchemaError(f"{where}: cannot write the type hint {hint!r} as JSON")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _parse_docstring(doc: str) -> Tuple[Optional[str], Dict[str, str], Optional[str]]:
    """``(description, {argument: text}, returns text)`` of a Google-style docstring.

    The description is everything before the first section header; an argument's text is its first
    line after ``name:`` plus the lines indented deeper than its name, joined with single spaces;
    the returns text is the ``Returns:`` section, stripped.
    """
    lines = doc.split("\n")
    sections = {}  # header -> index of the first line that starts with it
    for i, line in enumerate(lines):
        header = next((h for h in _SECTIONS if line.strip().startswith(h)), None)
        if header is not None and header not in sections:
            sections[header] = i
    first = min(sections.values(), default=len(lines))
    description = "\n".join(lines[:first]).strip() or None

    def body(header: str) -> List[str]:
        if header not in sections:
            return []
        start = sections[header] + 1
        stop = min([i for i in sections.values() if i > sections[header]], default=len(lines))
        return lines[start:stop]

    arguments: Dict[str, str] = {}
    entries = [line for line in body("Args:") if line.strip()]
    base = min((_indent(line) for line in entries), default=0)
    name = None
    for line in entries:
        match = _ARG_LINE.match(line.strip()) if _indent(line) <= base else None
        if match:
            name = match.group(1)
            arguments[name] = match.group(2).strip()
        elif name is not None:  # a continuation line, indented deeper than the entry
            arguments[name] = f"{arguments[name]} {line.strip()}".strip()
    # "Returns: text" on the header's own line is not a Returns section (as transformers reads it)
    has_returns = "Returns:" in sections and lines[sections["Returns:"]].strip() == "Returns:"
    returns = "\n".join(body("Returns:")).strip() if has_returns else None
    return description, arguments, returns


def tool_schema(fn: Callable) -> Dict[str, Any]:
    """The JSON schema of a tool, as chat templates render it (transformers' ``get_json_schema`` layout).

    Args:
        fn (Callable): a function (or a method: an unannotated ``self`` / ``cls`` is skipped) with a
            type hint on every argument and a Google-style docstring describing each of them.

    Returns:
        Dict[str, Any]: ``{"type": "function", "function": {"name", "description", "parameters"
        [, "return"]}}``; ``parameters`` is ``{"type": "object", "properties": {...}[, "required": [...]]}``.

    Raises:
        ToolSchemaError: naming the tool and the argument: no docstring, an argument without a type
            hint or a description, a type that JSON cannot express.

    Example:
        >>> def add(a: int, b: int = 0):
        ...     '''Adds.
        ...
        ...     Args:
        ...         a: first.
        ...         b: second.
        ...     '''
        >>> tool_schema(add)["function"]["parameters"]
        {'type': 'object', 'properties': {'a': {'type': 'integer', 'description': 'first.'}, 'b': {'type': 'integer', 'description': 'second.'}}, 'required': ['a']}
    """
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolSchemaError(f"tool {name!r}: it has no docstring; a tool needs a Google-style docstring with a "
                              f"description and an 'Args:' entry per argument (the model reads them)")
    description, arg_docs, returns_doc = _parse_docstring(doc.strip())
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation that does not evaluate
        raise ToolSchemaError(f"tool {name!r}: its type hints do not evaluate: {e}") from e
    params = list(inspect.signature(fn).parameters.values())
    receiver = (params[0].name if params and params[0].name in ("self", "cls")
                and params[0].annotation is inspect.Parameter.empty else None)
    required = []
    for p in params:
        if p.name == receiver:
            continue
        if p.annotation is inspect.Parameter.empty:
            raise ToolSchemaError(f"tool {name!r}: argument {p.name!r} has no type hint (the schema's type comes "
                                  f"from it)")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    properties: Dict[str, Any] = {}
    returns = None
    for arg, hint in hints.items():
        if arg == receiver:
            continue
        if arg == "return":
            # the model never writes the return value: a hint JSON cannot express is left out, not an error
            try:
                returns = _hint_schema(hint, f"tool {name!r} return")
            except ToolSchemaError:
                pass
            continue
        properties[arg] = _hint_schema(hint, f"tool {name!r} argument {arg!r}")
    for arg, schema in properties.items():
        if arg not in arg_docs:
            raise ToolSchemaError(f"tool {name!r}: the docstring has no description of argument {arg!r} (expected "
                                  f"an 'Args:' block with '{arg}: <what it is>')")
        text = arg_docs[arg]
        choices = _CHOICES.search(text)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[:choices.start()].strip()
        schema["description"] = text
    parameters: Dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function: Dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        if returns_doc is not None:
            returns["description"] = returns_doc
        function["return"] = returns
    return {"type": "function", "function": function}
