#!/usr/bin/env python
"""Build the small assets bundled in ``components/logitless/datasets/assets/``.

Deterministic (fixed seeds); rerun it to regenerate every file:

    python scripts/make_tiny_assets.py            # dataset + tokenizer + random-init checkpoint

Outputs (relative to the assets folder):

- ``tiny_alpaca.json`` / ``tiny_alpaca_eval.json``: alpaca-style rows (instruction / input / output)
  of small arithmetic, word-problem and word-manipulation tasks.
- ``tokenizer/vocab.json``, ``tokenizer/merges.txt``: a byte-level BPE in Qwen2's format, trained here
  with the Hugging Face ``tokenizers`` library using Qwen2's pre-tokenisation regex (digits split one
  by one), so torchtune's ``Qwen2Tokenizer`` reproduces it exactly.
- ``tokenizer/tokenizer.json``: the full HF tokenizer, whose ``added_tokens`` give the Qwen2.5 special
  tokens SMALL ids placed right after the BPE vocabulary (torchtune reads them through
  ``special_tokens_path``).
- ``tokenizer/tokenizer_config.json``: what transformers' ``AutoTokenizer`` needs besides
  ``tokenizer.json`` (class, special tokens, eos ``<|im_end|>`` / pad ``<|endoftext|>``, a ChatML
  template laid out as torchtune's ``Qwen2_5Tokenizer``), derived from torchtune's tokenizer on the
  files above (``logitless.datasets.hf_tokenizer_config``). Checkpoint folders copy these files.
- ``qwen2_5_tiny/``: ``config.json`` + ``model.safetensors`` (bf16) of ``logitless.models.qwen2_5_tiny``
  in Hugging Face Qwen2 format, readable by ``torchtune.training.FullModelHFCheckpointer``
  (``model_type: QWEN2``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "components" / "logitless" / "data" / "assets"

# Qwen2's pre-tokenisation regex, identical to torchtune.models.qwen2._tokenizer.PRETOKENIZE_REGEX.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOTAL_VOCAB = 2048  # BPE tokens + special tokens; the tiny model's vocab_size
TINY_MAX_SEQ_LEN = 1024  # the tiny model's max_seq_len (its RoPE cache)

NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Zoe", "Leo", "Ella", "Jack", "Nora",
         "Omar", "Ivy", "Ravi", "Lucy", "Hugo", "Sara", "Noah", "Emma"]
ITEMS = ["apples", "pears", "books", "coins", "cards", "stamps", "shells", "pencils", "cookies",
         "marbles", "stickers", "oranges", "flowers", "candles", "buttons", "balloons", "eggs",
         "cupcakes", "toys", "rocks"]
WORDS = """
apple river stone cloud green yellow purple orange silver golden garden window table chair
summer winter spring autumn morning evening night bright quiet happy little gentle strong
mountain valley forest ocean island desert meadow village castle bridge tower market school
teacher student doctor farmer painter singer dancer writer reader baker sailor pilot driver
horse rabbit tiger eagle turtle dolphin monkey spider camel zebra lion wolf bear mouse snake
bread butter cheese honey sugar salt pepper rice pasta soup salad juice water coffee tea milk
run walk jump swim climb read write sing dance paint build cook clean open close carry bring
red blue white black brown pink gray warm cold soft hard fast slow tall short young old new
light dark early late near far high low rich poor busy empty full heavy simple clever
music story letter number picture question answer reason moment family friend neighbor
kitchen library station airport hospital museum theater office street corner road path
planet rocket engine machine computer keyboard screen camera pocket basket bucket blanket
thunder lightning rainbow shadow sunrise sunset harvest journey holiday birthday festival
whisper laugh breathe listen remember forget believe imagine promise explain discover
""".split()
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "brown", "pink"]


def _problem(rng: random.Random) -> dict:
    """One alpaca-style row from a random task family."""
    kind = rng.choice(["add", "sub", "mul", "word_add", "word_sub", "reverse", "sort", "count",
                       "upper", "first_letters", "compare", "double"])
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"instruction": "Add the two numbers.", "input": f"{a} + {b}",
                "output": f"{a} + {b} = {a + b}"}
    if kind == "sub":
        a = rng.randint(0, 99)
        b = rng.randint(0, a)
        return {"instruction": "Subtract the second number from the first.", "input": f"{a} - {b}",
                "output": f"{a} - {b} = {a - b}"}
    if kind == "mul":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        return {"instruction": "Multiply the two numbers.", "input": f"{a} * {b}",
                "output": f"{a} * {b} = {a * b}"}
    if kind in ("word_add", "word_sub"):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        if kind == "word_add":
            q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
            return {"instruction": q, "input": "", "output": f"{a} + {b} = {a + b}\n#### {a + b}"}
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        return {"instruction": q, "input": "", "output": f"{a} - {b} = {a - b}\n#### {a - b}"}
    if kind == "reverse":
        ws = rng.sample(WORDS, rng.randint(2, 5))
        return {"instruction": "Reverse the order of the words.", "input": " ".join(ws),
                "output": " ".join(reversed(ws))}
    if kind == "sort":
        xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
        return {"instruction": "Sort the numbers from smallest to largest.",
                "input": ", ".join(map(str, xs)), "output": ", ".join(map(str, sorted(xs)))}
    if kind == "count":
        ws = rng.sample(WORDS, rng.randint(1, 7))
        n = len(ws)
        return {"instruction": "How many words are in the text?", "input": " ".join(ws),
                "output": f"There {'is' if n == 1 else 'are'} {n} word{'' if n == 1 else 's'}."}
    if kind == "upper":
        ws = rng.sample(WORDS, rng.randint(1, 4))
        return {"instruction": "Write the text in capital letters.", "input": " ".join(ws),
                "output": " ".join(ws).upper()}
    if kind == "first_letters":
        ws = rng.sample(WORDS, rng.randint(2, 5))
        return {"instruction": "Give the first letter of each word.", "input": " ".join(ws),
                "output": ", ".join(w[0] for w in ws)}
    if kind == "compare":
        a, b = rng.sample(range(100), 2)
        return {"instruction": "Which number is larger?", "input": f"{a} or {b}",
                "output": f"{max(a, b)} is larger than {min(a, b)}."}
    # double
    color, item = rng.choice(COLORS), rng.choice(ITEMS)
    a = rng.randint(1, 25)
    q = f"A box holds {a} {color} {item}. How many {item} are in two such boxes?"
    return {"instruction": q, "input": "", "output": f"2 * {a} = {2 * a}\n#### {2 * a}"}


def make_dataset(n_train: int = 2000, n_eval: int = 200, seed: int = 0) -> tuple[list, list]:
    """Returns (train_rows, eval_rows), disjoint by (instruction, input)."""
    rng = random.Random(seed)
    seen, train, evals = set(), [], []
    while len(train) < n_train or len(evals) < n_eval:
        row = _problem(rng)
        key = (row["instruction"], row["input"])
        if key in seen:
            continue
        seen.add(key)
        (train if len(train) < n_train else evals).append(row)
    return train, evals


def tokenizer_corpus(rows: list) -> list[str]:
    """Training text: the rows as the Qwen chat template lays them out, plus the word lists."""
    texts = []
    for r in rows:
        user = r["instruction"] + ("\n\n" + r["input"] if r["input"] else "")
        texts.append(f"system\nYou are a helpful assistant.\nuser\n{user}\nassistant\n{r['output']}\n")
    texts.append(" ".join(WORDS + NAMES + ITEMS + COLORS))
    texts.append(" ".join(w.capitalize() for w in WORDS + ITEMS))
    texts.append(" ".join(w.upper() for w in WORDS))
    texts.append("Below is an instruction that describes a task. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n\n### Input:\n\n### Response:\n")
    return texts


def train_tokenizer(texts: list[str], out_dir: Path, total_vocab: int = TOTAL_VOCAB) -> int:
    """Trains the byte-level BPE and writes vocab.json, merges.txt, tokenizer.json; returns its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS

    specials = sorted(QWEN2_5_SPECIAL_TOKENS, key=QWEN2_5_SPECIAL_TOKENS.get)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=total_vocab - len(specials), min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(specials)  # ids n_bpe, n_bpe + 1, ... in Qwen's order
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(out_dir))  # vocab.json, merges.txt
    tok.save(str(out_dir / "tokenizer.json"))
    return tok.get_vocab_size()


def write_tokenizer_config(out_dir: Path) -> None:
    """tokenizer_config.json of the bundled tokenizer, from torchtune's view of it (same ids, eos, pad)."""
    from logitless.datasets import hf_tokenizer_config, tiny_qwen2_5_tokenizer

    config = hf_tokenizer_config(tiny_qwen2_5_tokenizer(), model_max_length=TINY_MAX_SEQ_LEN)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_checkpoint(out_dir: Path, vocab_size: int, seed: int = 0) -> None:
    """Random-init tiny Qwen2.5 in HF format (bf16 safetensors + config.json)."""
    import torch
    from safetensors.torch import save_file
    from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

    from logitless.models import TINY_QWEN2_5_CONFIG, qwen2_5_tiny, tiny_hf_config

    torch.manual_seed(seed)
    model = qwen2_5_tiny(vocab_size=vocab_size)
    # torchtune's builders leave the (tied) embedding at N(0, 1): logits of std ~sqrt(dim) and an
    # initial loss near 100. Linear layers get N(0, 0.02) (HF's initializer_range) and the embedding
    # N(0, 1/dim), so initial logits have std ~1 (loss ~ ln(V) + 0.5) and a frozen head (LoRA) can
    # still express confident predictions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale"):  # RMSNorm
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif "tok_embeddings" in name:
                p.normal_(0.0, model.tok_embeddings.embedding_dim ** -0.5)
            else:
                p.normal_(0.0, 0.02)
    cfg = dict(TINY_QWEN2_5_CONFIG, vocab_size=vocab_size)
    sd = qwen2_tune_to_hf(model.state_dict(), num_heads=cfg["num_heads"],
                          num_kv_heads=cfg["num_kv_heads"], dim=cfg["embed_dim"],
                          tie_word_embeddings=True)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(tiny_hf_config(vocab_size=vocab_size), indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-checkpoint", action="store_true", help="only dataset and tokenizer")
    p.add_argument("--tokenizer-config-only", action="store_true",
                   help="only rewrite tokenizer/tokenizer_config.json from the existing tokenizer files")
    args = p.parse_args()
    if args.tokenizer_config_only:
        write_tokenizer_config(ASSETS / "tokenizer")
        return
    train, evals = make_dataset()
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / "tiny_alpaca.json").write_text(json.dumps(train, indent=1) + "\n")
    (ASSETS / "tiny_alpaca_eval.json").write_text(json.dumps(evals, indent=1) + "\n")
    size = train_tokenizer(tokenizer_corpus(train), ASSETS / "tokenizer")
    write_tokenizer_config(ASSETS / "tokenizer")
    print(f"dataset: {len(train)} train / {len(evals)} eval rows; tokenizer: {size} tokens")
    if not args.skip_checkpoint:
        write_checkpoint(ASSETS / "qwen2_5_tiny", vocab_size=TOTAL_VOCAB)
        print("checkpoint:", ASSETS / "qwen2_5_tiny")


if __name__ == "__main__":
    main()
