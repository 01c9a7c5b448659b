"""GRPO checks that run before the model is built: the sampling settings of ``generation:`` and
every prompt's length against the model's ``max_seq_len``.

A prompt of P tokens is sampled into a sequence of P + ``max_new_tokens`` tokens; one that does
not fit would fail at the first step that draws it (possibly many steps in). Here every prompt
of the dataset is checked at start, and ``on_too_long`` decides: drop it (counted in the log),
keep its end (``truncate``, as ``PromptDataset``'s ``overflow="truncate"`` does), or stop with an
error naming the row.

Example:
    >>> check_generation(OmegaConf.create({"max_new_tokens": 0}))
    Traceback (most recent call last):
    ConfigError: config key 'generation.max_new_tokens': expected an int >= 1, got 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from logitless.ops._validate import MAX_TEMPERATURE, MIN_TEMPERATURE
from logitless.training.config import ConfigError
from logitless.training.preflight import ON_TOO_LONG, RowSubset


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_generation(gen: Any, key: str = "generation") -> None:
    """Checks the values of a GRPO ``generation:`` mapping (sampling of the training rollouts).

    ``temperature`` must lie in ``[1e-4, 1e4]`` (the log-prob ops' range: the loss uses the same
    temperature). 0, which the sampler reads as greedy, is refused here: every completion of a
    group would be the same, so every advantage would be 0 and nothing would be learnt (the
    recipe's evaluation samples greedily by itself).

    Args:
        gen: the ``generation`` node.
        key (str): its config key.

    Raises:
        ConfigError: naming ``generation.<name>``, the value and what was expected.

    Example:
        >>> check_generation(OmegaConf.create({"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9}))
    """
    values = OmegaConf.to_container(gen, resolve=True) if isinstance(gen, DictConfig) else dict(gen)
    n = values.get("max_new_tokens")
    if not _is_int(n) or n < 1:
        raise ConfigError(f"config key '{key}.max_new_tokens': expected an int >= 1, got {n!r}")
    t = values.get("temperature", 1.0)
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        greedy = (" (0 = greedy sampling gives every completion of a group the same tokens, so every advantage "
                  "is 0: GRPO needs sampled completions)") if t == 0 else ""
        raise ConfigError(f"config key '{key}.temperature': expected a finite number in "
                          f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t!r}{greedy}")
    k = values.get("top_k")
    if k is not None and (not _is_int(k) or k < 1):
        raise ConfigError(f"config key '{key}.top_k': expected null or an int >= 1, got {k!r}")
    p = values.get("top_p")
    if p is not None and not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1):
        raise ConfigError(f"config key '{key}.top_p': expected null or a number in (0, 1], got {p!r}")
    stops = values.get("stop_tokens")
    if stops is not None and (not isinstance(stops, list) or not stops or not all(_is_int(s) and s >= 0
                                                                                    for s in stops)):
        raise ConfigError(f"config key '{key}.stop_tokens': expected a non-empty list of token ids >= 0, "
                          f"got {stops!r}")


def check_stop_tokens(stop_tokens: Sequence[int], vocab_size: Optional[int], key: str) -> None:
    """Raises ConfigError when a stop token is not an id of the model's vocabulary (it could never
    be sampled, so no completion would ever stop).

    Args:
        stop_tokens (Sequence[int]): the ids.
        vocab_size (Optional[int]): the model's vocabulary (None: unknown, nothing checked).
        key (str): where the ids come from (``generation.stop_tokens`` or ``tokenizer``).
    """
    if vocab_size is None:
        return
    bad = [s for s in stop_tokens if not 0 <= int(s) < vocab_size]
    if bad:
        raise ConfigError(f"config key {key!r}: stop token(s) {bad} outside the model's vocabulary; "
                          f"expected ids in [0, {vocab_size})")


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


__all__ = ["PromptReport", "PromptSubset", "check_generation", "check_stop_tokens", "fit_prompt_dataset"]
