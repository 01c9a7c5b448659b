"""Alpaca-style instruction datasets through torchtune's builders, with rows checked up front."""

from __future__ import annotations

from typing import Any, Dict, Optional

from torchtune.datasets import alpaca_dataset as _tt_alpaca_dataset
from torchtune.modules.transforms.tokenizers import ModelTokenizer

from logitless.datasets._assets import TINY_ALPACA_FILES
from logitless.datasets._files import check_encoding, data_files_problem

_ALPACA_FIELDS = ("instruction", "input", "output")
_REQUIRED = ("instruction", "output")  # "input" may be empty or absent (torchtune treats it as optional)


def _check_rows(ds, column_map: Optional[Dict[str, str]], source: str) -> None:
    """Raises ValueError naming the first row that lacks a required field or has a non-string one."""
    hf = getattr(ds, "_data", None)
    if hf is None:  # a PackedDataset: look at the dataset it packed
        hf = getattr(getattr(ds, "ds", None), "_data", None)
    if hf is None:
        return
    cmap = {k: (column_map or {}).get(k, k) for k in _ALPACA_FIELDS}
    cols = set(hf.column_names)
    missing = [cmap[k] for k in _REQUIRED if cmap[k] not in cols]
    if missing:
        raise ValueError(
            f"alpaca dataset {source!r}: column(s) {missing} missing; found columns {sorted(cols)}. "
            f"Expected alpaca fields {list(_ALPACA_FIELDS)} (rename with dataset.column_map)"
        )
    for key in _ALPACA_FIELDS:
        col = cmap[key]
        if col not in cols:
            continue
        for i, v in enumerate(hf[col]):
            if v is None and key == "input":
                continue
            # a whitespace-only output would train the model to answer with blanks
            if not isinstance(v, str) or (key in _REQUIRED and not v.strip()):
                raise ValueError(
                    f"alpaca dataset {source!r}: row {i} has field {col!r} = {v!r}; "
                    f"expected a non-empty string" + (" (not whitespace only)" if key in _REQUIRED else " or null")
                )


class _TrainOnEos:
    """Model transform that un-masks the closing eos torchtune 0.6.1 masks whenever max_seq_len is set.

    torchtune's Qwen/Llama tokenizers end ``tokenize_messages`` with
    ``truncate(mask, max_seq_len, True)``, which sets the LAST mask entry to True (ignored) even when
    nothing was truncated, so the model never learns to emit eos. For an untruncated sample whose last
    token is eos, this gives that eos the mask of the token before it (trained when the assistant
    turn is). Truncated samples (length == max_seq_len) are left as torchtune made them.
    """

    def __init__(self, tokenizer: ModelTokenizer):
        self._tok = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __call__(self, sample: Dict[str, Any], inference: bool = False) -> Dict[str, Any]:
        out = self._tok(sample, inference=inference)
        tokens, mask = out["tokens"], out["mask"]
        max_len = getattr(self._tok, "max_seq_len", None)
        eos = getattr(self._tok, "eos_id", None)
        if (len(tokens) >= 2 and tokens[-1] == eos and (max_len is None or len(tokens) < max_len)):
            out["mask"] = list(mask[:-1]) + [mask[-2]]
        return out


def alpaca_dataset(
    tokenizer: ModelTokenizer,
    *,
    source: str = "tatsu-lab/alpaca",
    column_map: Optional[Dict[str, str]] = None,
    train_on_input: bool = False,
    packed: bool = False,
    split: str = "train",
    check_rows: bool = True,
    train_on_eos: bool = True,
    **load_dataset_kwargs: Any,
):
    """torchtune's ``alpaca_dataset`` that first checks every row has the alpaca fields.

    Args:
        tokenizer (ModelTokenizer): the model tokenizer (``max_seq_len`` set when ``packed``).
        source (str): HF hub id, or a loader name (``"json"``, ``"parquet"``) with ``data_files``.
        column_map (Optional[Dict[str, str]]): maps ``instruction``/``input``/``output`` to columns.
        train_on_input (bool): also train on the prompt tokens.
        packed (bool): greedy sample packing to ``tokenizer.max_seq_len``.
        split (str): dataset split.
        check_rows (bool): scan the rows for missing or non-string fields before training.
        train_on_eos (bool): train on the closing eos of each sample, which torchtune 0.6.1's
            tokenizers mask whenever ``max_seq_len`` is set (so the model would never learn to stop).
        **load_dataset_kwargs: passed to ``datasets.load_dataset`` (e.g. ``data_files``).

    Returns:
        SFTDataset | PackedDataset: items ``{"tokens", "labels"}`` (+ ``input_pos``/``seq_lens`` if packed).

    Raises:
        ValueError: naming the column or the row index that does not fit.

    Example:
        >>> ds = alpaca_dataset(tok, source="json", data_files="my_rows.json")
    """
    where = str(load_dataset_kwargs.get("data_files", source))
    check_encoding(source, load_dataset_kwargs.get("data_files"))  # bad bytes would load, and fail at a later read
    try:
        ds = _tt_alpaca_dataset(
            _TrainOnEos(tokenizer) if train_on_eos else tokenizer, source=source, column_map=column_map,
            train_on_input=train_on_input, packed=False, split=split, **load_dataset_kwargs,
        )
    except Exception as e:  # the loader's message names neither the file nor the row: find them
        problem = data_files_problem(source, load_dataset_kwargs.get("data_files"))
        if problem is None:
            raise
        raise ValueError(f"alpaca dataset: {problem}") from e
    if len(ds) == 0:
        raise ValueError(f"alpaca dataset {where!r} holds no rows; expected at least one")
    if check_rows:
        _check_rows(ds, column_map, where)
    if packed:
        from torchtune.datasets import PackedDataset

        if tokenizer.max_seq_len is None:
            raise ValueError("alpaca_dataset: packed=True needs tokenizer.max_seq_len to be set")
        return PackedDataset(ds, max_seq_len=tokenizer.max_seq_len)
    return ds


def tiny_alpaca_dataset(
    tokenizer: ModelTokenizer,
    *,
    split: str = "train",
    packed: bool = False,
    train_on_input: bool = False,
    **kwargs: Any,
):
    """The bundled 2000-row (train) / 200-row (eval) arithmetic and word-task dataset.

    Loaded with torchtune's ``alpaca_dataset(source="json", data_files=...)``. Word problems end in
    ``#### <answer>`` (GSM8K style).

    Args:
        tokenizer (ModelTokenizer): e.g. :func:`tiny_qwen2_5_tokenizer`.
        split (str): ``"train"`` or ``"eval"`` (a held-out file, disjoint prompts).
        packed (bool): sample packing (needs ``tokenizer.max_seq_len``).
        train_on_input (bool): also train on the prompt tokens.
        **kwargs: passed to :func:`alpaca_dataset`.

    Returns:
        SFTDataset | PackedDataset: the dataset.

    Example:
        >>> ds = tiny_alpaca_dataset(tiny_qwen2_5_tokenizer(max_seq_len=256))
        >>> len(ds)
        2000
    """
    if split not in TINY_ALPACA_FILES:
        raise ValueError(f"tiny_alpaca_dataset: split={split!r}; expected one of {sorted(TINY_ALPACA_FILES)}")
    return alpaca_dataset(
        tokenizer, source="json", data_files=str(TINY_ALPACA_FILES[split]), split="train",
        packed=packed, train_on_input=train_on_input, **kwargs,
    )
