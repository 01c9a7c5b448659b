"""The bundled byte-level BPE loads in torchtune's own Qwen2.5 tokenizer and round-trips text."""

import json

import pytest
from tokenizers import Tokenizer
from torchtune.data import Message
from torchtune.models.qwen2_5 import qwen2_5_tokenizer
from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS

from logitless.datasets import TINY_TOKENIZER_DIR, tiny_qwen2_5_tokenizer
from logitless.models import TINY_QWEN2_5_CONFIG

TEXTS = [
    "Tom has 12 apples and gets 7 more. How many apples does Tom have now?",
    "12 + 7 = 19\n#### 19",
    "Sort the numbers from smallest to largest.\n\n5, 33, 65, 62",
    "Unseen words: quixotic zephyr, ümlaut, 日本語, emoji 🙂, tabs\tand  spaces.",
    "",
]


@pytest.fixture(scope="module")
def tok():
    d = TINY_TOKENIZER_DIR
    return qwen2_5_tokenizer(path=str(d / "vocab.json"), merges_file=str(d / "merges.txt"),
                             special_tokens_path=str(d / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_matches_hf_tokenizers(tok, text):
    ids = tok.encode(text, add_bos=False, add_eos=False)
    assert tok.decode(ids) == text
    # the same file read by HF `tokenizers` gives the same ids (Qwen2 pre-tokenisation reproduced)
    assert Tokenizer.from_file(str(TINY_TOKENIZER_DIR / "tokenizer.json")).encode(text).ids == ids


def test_special_tokens_sit_right_after_the_bpe_vocab(tok):
    vocab = json.loads((TINY_TOKENIZER_DIR / "vocab.json").read_text())
    n = len(vocab)
    assert sorted(vocab.values()) == list(range(n))
    ordered = sorted(QWEN2_5_SPECIAL_TOKENS, key=QWEN2_5_SPECIAL_TOKENS.get)
    assert tok.special_tokens == {t: n + i for i, t in enumerate(ordered)}
    assert (tok.pad_id, tok.im_start_id, tok.eos_id) == (n, n + 1, n + 2)
    assert n + len(ordered) == TINY_QWEN2_5_CONFIG["vocab_size"] == 2048


def test_digits_are_single_tokens(tok):
    ids = tok.encode("1234567890", add_bos=False, add_eos=False)
    assert len(ids) == 10
    assert [tok.decode([i]) for i in ids] == list("1234567890")


def test_chat_messages_and_builder(tok):
    tt = tiny_qwen2_5_tokenizer(max_seq_len=64)
    msgs = [Message(role="user", content="3 + 4", masked=True), Message(role="assistant", content="3 + 4 = 7")]
    ids, mask = tt.tokenize_messages(msgs)
    assert ids[0] == tt.im_start_id and ids[-1] == tt.eos_id
    text = tt.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\n3 + 4<|im_end|>\n<|im_start|>assistant\n3 + 4 = 7<|im_end|>"
    assert mask[0] is True and mask[-2] is False  # user turn masked, assistant turn trained
    assert ids == tok.tokenize_messages(msgs)[0]
