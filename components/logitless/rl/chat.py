"""Conversational prompts: a list of messages rendered with the model's chat template.

A conversational prompt is what TRL calls a conversational dataset row: a list of
``{"role": "system" | "user" | "assistant", "content": str}`` mappings. It is turned into torchtune
``Message`` objects and tokenised with the tokenizer's own ``tokenize_messages`` (Qwen2.5's
ChatML template for the shipped configs), followed by an open assistant turn: torchtune 0.6.1's
``Qwen2_5Tokenizer`` writes no end-of-turn after a final assistant message, so an empty one gives
``<|im_start|>assistant\\n``, what Hugging Face's ``apply_chat_template(..., add_generation_prompt=True)``
ends with. The policy's completion continues from there and ends with ``<|im_end|>`` (a stop token).

Unlike Hugging Face's Qwen2.5 template, torchtune's adds no default system message when there is
none ("You are Qwen, created by Alibaba Cloud..."): give one explicitly (``system_prompt``) when the
model was tuned with it.
"""

from typing import Any, List, Mapping, Optional, Sequence, Tuple

__all__ = ["ROLES", "chat_messages", "is_conversation", "render_chat_prompt", "to_messages"]

#: Roles a prompt may hold (an earlier assistant turn is allowed, e.g. a few-shot example).
ROLES = ("system", "user", "assistant")


def is_conversation(prompt: Any) -> bool:
    """Whether ``prompt`` is a list of messages (a conversational row) rather than a string."""
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) for m in prompt)


def chat_messages(prompt: Sequence[Mapping[str, Any]], *, system_prompt: Optional[str] = None,
                  where: str = "prompt") -> List[dict]:
    """The validated messages of a conversational prompt, as ``{"role", "content"}`` dicts (what a
    chat template or an environment's ``reset`` takes), with ``system_prompt`` first when it has none.

    Args:
        prompt (Sequence[Mapping]): ``[{"role": ..., "content": str}, ...]``; the last message must be
            a user turn.
        system_prompt (Optional[str]): a system message put first when the prompt has none.
        where (str): names the row in error messages.

    Returns:
        List[dict]: the messages (no open assistant turn).

    Raises:
        ValueError: naming the row and message for an unknown role, non-string content, an empty
            conversation or one that does not end with a user turn.

    Example:
        >>> chat_messages([{"role": "user", "content": "1+1="}], system_prompt="Be brief.")[0]
        {'role': 'system', 'content': 'Be brief.'}
    """
    if not prompt:
        raise ValueError(f"{where}: a conversational prompt needs at least one message, got an empty list")
    messages = []
    for i, m in enumerate(prompt):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}[{i}].role: expected one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"{where}[{i}].content: expected a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message must be the user's turn (the completion answers it), "
                         f"got role {messages[-1]['role']!r}")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def to_messages(prompt: Sequence[Mapping[str, Any]], *, system_prompt: Optional[str] = None,
                where: str = "prompt") -> list:
    """Validated torchtune ``Message`` objects of a conversational prompt, with an open assistant turn.

    Args:
        prompt, system_prompt, where: as :func:`chat_messages` (which validates them).

    Returns:
        list: ``torchtune.data.Message`` objects, ending with an empty assistant message.

    Example:
        >>> [m.role for m in to_messages([{"role": "user", "content": "1+1="}], system_prompt="Be brief.")]
        ['system', 'user', 'assistant']
    """
    from torchtune.data import Message

    messages = [Message(role=m["role"], content=m["content"])
                for m in chat_messages(prompt, system_prompt=system_prompt, where=where)]
    return messages + [Message(role="assistant", content="")]


def render_chat_prompt(tokenizer: Any, prompt: Sequence[Mapping[str, Any]], *,
                       system_prompt: Optional[str] = None, where: str = "prompt") -> Tuple[List[int], str]:
    """Tokens and text of a conversational prompt through the tokenizer's chat template.

    Args:
        tokenizer: a torchtune tokenizer with ``tokenize_messages`` (and ``decode``).
        prompt (Sequence[Mapping]): the messages (see :func:`to_messages`).
        system_prompt (Optional[str]): system message when the prompt has none.
        where (str): names the row in error messages.

    Returns:
        Tuple[List[int], str]: the prompt tokens, ending with the open assistant header, and their
        text with the template's special tokens (what completion logs show).

    Example:
        >>> from logitless.datasets import tiny_qwen2_5_tokenizer
        >>> tokens, text = render_chat_prompt(tiny_qwen2_5_tokenizer(), [{"role": "user", "content": "3+4="}])
        >>> text
        '<|im_start|>user\\n3+4=<|im_end|>\\n<|im_start|>assistant\\n'
    """
    if not hasattr(tokenizer, "tokenize_messages"):
        raise ValueError(f"{where}: a conversational prompt needs a tokenizer with a chat template "
                         f"(tokenize_messages); {type(tokenizer).__name__} has none")
    messages = to_messages(prompt, system_prompt=system_prompt, where=where)
    tokens, _ = tokenizer.tokenize_messages(messages, add_eos=False)
    return list(tokens), tokenizer.decode(list(tokens), skip_special_tokens=False)
