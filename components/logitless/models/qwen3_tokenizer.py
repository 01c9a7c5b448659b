"""The Qwen3 tokenizer: Qwen2.5's byte-level BPE with Qwen3's chat template and ``enable_thinking``.

Qwen3's vocabulary is Qwen2.5's plus four added tokens: ``<tool_response>``, ``</tool_response>``,
``<think>`` and ``</think>`` (ids 151665-151668). Its chat template (:data:`QWEN3_CHAT_TEMPLATE`, the
Jinja text of the ``Qwen/Qwen3-*`` ``tokenizer_config.json``) differs from Qwen2.5's ChatML in how
assistant turns carry reasoning:

* an assistant turn after the last user query is written ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``
  (the final turn always, with an empty reasoning if it has none); earlier assistant turns lose
  their reasoning (the text up to ``</think>``);
* the generation prompt is ``<|im_start|>assistant\\n``, followed by an empty think block
  ``<think>\\n\\n</think>\\n\\n`` when ``enable_thinking`` is false: the model then answers directly.

:class:`Qwen3Tokenizer` renders messages that way (torchtune's conventions otherwise: a final EMPTY
assistant message is the generation prompt; a final assistant message with content has no
``<|im_end|>\\n`` footer, the eos that ``add_eos`` appends closes it; every token of a message carries
its ``masked`` flag), tokenising each message's text in one ``encode`` call so the ids equal those of
transformers' ``apply_chat_template(..., tokenize=True)``. ``decode(skip_special_tokens=True)`` drops
only the tokens Hugging Face marks special: ``<think>`` / ``</think>`` / ``<tool_call>`` stay in the
text (reward functions read them).

Example:
    >>> tok = qwen3_tokenizer("Qwen3-1.7B/vocab.json", "Qwen3-1.7B/merges.txt",
    ...                       special_tokens_path="Qwen3-1.7B/tokenizer.json", enable_thinking=False)
    >>> ids, _ = tok.tokenize_messages([Message("user", "2+2?"), Message("assistant", "")], add_eos=False)
    >>> tok.decode(ids)
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from torchtune.data import Message, truncate
from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS, Qwen2_5Tokenizer

__all__ = ["QWEN3_CHAT_TEMPLATE", "QWEN3_SPECIAL_TOKENS", "Qwen3Tokenizer", "qwen3_tokenizer", "split_think"]

QWEN3_SPECIAL_TOKENS: Dict[str, int] = {
    **QWEN2_5_SPECIAL_TOKENS,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}
# Added tokens Hugging Face does not mark special (kept by decode(skip_special_tokens=True)).
_NOT_SPECIAL = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_EMPTY_THINK = "<think>\n\n</think>\n\n"

#: Qwen3's chat template (``chat_template`` of the ``Qwen/Qwen3-*`` ``tokenizer_config.json``), which
#: :class:`Qwen3Tokenizer` reproduces for system / user / assistant / tool turns; written into the
#: ``tokenizer_config.json`` of the bundled tiny Qwen3 and of exported Qwen3 checkpoints.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def split_think(text: str) -> Tuple[str, str]:
    """``(reasoning, answer)`` of an assistant text as Qwen3's template splits it: with a ``</think>``,
    the reasoning is the text before the first one (after its ``<think>``, newlines trimmed) and the
    answer the text after the last one (leading newlines trimmed); without, no reasoning.

    Example:
        >>> split_think("<think>\\n2 + 2 is 4\\n</think>\\n\\n#### 4")
        ('2 + 2 is 4', '#### 4')
    """
    if _THINK_CLOSE not in text:
        return "", text
    reasoning = text.split(_THINK_CLOSE)[0].rstrip("\n").split(_THINK_OPEN)[-1].lstrip("\n")
    return reasoning, text.split(_THINK_CLOSE)[-1].lstrip("\n")


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


class Qwen3Tokenizer(Qwen2_5Tokenizer):
    """torchtune's Qwen2.5 tokenizer (BPE, special tokens, eos ``<|im_end|>``, pad ``<|endoftext|>``)
    with Qwen3's chat template.

    Args:
        path (str): ``vocab.json``.
        merges_file (str): ``merges.txt``.
        special_tokens (Dict[str, int]): every added token (default :data:`QWEN3_SPECIAL_TOKENS`).
        max_seq_len (Optional[int]): truncation length of ``tokenize_messages``.
        enable_thinking (bool): the generation prompt lets the model think (``<|im_start|>assistant\\n``,
            Hugging Face's default) or closes an empty think block after it (False).
        kept_on_decode (Optional[Iterable[str]]): added tokens ``decode(skip_special_tokens=True)``
            keeps (those Hugging Face marks ``"special": false``; default Qwen3's).
        **kwargs: ``Qwen2_5Tokenizer``'s keyword arguments (``prompt_template``, ``eos_token``, ...).

    Example:
        >>> tok = Qwen3Tokenizer("vocab.json", "merges.txt", enable_thinking=False)
    """

    def __init__(self, path: str, merges_file: str, special_tokens: Dict[str, int] = QWEN3_SPECIAL_TOKENS,
                 max_seq_len: Optional[int] = None, *, enable_thinking: bool = True,
                 kept_on_decode: Optional[Iterable[str]] = None, **kwargs):
        missing = [t for t in ("<think>", "</think>") if t not in special_tokens]
        if missing:
            raise ValueError(f"Qwen3Tokenizer: the special tokens lack {missing}; expected Qwen3's added tokens "
                             f"(tokenizer.json of a Qwen3 checkpoint)")
        super().__init__(path=path, merges_file=merges_file, special_tokens=special_tokens, max_seq_len=max_seq_len,
                         **kwargs)
        self.enable_thinking = bool(enable_thinking)
        kept = set(_NOT_SPECIAL if kept_on_decode is None else kept_on_decode)
        self._skipped_on_decode = {i for t, i in self.special_tokens.items() if t not in kept}

    # ------------------------------------------------------------------ rendering
    def render_messages(self, messages: Sequence[Message]) -> List[str]:
        """The text of each message as Qwen3's template writes it (torchtune's conventions for a final
        assistant message, see the module docstring); tokens are these texts encoded one by one."""
        last_query = len(messages) - 1
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            if m.role == "user" and not _is_tool_response(m.text_content):
                last_query = i
                break
        return [self._render(messages, i, last_query) for i in range(len(messages))]

    def _render(self, messages: Sequence[Message], i: int, last_query: int) -> str:
        m, last = messages[i], i == len(messages) - 1
        text = m.text_content
        if m.role in ("system", "user"):
            return f"<|im_start|>{m.role}\n{text}<|im_end|>\n"
        if m.role == "ipython":  # a tool's response (Hugging Face's role "tool")
            first_of_run = i == 0 or messages[i - 1].role != "ipython"
            last_of_run = last or messages[i + 1].role != "ipython"
            return (("<|im_start|>user" if first_of_run else "") + f"\n<tool_response>\n{text}\n</tool_response>"
                    + ("<|im_end|>\n" if last_of_run else ""))
        if m.role != "assistant":
            raise ValueError(f"Qwen3Tokenizer: message {i} has role {m.role!r}; expected system, user, assistant "
                             f"or ipython")
        footer = "" if last else "<|im_end|>\n"  # the eos add_eos appends closes a final turn
        if last and not text:  # the open turn: the generation prompt
            return "<|im_start|>assistant\n" + ("" if self.enable_thinking else _EMPTY_THINK)
        if m.ipython:  # a tool call (its content is the call's JSON)
            return f"<|im_start|>assistant\n<tool_call>\n{text}\n</tool_call>{footer}"
        reasoning, answer = split_think(text)
        if i > last_query and (last or reasoning):
            body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + answer.lstrip("\n")
        else:
            body = answer
        return "<|im_start|>assistant\n" + body + footer

    def tokenize_messages(self, messages: List[Message], *, add_eos: bool = True) -> Tuple[List[int], List[bool]]:
        """Token ids and loss mask of ``messages`` in Qwen3's chat layout.

        Args:
            messages (List[Message]): the conversation; a final empty assistant message opens the turn
                the model completes (the generation prompt, with ``enable_thinking``'s think block).
            add_eos (bool): append ``eos_id`` (``<|im_end|>``): closes a final assistant turn.

        Returns:
            Tuple[List[int], List[bool]]: the ids and, per id, its message's ``masked`` flag;
            truncated to ``max_seq_len`` as torchtune's Qwen2.5 tokenizer does.
        """
        templated = self.prompt_template(messages) if self.prompt_template is not None else messages
        tokens: List[int] = []
        mask: List[bool] = []
        for message, text in zip(templated, self.render_messages(templated)):
            ids = self.encode(text, add_bos=False, add_eos=False)
            tokens.extend(ids)
            mask.extend([message.masked] * len(ids))
            if self.max_seq_len and len(tokens) >= self.max_seq_len:
                break
        if add_eos:
            tokens.append(self.eos_id)
            mask.append(mask[-1] if mask else True)
        if self.max_seq_len:
            tokens = truncate(tokens, self.max_seq_len, self.eos_id if add_eos else None)
            mask = truncate(mask, self.max_seq_len, True if add_eos else None)
        return tokens, mask

    def decode(self, token_ids: List[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; ``skip_special_tokens`` drops the tokens Hugging Face marks special
        (``<|im_end|>``, ``<|endoftext|>``, ...) and keeps ``<think>``, ``</think>``, ``<tool_call>``, ...

        Example:
            >>> tok.decode([think_id, *tok.encode("4", add_eos=False), im_end_id], skip_special_tokens=True)
            '<think>4'
        """
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self._skipped_on_decode]
        return super().decode(token_ids, skip_special_tokens=False)


def _added_tokens(tokenizer_json: str) -> Tuple[Dict[str, int], List[str]]:
    """``({content: id}, [contents Hugging Face does not mark special])`` of a ``tokenizer.json``."""
    added = json.loads(Path(tokenizer_json).read_text())["added_tokens"]
    return {t["content"]: t["id"] for t in added}, [t["content"] for t in added if not t.get("special", False)]


def qwen3_tokenizer(path: str, merges_file: str, special_tokens_path: Optional[str] = None,
                    max_seq_len: Optional[int] = None, enable_thinking: bool = True, prompt_template=None,
                    **kwargs) -> Qwen3Tokenizer:
    """The Qwen3 tokenizer of a checkpoint's files.

    Args:
        path (str): ``vocab.json``.
        merges_file (str): ``merges.txt``.
        special_tokens_path (Optional[str]): ``tokenizer.json``: its ``added_tokens`` give the special
            tokens and which ones ``decode(skip_special_tokens=True)`` keeps; None: Qwen3's.
        max_seq_len (Optional[int]): truncation length.
        enable_thinking (bool): see :class:`Qwen3Tokenizer`.
        prompt_template: a torchtune prompt template (an instance, a dotted path or a role mapping).
        **kwargs: :class:`Qwen3Tokenizer` keyword arguments.

    Returns:
        Qwen3Tokenizer: the tokenizer.
    """
    from torchtune.data._prompt_templates import _get_prompt_template

    special, kept = (QWEN3_SPECIAL_TOKENS, None) if special_tokens_path is None else _added_tokens(special_tokens_path)
    template = None if prompt_template is None else _get_prompt_template(prompt_template)
    return Qwen3Tokenizer(path, merges_file, special_tokens=special, max_seq_len=max_seq_len,
                          enable_thinking=enable_thinking, kept_on_decode=kept, prompt_template=template, **kwargs)
