"""Synthetic token data and a file-free tokenizer, for random-weight runs on machines without downloads."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch.utils.data import Dataset
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX


class SyntheticTokenizer:
    """A stand-in for a model tokenizer when no tokenizer files exist: ids only, no text.

    Enough for the SFT recipes and synthetic datasets (``pad_id``, ``eos_id``, ``max_seq_len``,
    ``vocab_size``, ``encode`` of space-separated integers, ``decode``).

    Args:
        vocab_size (int): number of ids (151936 for Qwen2.5 0.5B-7B); ``eos_id = pad_id = vocab_size - 1``.
        max_seq_len (Optional[int]): truncation / packing length.

    Example:
        >>> SyntheticTokenizer(100).encode("5 6 7")
        [5, 6, 7, 99]
    """

    def __init__(self, vocab_size: int = 151936, max_seq_len: Optional[int] = None):
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"SyntheticTokenizer: vocab_size must be an int >= 2, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.eos_id = self.pad_id = vocab_size - 1
        self.bos_id = None
        self.stop_tokens = [self.eos_id]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> List[int]:
        ids = [int(t) for t in text.split()]
        return ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: List[int], **_: Any) -> str:
        return " ".join(str(int(i)) for i in ids)


def synthetic_tokenizer(vocab_size: int = 151936, max_seq_len: Optional[int] = None,
                        **file_args: Any) -> SyntheticTokenizer:
    """Builds a :class:`SyntheticTokenizer`; swaps in for a real tokenizer with ONE override.

    Args:
        vocab_size (int): number of ids.
        max_seq_len (Optional[int]): truncation / packing length.
        **file_args: the real tokenizer's file arguments (``path``, ``merges_file``,
            ``special_tokens_path``, ``prompt_template``), accepted and unused, so that
            ``tokenizer._component_=logitless.datasets.synthetic_tokenizer`` works on any config.

    Returns:
        SyntheticTokenizer: the tokenizer.

    Example:
        >>> tok = synthetic_tokenizer(vocab_size=151936, path="/not/downloaded/vocab.json")
    """
    return SyntheticTokenizer(vocab_size=vocab_size, max_seq_len=max_seq_len)


class SyntheticDataset(Dataset):
    """Deterministic random token sequences as SFT rows ``{"tokens", "labels"}``.

    Row ``i`` depends only on ``(seed, i)``; lengths are uniform in ``[min_seq_len, seq_len]``;
    the first ``prompt_len`` labels of every row are ignored (a masked prompt).

    Args:
        vocab_size (int): ids are drawn from ``[0, vocab_size - 1)`` (the last id is eos/pad).
        num_samples (int): number of rows.
        seq_len (int): maximum (and default) row length.
        min_seq_len (Optional[int]): minimum row length (default ``seq_len``: fixed length).
        prompt_len (int): leading tokens with ignored labels.
        seed (int): base seed.

    Example:
        >>> ds = SyntheticDataset(vocab_size=100, num_samples=4, seq_len=8)
        >>> len(ds[0]["tokens"])
        8
    """

    def __init__(self, vocab_size: int, num_samples: int = 256, seq_len: int = 512,
                 min_seq_len: Optional[int] = None, prompt_len: int = 0, seed: int = 0):
        for name, v in (("vocab_size", vocab_size), ("num_samples", num_samples), ("seq_len", seq_len)):
            if not isinstance(v, int) or v < 2:
                raise ValueError(f"SyntheticDataset: {name} must be an int >= 2, got {v!r}")
        self.vocab_size, self.num_samples, self.seq_len = vocab_size, num_samples, seq_len
        self.min_seq_len = seq_len if min_seq_len is None else min_seq_len
        if not 1 <= self.min_seq_len <= seq_len:
            raise ValueError(f"SyntheticDataset: min_seq_len must be in [1, {seq_len}], got {min_seq_len!r}")
        if not 0 <= prompt_len < self.min_seq_len:
            raise ValueError(f"SyntheticDataset: prompt_len must be in [0, {self.min_seq_len}), got {prompt_len!r}")
        self.prompt_len, self.seed = prompt_len, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"SyntheticDataset index {i} out of range for {self.num_samples} rows")
        i = i % self.num_samples
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        n = int(torch.randint(self.min_seq_len, self.seq_len + 1, (1,), generator=g))
        tokens = torch.randint(0, self.vocab_size - 1, (n,), generator=g).tolist()
        labels = [CROSS_ENTROPY_IGNORE_IDX] * self.prompt_len + tokens[self.prompt_len:]
        return {"tokens": tokens, "labels": labels}


def synthetic_dataset(
    tokenizer: Any = None,
    *,
    num_samples: int = 256,
    seq_len: int = 512,
    min_seq_len: Optional[int] = None,
    prompt_len: int = 0,
    vocab_size: Optional[int] = None,
    packed: bool = False,
    seed: int = 0,
    **dataset_args: Any,
):
    """Random-token SFT dataset; swaps in for a real dataset with ONE ``_component_`` override.

    Args:
        tokenizer: the recipe's tokenizer; gives ``vocab_size`` (``tokenizer.vocab_size`` or the size of a
            Qwen tokenizer's vocabulary plus its special tokens) and ``max_seq_len`` for packing.
        num_samples (int): rows.
        seq_len (int): row length (maximum, if ``min_seq_len`` is set).
        min_seq_len (Optional[int]): minimum row length.
        prompt_len (int): leading tokens of each row with ignored labels.
        vocab_size (Optional[int]): overrides the tokenizer's vocabulary size.
        packed (bool): pack rows with torchtune's ``PackedDataset`` to ``tokenizer.max_seq_len``.
        seed (int): data seed.
        **dataset_args: the real dataset's arguments (``source``, ``split``, ``column_map``,
            ``train_on_input``, ``data_files``, ...), accepted and unused.

    Returns:
        SyntheticDataset | PackedDataset: the dataset.

    Example:
        >>> ds = synthetic_dataset(synthetic_tokenizer(151936), num_samples=16, seq_len=8192)
    """
    if vocab_size is None:
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if vocab_size is None and hasattr(tokenizer, "encoder"):
            vocab_size = len(tokenizer.encoder) + len(getattr(tokenizer, "special_tokens", {}))
        if vocab_size is None:
            raise ValueError("synthetic_dataset: pass vocab_size (the tokenizer does not tell its size)")
    ds = SyntheticDataset(vocab_size=vocab_size, num_samples=num_samples, seq_len=seq_len,
                          min_seq_len=min_seq_len, prompt_len=prompt_len, seed=seed)
    if packed:
        from torchtune.datasets import PackedDataset

        max_len = getattr(tokenizer, "max_seq_len", None)
        if max_len is None:
            raise ValueError("synthetic_dataset: packed=True needs tokenizer.max_seq_len to be set")
        return PackedDataset(ds, max_seq_len=max_len)
    return ds
