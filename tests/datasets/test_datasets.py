"""Bundled dataset through torchtune's builders; row checks; synthetic data."""

import json

import pytest
import torch
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX

from logitless.datasets import (
    TINY_ALPACA_FILES,
    SyntheticTokenizer,
    alpaca_dataset,
    synthetic_dataset,
    synthetic_tokenizer,
    tiny_alpaca_dataset,
    tiny_qwen2_5_tokenizer,
)


@pytest.fixture(scope="module")
def tok():
    return tiny_qwen2_5_tokenizer(max_seq_len=256)


def test_tiny_alpaca_rows_and_masks(tok):
    ds = tiny_alpaca_dataset(tok)
    rows = json.loads(TINY_ALPACA_FILES["train"].read_text())
    assert len(ds) == len(rows) == 2000
    item = ds[3]
    tokens, labels = item["tokens"], item["labels"]
    assert len(tokens) == len(labels)
    trained = [t for t, l in zip(tokens, labels) if l != CROSS_ENTROPY_IGNORE_IDX]
    # only the assistant turn is trained on (torchtune's Qwen2.5 tokenizer counts the turn's header as
    # part of it), including the closing eos that torchtune 0.6.1 masks when max_seq_len is set
    assert tok.decode(trained, skip_special_tokens=False) == f"<|im_start|>assistant\n{rows[3]['output']}<|im_end|>"
    assert tokens[-1] == tok.eos_id and labels[-1] == tok.eos_id
    plain = tiny_alpaca_dataset(tok, train_on_eos=False)[3]
    assert plain["tokens"] == tokens and plain["labels"][:-1] == labels[:-1]
    assert plain["labels"][-1] == CROSS_ENTROPY_IGNORE_IDX  # torchtune's own behaviour
    assert rows[3]["instruction"] in tok.decode(tokens)
    evals = json.loads(TINY_ALPACA_FILES["eval"].read_text())
    assert not {(r["instruction"], r["input"]) for r in rows} & {(r["instruction"], r["input"]) for r in evals}


def test_packed_has_positions(tok):
    ds = tiny_alpaca_dataset(tok, packed=True)
    pack = ds[0]
    assert pack["tokens"].shape == (256,) and "input_pos" in pack
    assert (pack["input_pos"] == 0).sum() >= 2  # several documents in one pack


def test_row_without_output_is_named(tmp_path, tok):
    rows = [{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c", "input": "", "output": None}]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"row 1 has field 'output'"):
        alpaca_dataset(tok, source="json", data_files=str(f))


def test_missing_column_is_named(tmp_path, tok):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps([{"prompt": "a", "output": "b"}]))
    with pytest.raises(ValueError, match=r"column\(s\) \['instruction'\] missing"):
        alpaca_dataset(tok, source="json", data_files=str(f))


def test_synthetic_dataset_is_deterministic_and_in_range():
    tok = synthetic_tokenizer(vocab_size=100, path="/does/not/exist/vocab.json")
    ds = synthetic_dataset(tok, num_samples=5, seq_len=16, min_seq_len=8, prompt_len=3, seed=1,
                           source="tatsu-lab/alpaca", split="train")
    again = synthetic_dataset(tok, num_samples=5, seq_len=16, min_seq_len=8, prompt_len=3, seed=1)
    for i in range(5):
        assert ds[i] == again[i]
        t = torch.tensor(ds[i]["tokens"])
        assert 8 <= len(t) <= 16 and int(t.max()) < 99
        assert ds[i]["labels"][:3] == [CROSS_ENTROPY_IGNORE_IDX] * 3 and ds[i]["labels"][3:] == ds[i]["tokens"][3:]
    assert ds[0] != synthetic_dataset(tok, num_samples=5, seq_len=16, min_seq_len=8, seed=2)[0]


def test_synthetic_packed_and_errors():
    ds = synthetic_dataset(SyntheticTokenizer(50, max_seq_len=32), num_samples=8, seq_len=10, packed=True)
    assert ds[0]["tokens"].shape == (32,)
    with pytest.raises(ValueError, match="min_seq_len"):
        synthetic_dataset(SyntheticTokenizer(50), seq_len=8, min_seq_len=9)
    with pytest.raises(ValueError, match="vocab_size"):
        synthetic_dataset(object(), seq_len=8)


def test_truncated_rows_keep_torchtune_masking():
    short = tiny_qwen2_5_tokenizer(max_seq_len=20)
    item = tiny_alpaca_dataset(short)[3]
    assert len(item["tokens"]) == 20 and item["tokens"][-1] == short.eos_id
    assert item["labels"][-1] == CROSS_ENTROPY_IGNORE_IDX


@pytest.mark.parametrize("old", ["logitless.data", "logitless.rl.data", "logitless.rl.generation",
                                 "logitless.rl.fast_generation", "logitless.rl.samplers", "logitless.rl.sampling"])
def test_the_module_names_removed_in_0_2_0_are_gone(old):
    # deprecated in 0.1.0, removed in 0.2.0 (CHANGELOG.md names what to use instead); checked on the
    # package's files, since an editable install elsewhere may still answer the import
    import pathlib

    import logitless

    where = pathlib.Path(logitless.__file__).parent.joinpath(*old.split(".")[1:])
    assert not where.with_suffix(".py").exists() and not (where / "__init__.py").exists()
