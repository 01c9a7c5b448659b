"""GRPO checks that run before the model is built: every prompt's length against the model's
``max_seq_len`` (the ``generation:`` values are checked by
:class:`~logitless.generation.config.SamplerConfig`).

A prompt of P tokens is sampled into a sequence of P + ``max_new_tokens`` tokens; one that does
not fit would fail at the first step that draws it (possibly many steps in). Here every prompt
of the dataset is checked at start, and ``on_too_long`` decides: drop it (counted in the log),
keep its end (``truncate``, as ``PromptDataset``'s ``overflow="truncate"`` does), or stop with an
error naming the row.

Example:
    >>> subset, report = fit_prompt_dataset(dataset, max_seq_len=512, max_new_tokens=64, on_too_long="drop")
    >>> report.message()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from logitless.training.config import ConfigError
from logitless.training.preflight import ON_TOO_LONG, RowSubset


@dataclass
class PromptReport:
    """What the prompt-length check found, for the log at start.

    Attributes:
        rows (int): prompts in the dataset.
        kept (int): prompts sampled from.
        too_long (int): prompts with ``P + max_new_tokens > max_seq_len``.
        truncated (int): too-long prompts kept, cut from the left.
        limit (int): the model's ``max_seq_len`` (or ``generation.max_cache_len`` when smaller).
        max_new_tokens (int): completion length.
        dataset_skipped (int): prompts the dataset itself dropped (``max_prompt_tokens``, ``overflow: skip``).
        dataset_truncated (int): prompts the dataset itself cut (``overflow: truncate``).
        action (str): the ``on_too_long`` setting.
    """

    rows: int
    kept: int
    too_long: int
    truncated: int
    limit: Optional[int]
    max_new_tokens: int
    dataset_skipped: int
    dataset_truncated: int
    action: str

    def message(self, what: str = "dataset") -> str:
        """One line for the log."""
        own = (f"; the dataset itself dropped {self.dataset_skipped} and truncated {self.dataset_truncated} "
               f"prompts over its max_prompt_tokens")
        if self.limit is None:
            return f"{what}: {self.rows} prompts, the model's max_seq_len is unknown{own}"
        return (f"{what}: {self.kept} of {self.rows} prompts kept; {self.too_long} longer than "
                f"{self.limit - self.max_new_tokens} tokens (max_seq_len {self.limit} - max_new_tokens "
                f"{self.max_new_tokens}), {self.truncated} of them truncated, {self.rows - self.kept} dropped; "
                f"on_too_long={self.action!r}{own}")


class PromptSubset(RowSubset):
    """The prompts ``indices`` of a prompt dataset, each cut from the left to ``max_len`` tokens.

    Args:
        dataset (Dataset): rows ``{"prompt_tokens", "prompt", ...}``.
        indices (Sequence[int]): rows kept, in order.
        max_len (Optional[int]): keep the last ``max_len`` prompt tokens (where the question and the
            generation header are).
    """

    def cut(self, row: Dict[str, Any]) -> Dict[str, Any]:
        if len(row["prompt_tokens"]) <= self.max_len:
            return row
        return {**row, "prompt_tokens": list(row["prompt_tokens"])[-self.max_len:]}


def fit_prompt_dataset(dataset: Any, *, max_seq_len: Optional[int], max_new_tokens: int, on_too_long: str,
                       key: str = "dataset") -> Tuple[Any, PromptReport]:
    """Checks every prompt against ``max_seq_len - max_new_tokens`` and applies ``on_too_long``.

    Args:
        dataset: rows with ``prompt_tokens`` (e.g. :class:`logitless.rl.prompts.PromptDataset`).
        max_seq_len (Optional[int]): the longest sequence the sampler can run (None: unknown).
        max_new_tokens (int): completion length.
        on_too_long (str): ``"drop" | "truncate" | "error"``.
        key (str): the dataset's config key, for messages.

    Returns:
        Tuple[Any, PromptReport]: the dataset to sample from (the same object when nothing changes)
        and the report.

    Raises:
        ConfigError: a too-long prompt with ``on_too_long="error"`` (naming the row, its length and
        the limit), ``max_new_tokens`` that leaves no room for a prompt, or no prompt left.

    Example:
        >>> ds, report = fit_prompt_dataset(ds, max_seq_len=1024, max_new_tokens=256, on_too_long="drop")
    """
    if on_too_long not in ON_TOO_LONG:
        raise ConfigError(f"config key 'on_too_long': expected one of {list(ON_TOO_LONG)}, got {on_too_long!r}")
    n = len(dataset)
    own = (int(getattr(dataset, "num_skipped", 0)), int(getattr(dataset, "num_truncated", 0)))
    if max_seq_len is None:
        return dataset, PromptReport(n, n, 0, 0, None, max_new_tokens, *own, on_too_long)
    room = max_seq_len - max_new_tokens
    if room < 1:
        raise ConfigError(f"config key 'generation.max_new_tokens': {max_new_tokens} leaves no room for a prompt "
                          f"within the model's max_seq_len={max_seq_len}; expected at most {max_seq_len - 1}")
    kept: List[int] = []
    too_long = 0
    first: Optional[Tuple[int, int]] = None
    for i in range(n):
        length = len(dataset[i]["prompt_tokens"])
        if length > room:
            too_long += 1
            first = first or (i, length)
            if on_too_long != "truncate":
                continue
        kept.append(i)
    if on_too_long == "error" and first is not None:
        i, length = first
        raise ConfigError(f"config key 'on_too_long': 'error', and {key} prompt {i} has {length} tokens: with "
                          f"generation.max_new_tokens={max_new_tokens} that is {length + max_new_tokens} > the "
                          f"model's max_seq_len={max_seq_len}; {too_long} of {n} prompts are too long. Expected "
                          f"prompts of at most {room} tokens: shorten them (the dataset's max_prompt_tokens), "
                          f"lower max_new_tokens, or set on_too_long to drop or truncate")
    truncated = too_long if on_too_long == "truncate" else 0
    report = PromptReport(n, len(kept), too_long, truncated, max_seq_len, max_new_tokens, *own, on_too_long)
    if not kept:
        raise ConfigError(f"config key {key!r}: no prompt left to sample: {report.message(key)}. Expected at least "
                          f"one prompt of at most {room} tokens")
    if too_long == 0:
        return dataset, report
    return PromptSubset(dataset, kept, room if truncated else None), report


__all__ = ["PromptReport", "PromptSubset", "fit_prompt_dataset"]
