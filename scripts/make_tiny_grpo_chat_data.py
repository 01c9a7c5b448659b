"""Writes the tiny conversational arithmetic task of configs/tiny_grpo_chat.yaml (deterministic).

The pairs and their train / eval split are those of ``logitless.rl.prompts.arithmetic_dataset``; each
row is in TRL's conversational format, a system and a user message, with the reference ``answer``
and the operands as extra columns (handed to the reward functions as keyword arguments)::

    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "3+4="}],
     "answer": "7", "a": 3, "b": 4}

Run from the repository root:  python scripts/make_tiny_grpo_chat_data.py
"""

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "components")]
from logitless.rl.prompts import TINY_CHAT_FILES, arithmetic_pairs  # noqa: E402

SYSTEM_PROMPT = "Reply with the sum only."


def chat_rows(split: str, *, max_sum: int = 9, eval_fraction: float = 0.2, seed: int = 0):
    """Rows of ``split`` ("train" | "eval"), split as ``arithmetic_dataset`` splits its pairs."""
    pairs = arithmetic_pairs(max_sum)
    random.Random(seed).shuffle(pairs)
    n_eval = int(round(len(pairs) * eval_fraction))
    pairs = pairs[len(pairs) - n_eval:] if split == "eval" else pairs[:len(pairs) - n_eval]
    return [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"{a}+{b}="}],
             "answer": str(a + b), "a": a, "b": b} for a, b in pairs]


def main() -> None:
    for split, path in TINY_CHAT_FILES.items():
        with open(path, "w") as f:
            for row in chat_rows(split):
                f.write(json.dumps(row) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
