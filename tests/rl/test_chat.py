"""Conversational prompts: rendered with the tokenizer's chat template, ending with an open assistant
turn; conversational datasets keep every column for the rewards."""

import json

import pytest

from logitless.datasets import tiny_qwen2_5_tokenizer
from logitless.rl.chat import render_chat_prompt
from logitless.rl.prompts import PROMPT_KEYS, TINY_CHAT_FILES, PromptDataset, prompt_dataset
from logitless.rl.rewards import build_reward_specs, compute_rewards


@pytest.fixture(scope="module")
def tok():
    return tiny_qwen2_5_tokenizer()


def _chatml(system, user):
    # Qwen2.5's template with add_generation_prompt=True, written out by hand
    return (f"<|im_start|>system\n{system}<|im_end|>\n" if system else "") + \
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def test_render_matches_chatml_with_generation_prompt(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}]
    tokens, text = render_chat_prompt(tok, msgs)
    assert text == _chatml("Be brief.", "3+4=")
    assert tokens == tok.encode(_chatml("Be brief.", "3+4="), add_bos=False, add_eos=False)
    # a system prompt is put first only when the conversation has none
    assert render_chat_prompt(tok, msgs[1:], system_prompt="Sys.")[1] == _chatml("Sys.", "3+4=")
    assert render_chat_prompt(tok, msgs, system_prompt="Other.")[1] == _chatml("Be brief.", "3+4=")
    assert render_chat_prompt(tok, msgs[1:])[1] == _chatml(None, "3+4=")


@pytest.mark.parametrize("msgs, match", [
    ([], "at least one message"),
    ([{"role": "robot", "content": "hi"}], r"\[0\]\.role: expected one of"),
    ([{"role": "user", "content": 3}], r"\[0\]\.content: expected a string, got int"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "last message must be the user"),
])
def test_bad_conversations_are_named(tok, msgs, match):
    with pytest.raises(ValueError, match=match):
        render_chat_prompt(tok, msgs, where="row 7")


def test_tiny_chat_dataset_keeps_every_column(tok):
    ds = prompt_dataset(tok, data_files=TINY_CHAT_FILES["train"])
    rows = [json.loads(line) for line in open(TINY_CHAT_FILES["train"])]
    assert len(ds) == len(rows) == 44
    for row, raw in zip(ds, rows):
        assert row["prompt"] == _chatml(raw["prompt"][0]["content"], raw["prompt"][1]["content"])
        assert row["prompt_tokens"] == tok.encode(row["prompt"], add_bos=False, add_eos=False)
        assert (row["answer"], row["a"], row["b"]) == (raw["answer"], raw["a"], raw["b"])
        assert int(row["answer"]) == row["a"] + row["b"]
    held_out = {(r["a"], r["b"]) for r in prompt_dataset(tok, data_files=TINY_CHAT_FILES["eval"])}
    assert len(held_out) == 11 and not held_out & {(r["a"], r["b"]) for r in ds}


def test_plain_prompts_and_column_errors(tok, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "solution": "\\boxed{2}", "level": 3}) + "\n")
    ds = prompt_dataset(tok, data_files=str(path), prompt_column="question", answer_column="solution")
    assert ds[0]["prompt"] == "1+1=" and ds[0]["prompt_tokens"] == tok.encode("1+1=", add_bos=False, add_eos=False)
    assert ds[0]["answer"] == ds[0]["solution"] == "\\boxed{2}" and ds[0]["level"] == 3
    chat = prompt_dataset(tok, data_files=str(path), prompt_column="question", system_prompt="Sys.")
    assert chat[0]["prompt"] == _chatml("Sys.", "1+1=")
    with pytest.raises(ValueError, match="prompt_column='prompt': no such column"):
        prompt_dataset(tok, data_files=str(path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "completions": "x"}) + "\n")
    with pytest.raises(ValueError, match="column 'completions' is a reserved name"):
        prompt_dataset(tok, data_files=str(bad))
    with pytest.raises(ValueError, match="field 'prompts' is reserved"):
        PromptDataset(["q"], [[1]], {"prompts": ["x"]})


def _uses_columns(prompts, completions, a, b, **kwargs):
    assert set(kwargs) == {"answer"}
    return [float(c.strip() == str(x + y)) for c, x, y in zip(completions, a, b)]


def test_every_column_reaches_the_rewards(tok):
    ds = prompt_dataset(tok, data_files=TINY_CHAT_FILES["train"])
    rows = [ds[i] for i in range(4)]
    fields = {k: [r[k] for r in rows] for k in rows[0] if k not in PROMPT_KEYS}
    completions = [str(r["a"] + r["b"]) if i % 2 else "0" for i, r in enumerate(rows)]
    specs = build_reward_specs([{"function": _uses_columns, "name": "sum"},
                                {"function": "logitless.rl.rewards.math_correctness"}])
    out = compute_rewards(specs, [r["prompt"] for r in rows], completions, fields)
    want = [float(int(c) == r["a"] + r["b"]) for c, r in zip(completions, rows)]
    assert out["sum"].tolist() == want and out["math_correctness"].tolist() == want
