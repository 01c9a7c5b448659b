"""The Qwen3 tokenizer renders conversations exactly as transformers' ``apply_chat_template`` does with
Qwen3's chat template, thinking on and off, on tokenizer files written by transformers itself.

No Qwen3 tokenizer can be downloaded here: the HF tokenizer is built from the bundled tiny byte-level
BPE with Qwen3's 26 added tokens and ``QWEN3_CHAT_TEMPLATE``, saved by ``save_pretrained`` and loaded
back. That template text was written from our knowledge of the ``Qwen/Qwen3-*`` tokenizer_config.json
(it is not copied from a downloaded file), so these tests show that our renderer and the Jinja
template agree, and the template is the one shipped with our exported Qwen3 folders."""

import json
import shutil

import pytest
from torchtune.data import Message

from logitless.datasets import TINY_TOKENIZER_DIR, asset_path, tiny_qwen2_5_tokenizer
from logitless.models import QWEN3_CHAT_TEMPLATE, Qwen3Tokenizer, hf_tokenizer, tiny_hf_config
from logitless.models.qwen3_tokenizer import split_think

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

NOT_SPECIAL = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")

SYSTEM_USER = [{"role": "system", "content": "You are a careful assistant."},
               {"role": "user", "content": "What is 12 + 7?"}]
MULTI_TURN = [{"role": "user", "content": "Hi there"},
              {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
              {"role": "user", "content": "Now add 3 and 4, then\ndouble it."}]
WITH_TOOL = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": "<think>\nI should call it.\n</think>\n\nLet me check."},
             {"role": "tool", "content": "{\"temp\": 3}"}]
CONVERSATIONS = {"system_user": SYSTEM_USER, "multi_turn": MULTI_TURN, "with_tool": WITH_TOOL}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A Qwen3-style tokenizer folder written by transformers (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) plus the config.json that names the family, without vocab.json / merges.txt."""
    spec = json.loads((TINY_TOKENIZER_DIR / "tokenizer.json").read_text())
    template = dict(spec["added_tokens"][0])
    for content in ("<tool_response>", "</tool_response>", "<think>", "</think>"):
        spec["added_tokens"].append(dict(template, id=spec["added_tokens"][-1]["id"] + 1, content=content))
    for token in spec["added_tokens"]:
        token["special"] = token["content"] not in NOT_SPECIAL
    tok = transformers.Qwen2Tokenizer(tokenizer_object=tokenizers.Tokenizer.from_str(json.dumps(spec)),
                                      eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("qwen3_tokenizer")
    tok.save_pretrained(str(folder))
    shutil.copyfile(asset_path("qwen3_tiny/config.json"), folder / "config.json")
    assert not (folder / "vocab.json").exists()
    return folder


def _messages(conversation, open_turn=True):
    role = {"tool": "ipython"}  # torchtune's name of a tool's response
    out = [Message(role.get(m["role"], m["role"]), m["content"], masked=m["role"] != "assistant")
           for m in conversation]
    return out + [Message("assistant", "")] if open_turn else out


def _ids(encoding):
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


@pytest.mark.parametrize("source", ["bundled", "saved_by_transformers"])
@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_generation_prompt_renders_as_apply_chat_template(hf_folder, source, enable_thinking, name):
    folder = asset_path("qwen3_tiny") if source == "bundled" else hf_folder
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = hf_tokenizer(folder, enable_thinking=enable_thinking)
    assert isinstance(ours, Qwen3Tokenizer)
    conversation = CONVERSATIONS[name]
    kw = dict(add_generation_prompt=True, enable_thinking=enable_thinking)
    text = hf.apply_chat_template(conversation, tokenize=False, **kw)
    ids, mask = ours.tokenize_messages(_messages(conversation), add_eos=False)
    assert ours.decode(ids) == text
    assert ids == _ids(hf.apply_chat_template(conversation, tokenize=True, **kw))
    assert text.endswith("<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n"))
    assert "Greet back." not in text  # an answered turn's reasoning is dropped
    assert len(mask) == len(ids)


@pytest.mark.parametrize("final", ["<think>\n3 + 4 = 7, doubled 14\n</think>\n\n#### 14", "#### 14"])
def test_training_conversation_renders_as_apply_chat_template(final):
    """A conversation ending in the assistant's answer (SFT): Qwen3's template writes a think block
    around the last answer, empty when it has no reasoning; torchtune's layout ends with the eos that
    add_eos appends, without the template's trailing newline."""
    folder = asset_path("qwen3_tiny")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = hf_tokenizer(folder)
    conversation = MULTI_TURN + [{"role": "assistant", "content": final}]
    ids, mask = ours.tokenize_messages(_messages(conversation, open_turn=False), add_eos=True)
    want = _ids(hf.apply_chat_template(conversation, tokenize=True))
    assert ids == want[:-1] and hf.decode(want[-1:]) == "\n"
    text = ours.decode(ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n" + ("3 + 4 = 7, doubled 14" if "<think>" in final else "")
                         + "\n</think>\n\n#### 14<|im_end|>")
    answer = ours.encode(text[text.rindex("<|im_start|>assistant"):], add_eos=False)
    assert mask[-len(answer):] == [False] * len(answer) and mask[0] is True  # trained on the last turn


def test_decode_keeps_the_tokens_transformers_keeps(hf_folder):
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    ours = hf_tokenizer(hf_folder)
    ids = _ids(hf("<think>\nhmm\n</think>\n\n<tool_call>x</tool_call> 7<|im_end|><|endoftext|>"))
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=True).startswith("<think>\nhmm\n</think>")
    assert ours.decode(ids) == hf.decode(ids)


def test_default_is_thinking_on_and_other_families_keep_their_tokenizer(tmp_path):
    assert hf_tokenizer(asset_path("qwen3_tiny")).enable_thinking is True
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        shutil.copyfile(TINY_TOKENIZER_DIR / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    qwen2_5 = hf_tokenizer(tmp_path, max_seq_len=64)
    reference = tiny_qwen2_5_tokenizer(max_seq_len=64)
    assert type(qwen2_5) is type(reference)
    messages = _messages(SYSTEM_USER)
    assert qwen2_5.tokenize_messages(messages) == reference.tokenize_messages(messages)


def test_split_think_follows_the_template():
    assert split_think("<think>\n\na\n\n</think>\n\nb") == ("a", "b")
    assert split_think("no tags") == ("", "no tags")
    assert split_think("x</think>y</think>\nz") == ("x", "z")
