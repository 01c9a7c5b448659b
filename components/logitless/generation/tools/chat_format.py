"""Tool conversations rendered and tokenised through the model family's chat template.

A :class:`ChatFormat` is one family's Jinja chat template, the text of the token that ends a model
turn in it, and the syntax its models write tool calls in. :class:`ToolChat` binds a format to a
tokenizer and the run's tool schemas and gives the three pieces a multi-turn rollout needs:

- :meth:`ToolChat.prompt`: the prompt's tokens (system turn with the tools block, the messages, the
  open assistant header), as ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``;
- :meth:`ToolChat.parse`: the content and tool calls of the tokens the model sampled for a turn;
- :meth:`ToolChat.continuation`: the tokens appended after a model turn: exactly what the template
  writes after that turn's end-of-turn token for the new (tool or user) messages, then the next
  assistant header. The model's own tokens stay as it sampled them (they are what it is trained
  on, and what the KV cache holds); only the template's text after them is rendered.

The continuation is cut from two renderings: the conversation up to the model's turn, and the same
with the new messages and a generation prompt. The cut is after the end-of-turn token that closes
the model's turn, found by counting end-of-turn tokens (the first rendering holds that many), not
by a text prefix: a template may write earlier turns differently once a turn follows them (Qwen3
drops the empty think block of an assistant turn that is not the last), which a prefix test would
reject, while the turn structure, and so the count, is the same. Text is tokenised piece by piece
between special tokens, as a Hugging Face tokenizer splits on added tokens, so the tokens of a
continuation are those it has inside the whole rendering.

The Jinja environment is transformers' dialect for chat templates: a sandbox, ``trim_blocks`` and
``lstrip_blocks``, the loop-control extension, a ``tojson`` that keeps non-ASCII text and takes
``indent``, ``raise_exception`` and ``strftime_now``; message keys whose value is None are dropped
before rendering, as ``apply_chat_template`` drops them.

Example:
    >>> chat = ToolChat(CHAT_FORMATS["qwen2_5"], tokenizer, tools=[tool_schema(add)])
    >>> ids, text = chat.prompt([{"role": "user", "content": "12345+67890="}])
    >>> turn = chat.parse(sampled_ids)                      # the model's turn, end-of-turn token included
    >>> seg, _ = chat.continuation(history + [turn.assistant_message()], tool_messages)
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from logitless.generation.tools.calls import CALL_SYNTAXES, ParsedTurn, parse_tool_calls
from logitless.generation.tools.templates import LLAMA3_CHAT_TEMPLATE, QWEN2_5_CHAT_TEMPLATE
from logitless.models.qwen3_tokenizer import QWEN3_CHAT_TEMPLATE

__all__ = ["CHAT_FORMATS", "ChatFormat", "ToolChat", "chat_format_for", "encode_with_special_tokens",
           "render_template"]

Message = Dict[str, Any]


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _plain(messages: Sequence[Mapping[str, Any]]) -> List[Message]:
    """Messages as plain dicts without None values (a template tests ``'tool_calls' in message``)."""
    return [{k: v for k, v in dict(m).items() if v is not None} for m in messages]


def render_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                    tools: Optional[Sequence[Mapping[str, Any]]] = None, add_generation_prompt: bool = False,
                    **variables: Any) -> str:
    """The text of ``messages`` through a Jinja chat template (transformers' dialect, see the module docstring).

    Args:
        template (str): the chat template.
        messages (Sequence[Mapping]): ``{"role", "content", "tool_calls"?...}`` mappings.
        tools (Optional[Sequence[Mapping]]): tool schemas (:func:`~logitless.generation.tools.tool_schema`).
        add_generation_prompt (bool): end with the open assistant header.
        **variables: other template variables (``bos_token``, ``enable_thinking``, ``date_string``...).

    Returns:
        str: the rendered conversation.

    Example:
        >>> render_template(QWEN2_5_CHAT_TEMPLATE, [{"role": "system", "content": "Hi."}])
        '<|im_start|>system\\nHi.<|im_end|>\\n'
    """
    return _compiled(template).render(messages=_plain(messages), tools=list(tools) if tools else None,
                                      add_generation_prompt=add_generation_prompt, **variables)


@dataclass(frozen=True)
class ChatFormat:
    """One model family's chat layout for tool turns.

    Attributes:
        name (str): the family (``"qwen2_5"``, ``"qwen3"``, ``"llama3"``).
        template (str): its Jinja chat template.
        end_of_turn (str): the special token that ends a model turn in the rendering (and that the
            sampler stops at): ``<|im_end|>``, ``<|eot_id|>``.
        call_syntax (str): how its models write tool calls (one of
            :data:`~logitless.generation.tools.calls.CALL_SYNTAXES`).
        variables (Mapping[str, Any]): fixed template variables (``bos_token``...).
    """

    name: str
    template: str
    end_of_turn: str
    call_syntax: str
    variables: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.call_syntax not in CALL_SYNTAXES:
            raise ValueError(f"ChatFormat {self.name!r}: call_syntax must be one of {CALL_SYNTAXES}, "
                             f"got {self.call_syntax!r}")

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools=None, add_generation_prompt: bool = False,
               **variables: Any) -> str:
        """:func:`render_template` with this family's template and variables."""
        return render_template(self.template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               **{**self.variables, **variables})

    def continuation_text(self, history: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]],
                          *, tools=None, **variables: Any) -> str:
        """What the template writes after the end-of-turn token of ``history``'s last (model) turn:
        the ``new_messages`` and the next assistant header (see the module docstring).

        Args:
            history (Sequence[Mapping]): the conversation up to and including the model's turn.
            new_messages (Sequence[Mapping]): what the environment answered (tool or user messages).
            tools: the tool schemas the prompt was rendered with.
            **variables: template variables.

        Returns:
            str: the text to append after the model's end-of-turn token.

        Raises:
            ValueError: the template does not close the model's turn with ``end_of_turn``.
        """
        before = self.render(history, tools=tools, add_generation_prompt=False, **variables)
        after = self.render(list(history) + list(new_messages), tools=tools, add_generation_prompt=True,
                            **variables)
        turns = before.count(self.end_of_turn)
        if turns == 0:
            raise ValueError(f"chat format {self.name!r}: the rendered conversation has no {self.end_of_turn!r} "
                             f"closing the model's turn")
        cut = -1
        for _ in range(turns):
            cut = after.find(self.end_of_turn, cut + 1)
            if cut < 0:
                raise ValueError(f"chat format {self.name!r}: adding the new messages removed a turn of the "
                                 f"conversation ({turns} {self.end_of_turn!r} before, fewer after)")
        return after[cut + len(self.end_of_turn):]


CHAT_FORMATS: Dict[str, ChatFormat] = {
    "qwen2_5": ChatFormat("qwen2_5", QWEN2_5_CHAT_TEMPLATE, "<|im_end|>", "hermes"),
    "qwen3": ChatFormat("qwen3", QWEN3_CHAT_TEMPLATE, "<|im_end|>", "hermes"),
    "llama3": ChatFormat("llama3", LLAMA3_CHAT_TEMPLATE, "<|eot_id|>", "llama3_json",
                         {"bos_token": "<|begin_of_text|>"}),
}


def chat_format_for(tokenizer: Any, name: str = "auto") -> ChatFormat:
    """The chat format of ``name``, or (``"auto"``) of the tokenizer's family.

    Args:
        tokenizer: a torchtune tokenizer (its class and special tokens tell the family).
        name (str): ``"auto"`` or a key of :data:`CHAT_FORMATS`.

    Returns:
        ChatFormat: the format.

    Raises:
        ValueError: an unknown name, or a tokenizer whose family ``auto`` cannot tell (the message
            lists the names to set instead).

    Example:
        >>> chat_format_for(tiny_qwen2_5_tokenizer()).name
        'qwen2_5'
    """
    if name != "auto":
        if name not in CHAT_FORMATS:
            raise ValueError(f"chat format: expected 'auto' or one of {sorted(CHAT_FORMATS)}, got {name!r}")
        return CHAT_FORMATS[name]
    specials = getattr(tokenizer, "special_tokens", None) or {}
    kind = type(tokenizer).__name__.lower()
    if "<think>" in specials:
        return CHAT_FORMATS["qwen3"]
    if "<|im_end|>" in specials and "<tool_call>" in specials:
        return CHAT_FORMATS["qwen2_5"]
    if "<|eot_id|>" in specials or "llama3" in kind:
        return CHAT_FORMATS["llama3"]
    raise ValueError(f"chat format 'auto': cannot tell the chat family of {type(tokenizer).__name__}; set it to "
                     f"one of {sorted(CHAT_FORMATS)}")


def encode_with_special_tokens(tokenizer: Any, text: str) -> List[int]:
    """Token ids of rendered chat text: each special token's id, the text between them encoded alone.

    A Hugging Face tokenizer splits its input on added tokens before the BPE, so this gives the ids
    of ``apply_chat_template(..., tokenize=True)``; torchtune's tiktoken tokenizers (Llama 3) would
    otherwise encode ``<|eot_id|>`` as plain text.

    Args:
        tokenizer: a torchtune tokenizer (``special_tokens`` and ``encode(text, add_bos, add_eos)``).
        text (str): the text.

    Returns:
        List[int]: the ids.

    Example:
        >>> encode_with_special_tokens(tiny_qwen2_5_tokenizer(), "<|im_start|>user\\n")[0]
        2027
    """
    specials = getattr(tokenizer, "special_tokens", None) or {}
    pattern = _special_pattern(tuple(sorted(specials, key=len, reverse=True)))
    ids: List[int] = []
    start = 0
    for match in (pattern.finditer(text) if pattern is not None else ()):
        if match.start() > start:
            ids.extend(tokenizer.encode(text[start:match.start()], add_bos=False, add_eos=False))
        ids.append(specials[match.group(0)])
        start = match.end()
    if start < len(text):
        ids.extend(tokenizer.encode(text[start:], add_bos=False, add_eos=False))
    return ids


@functools.lru_cache(maxsize=8)
def _special_pattern(tokens: Tuple[str, ...]):
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


class ToolChat:
    """A chat format bound to a tokenizer and the run's tools (see the module docstring).

    Args:
        chat_format (ChatFormat): the family's layout.
        tokenizer: the torchtune tokenizer (``special_tokens``, ``encode``, ``decode``).
        tools (Optional[Sequence[Mapping]]): the tool schemas rendered in every prompt.
        variables (Optional[Mapping]): template variables; a tokenizer's ``enable_thinking`` (Qwen3)
            is passed unless given here.

    Raises:
        ValueError: the tokenizer has no id for the format's end-of-turn token.
    """

    def __init__(self, chat_format: ChatFormat, tokenizer: Any, tools: Optional[Sequence[Mapping[str, Any]]] = None,
                 variables: Optional[Mapping[str, Any]] = None):
        self.format, self.tokenizer = chat_format, tokenizer
        self.tools = list(tools) if tools else None
        self.variables = dict(variables or {})
        if getattr(tokenizer, "enable_thinking", None) is not None:
            self.variables.setdefault("enable_thinking", bool(tokenizer.enable_thinking))
        specials = getattr(tokenizer, "special_tokens", None) or {}
        if chat_format.end_of_turn not in specials:
            raise ValueError(f"chat format {chat_format.name!r}: the tokenizer {type(tokenizer).__name__} has no "
                             f"special token {chat_format.end_of_turn!r} (its end of turn); choose the format of "
                             f"the model's family")
        self.end_of_turn_id = specials[chat_format.end_of_turn]

    def encode(self, text: str) -> List[int]:
        return encode_with_special_tokens(self.tokenizer, text)

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> Tuple[List[int], str]:
        """Tokens and text of the prompt: ``messages`` with the tools, ending with the open assistant header."""
        text = self.format.render(messages, tools=self.tools, add_generation_prompt=True, **self.variables)
        return self.encode(text), text

    def parse(self, turn_ids: Sequence[int], stop_ids: Sequence[int] = ()) -> ParsedTurn:
        """The content and tool calls of the tokens the model sampled for one turn.

        Args:
            turn_ids (Sequence[int]): the turn's tokens.
            stop_ids (Sequence[int]): the sampler's stop tokens; one ending the turn is not part of
                its text (the format's end-of-turn token never is).
        """
        ids = [int(t) for t in turn_ids]
        if ids and (ids[-1] == self.end_of_turn_id or ids[-1] in set(int(s) for s in stop_ids)):
            ids = ids[:-1]
        return parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=False), self.format.call_syntax)

    def continuation(self, history: Sequence[Mapping[str, Any]],
                     new_messages: Sequence[Mapping[str, Any]]) -> Tuple[List[int], str]:
        """Tokens and text appended after the model's turn (:meth:`ChatFormat.continuation_text`)."""
        text = self.format.continuation_text(history, new_messages, tools=self.tools, **self.variables)
        return self.encode(text), text
