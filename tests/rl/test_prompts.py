import json

import pytest

from logitless.datasets import tiny_qwen2_5_tokenizer
from logitless.rl.prompts import (
    PromptDataset, arithmetic_dataset, arithmetic_pairs, arithmetic_warmstart_dataset, gsm8k_dataset,
    synthetic_prompt_dataset,
)


@pytest.fixture(scope="module")
def tok():
    return tiny_qwen2_5_tokenizer()


def test_arithmetic_split_is_disjoint_and_complete(tok):
    train, ev = arithmetic_dataset(tok, split="train"), arithmetic_dataset(tok, split="eval")
    prompts = {r["prompt"] for r in train} | {r["prompt"] for r in ev}
    assert len(train) == 44 and len(ev) == 11 and len(prompts) == 55
    for r in list(train) + list(ev):
        a, b = map(int, r["prompt"].rstrip("=").split("+"))
        assert r["answer"] == f"#### {a + b}" and a + b <= 9
        assert tok.decode(r["prompt_tokens"]) == r["prompt"]
    assert arithmetic_pairs(3, b_values=[1]) == [(0, 1), (1, 1), (2, 1)]


def test_warmstart_rows(tok):
    rows = arithmetic_warmstart_dataset(tok, num_samples=55, answers="correct")
    for (a, b), row in zip(arithmetic_pairs(9), rows):
        n = len(row["tokens"]) - 2
        assert row["labels"][:n] == [-100] * n
        assert tok.decode(row["tokens"][n:n + 1]) == str(a + b) and row["tokens"][-1] == tok.eos_id


def test_overflow_policies():
    texts, toks = ["a", "b"], [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert len(PromptDataset(texts, toks, max_prompt_tokens=4, overflow="skip")) == 1
    ds = PromptDataset(texts, toks, max_prompt_tokens=4, overflow="truncate")
    assert ds[1]["prompt_tokens"] == [5, 6, 7, 8] and ds.num_truncated == 1
    with pytest.raises(ValueError, match="prompt 1 has 5 tokens"):
        PromptDataset(texts, toks, max_prompt_tokens=4, overflow="error")
    with pytest.raises(ValueError, match="no prompt is left"):
        PromptDataset(texts, toks, max_prompt_tokens=2, overflow="skip")


def test_gsm8k_from_local_json_with_chat_template(tok, tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "x" * 2000, "answer": "#### 1"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    ds = gsm8k_dataset(tok, source="json", data_files=str(path), max_prompt_tokens=200, overflow="skip")
    assert len(ds) == 1 and ds[0]["answer"].endswith("#### 7") and ds[0]["question"] == rows[0]["question"]
    text = tok.decode(ds[0]["prompt_tokens"], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ds[0]["prompt"] == text  # what the policy is given, as logs and rewards see it
    with pytest.raises(ValueError, match="no column 'problem'"):
        gsm8k_dataset(tok, source="json", data_files=str(path), question_column="problem")


def test_synthetic_prompts():
    ds = synthetic_prompt_dataset(vocab_size=100, num_samples=3, prompt_len=7, seed=1)
    assert len(ds) == 3 and all(len(r["prompt_tokens"]) == 7 and max(r["prompt_tokens"]) < 99 for r in ds)
    assert synthetic_prompt_dataset(vocab_size=100, num_samples=3, prompt_len=7, seed=1)[2] == ds[2]
    with pytest.raises(ValueError, match="vocab_size"):
        synthetic_prompt_dataset(num_samples=1)


def test_gsm8k_keeps_every_column_for_the_rewards(tok, tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2", "id": "q-17", "difficulty": 0.5}) + "\n")
    row = gsm8k_dataset(tok, source="json", data_files=str(path))[0]
    assert {k: row[k] for k in ("question", "answer", "id", "difficulty")} == \
        {"question": "1+1?", "answer": "#### 2", "id": "q-17", "difficulty": 0.5}
