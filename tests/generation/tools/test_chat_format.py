"""Tool conversations: prompt, parsed calls and continuations equal transformers' apply_chat_template.

The chat templates (logitless.generation.tools.templates) were written from our knowledge of the
published Qwen2.5-Instruct and Llama-3.1-Instruct ``chat_template`` strings (no download is possible
here). The oracle is transformers: a tokenizer built from the bundled tiny tokenizer files with that
template, saved and loaded back, rendering and tokenising the same conversation with
``apply_chat_template(..., tools=[functions])`` (its own get_json_schema, Jinja environment and
tokenizer). Our side assembles a rollout the way the sampler does: prompt tokens, the model's turn
tokens as sampled, then the continuation tokens after each turn.
"""

import pytest

from logitless.datasets import TINY_TOKENIZER_DIR, tiny_qwen2_5_tokenizer
from logitless.generation.tools import CHAT_FORMATS, ToolChat, ToolCall, chat_format_for, tool_schema

transformers = pytest.importorskip("transformers")


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


def lookup(word: str, lang: str = "en") -> str:
    """Looks a word up in the dictionary.

    Args:
        word: The word; non-ASCII text like "café" stays as is.
        lang: The dictionary's language (choices: ["en", "fr"])
    """
    return word


def _hf_tokenizer(tmp_path, template, extra_special=(), bos_token=None):
    tok = transformers.AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))
    if extra_special:
        tok.add_special_tokens({"additional_special_tokens": list(extra_special)})
    if bos_token is not None:
        tok.bos_token = bos_token
    tok.chat_template = template
    tok.save_pretrained(str(tmp_path / "hf"))
    return transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))


def _hf_ids(hf, messages, **kw):
    out = hf.apply_chat_template(messages, tools=[add, lookup], tokenize=True, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# A conversation with every kind of tool turn: content before two parallel calls, two tool answers
# (grouped into one turn by Qwen's template), a call without content, an answer, the final reply.
SYSTEM = {"role": "system", "content": "You add numbers with the add tool."}
USER = {"role": "user", "content": "What is 12 + 30, and then + 7? Also look up café."}
TURNS = [
    ({"role": "assistant", "content": "Let me compute.", "tool_calls": [_call("add", a=12, b=30),
                                                                       _call("lookup", word="café", lang="fr")]},
     'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>\n'
     '<tool_call>\n{"name": "lookup", "arguments": {"word": "café", "lang": "fr"}}\n</tool_call>',
     [{"role": "tool", "name": "add", "content": "42"}, {"role": "tool", "name": "lookup", "content": "café"}]),
    ({"role": "assistant", "content": "", "tool_calls": [_call("add", a=42, b=7)]},
     '<tool_call>\n{"name": "add", "arguments": {"a": 42, "b": 7}}\n</tool_call>',
     [{"role": "tool", "name": "add", "content": "49"}]),
]
FINAL = ({"role": "assistant", "content": "12 + 30 + 7 = 49.\n#### 49"}, "12 + 30 + 7 = 49.\n#### 49")


def _check_rollout(hf, chat, tokenizer, eot_id):
    """Prompt, parsed calls and continuations against apply_chat_template; returns nothing."""
    messages = [SYSTEM, USER]
    prompt, _ = chat.prompt(messages)
    assert prompt == _hf_ids(hf, messages, add_generation_prompt=True)
    rollout = list(prompt)
    for message, sampled_text, answers in TURNS:
        sampled = chat.encode(sampled_text) + [eot_id]  # the model's turn, as it would sample it
        turn = chat.parse(sampled)
        assert turn.errors == []
        assert turn.calls == [ToolCall(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"]]
        assert turn.content == message["content"]
        messages = messages + [turn.assistant_message()]
        segment, _ = chat.continuation(messages, answers)
        messages = messages + answers
        rollout += sampled + segment
        # after every turn: the rollout so far is the template's rendering with a generation prompt
        assert rollout == _hf_ids(hf, messages, add_generation_prompt=True)
    final_message, final_text = FINAL
    rollout += chat.encode(final_text) + [eot_id]
    whole = _hf_ids(hf, messages + [final_message])
    assert rollout == whole[:len(rollout)]
    assert tokenizer.decode(whole[len(rollout):], skip_special_tokens=False).strip() == ""  # the template's "\n"


def test_qwen2_5_rollout_equals_apply_chat_template(tmp_path):
    fmt = CHAT_FORMATS["qwen2_5"]
    tokenizer = tiny_qwen2_5_tokenizer()
    assert chat_format_for(tokenizer) is fmt
    hf = _hf_tokenizer(tmp_path, fmt.template)
    chat = ToolChat(fmt, tokenizer, tools=[tool_schema(add), tool_schema(lookup)])
    _check_rollout(hf, chat, tokenizer, tokenizer.special_tokens["<|im_end|>"])
    # no system message: the template's default one, with the tools after it
    assert chat.prompt([USER])[0] == _hf_ids(hf, [USER], add_generation_prompt=True)


LLAMA_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>")


def test_llama3_rollout_equals_apply_chat_template(tmp_path):
    """Llama 3.1's template (one call per turn, tools in the first user turn, JSON-encoded tool
    answers) on the tiny BPE with Llama's special tokens added after its vocabulary."""
    from torchtune.models.qwen2_5._tokenizer import Qwen2_5Tokenizer

    base = tiny_qwen2_5_tokenizer()
    fmt = CHAT_FORMATS["llama3"]
    hf = _hf_tokenizer(tmp_path, fmt.template, LLAMA_SPECIALS, bos_token="<|begin_of_text|>")
    specials = {**base.special_tokens, **{t: hf.convert_tokens_to_ids(t) for t in LLAMA_SPECIALS}}
    tokenizer = Qwen2_5Tokenizer(str(TINY_TOKENIZER_DIR / "vocab.json"), str(TINY_TOKENIZER_DIR / "merges.txt"),
                                 special_tokens=specials)
    chat = ToolChat(fmt, tokenizer, tools=[tool_schema(add), tool_schema(lookup)])
    messages = [SYSTEM, USER]
    prompt, _ = chat.prompt(messages)
    assert prompt == _hf_ids(hf, messages, add_generation_prompt=True)
    sampled = chat.encode('{"name": "add", "parameters": {"a": 12, "b": 30}}') + [specials["<|eot_id|>"]]
    turn = chat.parse(sampled)
    assert turn.calls == [ToolCall("add", {"a": 12, "b": 30})] and turn.errors == []
    messages = messages + [turn.assistant_message()]
    answers = [{"role": "tool", "name": "add", "content": "42"}]
    segment, text = chat.continuation(messages, answers)
    assert text.startswith("<|start_header_id|>ipython<|end_header_id|>\n\n\"42\"<|eot_id|>")
    assert prompt + sampled + segment == _hf_ids(hf, messages + answers, add_generation_prompt=True)


@pytest.mark.parametrize("text, error", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "not valid JSON"),
    ('<tool_call>\n["add"]\n</tool_call>', 'a "name" string'),
    ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "must be a JSON object"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "no closing </tool_call>"),
])
def test_malformed_calls_become_messages_to_the_model(text, error):
    tokenizer = tiny_qwen2_5_tokenizer()
    chat = ToolChat(CHAT_FORMATS["qwen2_5"], tokenizer, tools=[tool_schema(add)])
    turn = chat.parse(chat.encode(text) + [tokenizer.special_tokens["<|im_end|>"]])
    assert turn.calls == [] and len(turn.errors) == 1 and error in turn.errors[0]
    assert turn.errors[0].startswith("Error: tool call 1")
    # the turn still renders, and the conversation goes on with the error as the tool's answer
    segment, seg_text = chat.continuation([USER, turn.assistant_message()],
                                          [{"role": "tool", "content": turn.errors[0]}])
    assert seg_text.startswith("\n<|im_start|>user\n<tool_response>\nError: tool call 1")


def test_a_turn_without_calls_has_none():
    tokenizer = tiny_qwen2_5_tokenizer()
    chat = ToolChat(CHAT_FORMATS["qwen2_5"], tokenizer)
    turn = chat.parse(chat.encode("#### 42") + [tokenizer.special_tokens["<|im_end|>"]])
    assert (turn.content, turn.calls, turn.errors) == ("#### 42", [], [])
    assert turn.assistant_message() == {"role": "assistant", "content": "#### 42"}


def test_qwen3_prompt_and_continuations_equal_apply_chat_template():
    """Qwen3 (the bundled tiny Qwen3 folder, thinking off): the prompt and each continuation equal
    transformers' tokens. Qwen3's template writes an earlier assistant turn without its empty think
    block once a turn follows it, so the continuation is compared with the tokens after the
    <|im_end|> that closes the model's turn in transformers' rendering of the whole conversation."""
    from logitless.datasets import asset_path
    from logitless.models import hf_tokenizer

    tokenizer = hf_tokenizer(asset_path("qwen3_tiny"), enable_thinking=False)
    fmt = chat_format_for(tokenizer)
    assert fmt is CHAT_FORMATS["qwen3"]
    hf = transformers.AutoTokenizer.from_pretrained(asset_path("qwen3_tiny"))
    chat = ToolChat(fmt, tokenizer, tools=[tool_schema(add), tool_schema(lookup)])
    messages = [SYSTEM, USER]
    prompt, text = chat.prompt(messages)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt == _hf_ids(hf, messages, add_generation_prompt=True, enable_thinking=False)
    eot = tokenizer.special_tokens["<|im_end|>"]
    for message, sampled_text, answers in TURNS:
        turn = chat.parse(chat.encode(sampled_text) + [eot])
        assert turn.calls == [ToolCall(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"]] and turn.content == message["content"]
        messages = messages + [turn.assistant_message()]
        segment, _ = chat.continuation(messages, answers)
        turns = _hf_ids(hf, messages, enable_thinking=False).count(eot)
        messages = messages + answers
        whole = _hf_ids(hf, messages, add_generation_prompt=True, enable_thinking=False)
        cut = [i for i, t in enumerate(whole) if t == eot][turns - 1] + 1
        assert segment == whole[cut:]
