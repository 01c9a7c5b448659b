"""Reward functions and the code that calls them.

A reward function is any callable ``f(prompts, completions, **row_fields) -> list[float]``:
``prompts`` and ``completions`` are lists of strings of equal length N (one entry per completion,
a prompt repeated for each of its generations) and ``row_fields`` holds every other column of the
dataset (``answer`` and any other: TRL's convention), each a list of length N, passed as keyword
arguments. A function names the columns it reads and absorbs the rest with ``**kwargs``::

    def sum_correct(prompts, completions, a, b, **kwargs):   # columns "a" and "b"
        return [float(c.strip() == str(x + y)) for c, x, y in zip(completions, a, b)]

Every function also receives ``completion_ids``: each completion's sampled token ids (its stop
token included), a list of N lists of ints, for rewards that count tokens
(:mod:`logitless.rl.length_rewards`); no dataset column may take that name.

A reward with set-up (a model) is a callable object built from a component mapping
(:mod:`logitless.rl.reward_models`).

Recipes name them in YAML with weights::

    rewards:
      - function: logitless.rl.rewards.gsm8k_correctness
        weight: 1.0
      - function: logitless.rl.rewards.gsm8k_format
        weight: 0.2

The total reward of a completion is the weighted sum; every function's own mean and std are logged.
"""

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from logitless.rl.math_answers import answers_match, extract_answer, reference_answer

__all__ = [
    "COMPLETION_IDS",
    "RewardError",
    "RewardSpec",
    "build_reward_specs",
    "compute_rewards",
    "extract_final_number",
    "gsm8k_correctness",
    "gsm8k_format",
    "math_correctness",
    "parse_gsm8k_answer",
]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_BOXED_RE = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*\$?\s*(" + _NUMBER + r")", re.IGNORECASE)
_FORMAT_RE = re.compile(r"####\s*\$?\s*(?:" + _NUMBER + r")\s*\.?\s*$")


#: The keyword under which every reward function receives the completions' token ids.
COMPLETION_IDS = "completion_ids"


class RewardError(RuntimeError):
    """A reward function failed, returned the wrong number of values, or returned NaN."""


def _to_float(text: str) -> Optional[float]:
    text = text.replace(",", "").rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def parse_gsm8k_answer(answer: str) -> Optional[float]:
    """The reference number of a GSM8K ``answer`` field (the text after ``####``).

    Args:
        answer (str): e.g. ``"Natalia sold 48/2 = 24 clips ... #### 72"``; a bare number is accepted.

    Returns:
        Optional[float]: the number, or None if there is none.

    Example:
        >>> parse_gsm8k_answer("3 + 4 = 7\\n#### 1,007")
        1007.0
    """
    m = _HASH_RE.search(answer)
    if m:
        return _to_float(m.group(1))
    nums = _NUMBER_RE.findall(answer)
    return _to_float(nums[-1]) if nums else None


def extract_final_number(completion: str) -> Optional[float]:
    """The model's final answer: the number after the last ``####``, else in ``\\boxed{}``,
    else after "answer is", else the last number in the text.

    Args:
        completion (str): generated text.

    Returns:
        Optional[float]: the number, or None when the text has no number.

    Example:
        >>> extract_final_number("She has 3 + 4 = 7 apples.\\n#### 7")
        7.0
    """
    for pattern in (_HASH_RE, _BOXED_RE, _ANSWER_IS_RE):
        found = pattern.findall(completion)
        if found:
            return _to_float(found[-1])
    nums = _NUMBER_RE.findall(completion)
    return _to_float(nums[-1]) if nums else None


def math_correctness(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
                     **row_fields: Any) -> List[float]:
    """1.0 when the completion's final answer equals the reference, else 0.0
    (:mod:`logitless.rl.math_answers`: integers, decimals, ``1,000``, fractions, ``\\frac`` /
    ``\\dfrac``, ``\\boxed{}``, units, sympy-equivalent expressions).

    The completion's answer is the text after its last ``####``, else its last ``\\boxed{}``, else
    after "answer is", else its last number; the reference's is after ``####`` (GSM8K), else in its
    last ``\\boxed{}`` (a MATH solution), else the whole field.

    Args:
        prompts (Sequence[str]): prompts (unused).
        completions (Sequence[str]): generated texts.
        answer (Sequence[Any]): the dataset's ``answer`` column (a GSM8K answer, a MATH solution or a
            bare answer).
        **row_fields: other dataset columns (ignored).

    Returns:
        List[float]: one reward per completion.

    Example:
        >>> math_correctness(["q", "q"], ["so \\\\boxed{\\\\dfrac12}", "#### 0.51"], answer=["0.5", "#### 1/2"])
        [1.0, 0.0]
    """
    return [1.0 if answers_match(extract_answer(c), reference_answer(ref)) else 0.0
            for c, ref in zip(completions, answer)]


def gsm8k_correctness(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                      **row_fields: Any) -> List[float]:
    """GSM8K's correctness reward: :func:`math_correctness` on GSM8K answer fields (``"... #### 72"``).

    Args:
        prompts (Sequence[str]): prompts (unused).
        completions (Sequence[str]): generated texts.
        answer (Sequence[str]): GSM8K answer fields or bare numbers.
        **row_fields: other dataset columns (ignored).

    Returns:
        List[float]: one reward per completion.

    Example:
        >>> gsm8k_correctness(["q"], ["so 72 in total. #### 72"], answer=["... #### 72"])
        [1.0]
    """
    return math_correctness(prompts, completions, answer)


def gsm8k_format(prompts: Sequence[str], completions: Sequence[str], **row_fields: Any) -> List[float]:
    """1.0 when the completion ends with a ``#### <number>`` line (the GSM8K answer format).

    Args:
        prompts (Sequence[str]): prompts (unused).
        completions (Sequence[str]): generated texts.
        **row_fields: dataset columns (ignored).

    Returns:
        List[float]: one reward per completion.

    Example:
        >>> gsm8k_format(["q", "q"], ["so 7. #### 7", "the answer is 7"])
        [1.0, 0.0]
    """
    return [1.0 if _FORMAT_RE.search(c.strip()) else 0.0 for c in completions]


@dataclass(frozen=True)
class RewardSpec:
    """One reward function with its weight and the name its metrics are logged under."""

    name: str
    function: Callable[..., Sequence[float]]
    weight: float = 1.0


def build_reward_specs(entries: Sequence[Mapping[str, Any]]) -> List[RewardSpec]:
    """Resolves YAML reward entries ``{function: dotted.path, weight: float, name: str?}``.

    Args:
        entries (Sequence[Mapping]): the ``rewards`` list of a config. ``function`` is a dotted
            path to a callable, the callable itself, or a ``{_component_: ..., **args}`` mapping
            that builds one (e.g. :class:`logitless.rl.reward_models.SequenceClassifierReward`);
            ``weight`` defaults to 1.0; ``name``
            defaults to the function's last path component.

    Returns:
        List[RewardSpec]: one per entry.

    Raises:
        ValueError: on an empty list, a missing/unknown function, a component that cannot be built,
            a non-finite weight or duplicate names.

    Example:
        >>> [s.name for s in build_reward_specs([{"function": "logitless.rl.rewards.gsm8k_format"}])]
        ['gsm8k_format']
    """
    from torchtune.config._utils import _get_component_from_path

    if not entries:
        raise ValueError("rewards must list at least one reward function, got none")
    specs = []
    for i, entry in enumerate(entries):
        if "function" not in entry:
            raise ValueError(f"rewards[{i}] needs a 'function' (dotted path to a callable), got keys {list(entry)}")
        fn = entry["function"]
        if isinstance(fn, Mapping):  # a component with arguments, e.g. a reward model
            if "_component_" not in fn:
                raise ValueError(f"rewards[{i}].function: a mapping needs '_component_' (a dotted path to a class "
                                 f"or factory), got keys {list(fn)}")
            from omegaconf import OmegaConf
            from torchtune import config as tt_config

            try:
                fn = tt_config.instantiate(OmegaConf.create(dict(fn)))
            except Exception as e:
                raise ValueError(f"rewards[{i}].function={fn['_component_']!r} cannot be built: "
                                 f"{type(e).__name__}: {e}") from e
        elif isinstance(fn, str):
            try:
                fn = _get_component_from_path(fn)
            except Exception as e:  # torchtune raises InstantiationError
                raise ValueError(f"rewards[{i}].function={entry['function']!r} cannot be imported: {e}") from e
        if not callable(fn):
            raise ValueError(f"rewards[{i}].function must be callable, got {type(fn).__name__}")
        weight = float(entry.get("weight", 1.0))
        if not math.isfinite(weight):
            raise ValueError(f"rewards[{i}].weight must be finite, got {weight}")
        name = entry.get("name") or getattr(fn, "__name__", type(fn).__name__)
        specs.append(RewardSpec(name=str(name), function=fn, weight=weight))
    names = [s.name for s in specs]
    if "total" in names:
        raise ValueError("reward name 'total' is reserved for the weighted sum; set another 'name:'")
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique (set 'name:' to disambiguate), got {names}")
    return specs


def compute_rewards(
    specs: Sequence[RewardSpec],
    prompts: Sequence[str],
    completions: Sequence[str],
    row_fields: Optional[Mapping[str, Sequence[Any]]] = None,
    *,
    batch_id: Any = None,
) -> Dict[str, torch.Tensor]:
    """Calls every reward function and checks what it returns.

    Args:
        specs (Sequence[RewardSpec]): from :func:`build_reward_specs`.
        prompts (Sequence[str]): N prompt strings.
        completions (Sequence[str]): N completion strings.
        row_fields (Mapping[str, Sequence]): dataset columns, each of length N.
        batch_id (Any): identifies the batch in error messages (e.g. the training step).

    Returns:
        Dict[str, torch.Tensor]: ``{name: (N,) float32}`` for each function plus ``"total"``,
        the weighted sum.

    Raises:
        RewardError: naming the function and batch when a function raises, returns a length
            other than N or a non-number, or returns NaN (naming the prompt and completion).

    Example:
        >>> specs = build_reward_specs([{"function": "logitless.rl.rewards.gsm8k_format"}])
        >>> compute_rewards(specs, ["q"], ["#### 3"])["total"]
        tensor([1.])
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompts and completions must have the same length, got {len(prompts)} and {n}")
    row_fields = dict(row_fields or {})
    for key, values in row_fields.items():
        if len(values) != n:
            raise ValueError(f"row field {key!r} has {len(values)} values, expected {n} (one per completion)")
    out: Dict[str, torch.Tensor] = {}
    total = torch.zeros(n, dtype=torch.float32)
    where = f"batch {batch_id}" if batch_id is not None else "this batch"
    for spec in specs:
        try:
            values = spec.function(list(prompts), list(completions), **row_fields)
        except Exception as e:
            raise RewardError(f"reward function {spec.name!r} raised on {where} ({n} completions): "
                              f"{type(e).__name__}: {e}") from e
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward function {spec.name!r} must return a list of floats, on {where} "
                              f"it returned {type(values).__name__}: {e}") from e
        if len(values) != n:
            raise RewardError(f"reward function {spec.name!r} returned {len(values)} rewards on {where}, "
                              f"expected {n} (one per completion)")
        for i, v in enumerate(values):
            if math.isnan(v) or math.isinf(v):
                raise RewardError(f"reward function {spec.name!r} returned {v} on {where} for completion {i}; "
                                  f"prompt: {prompts[i]!r}; completion: {completions[i]!r}")
        t = torch.tensor(values, dtype=torch.float32)
        out[spec.name] = t
        total += spec.weight * t
    out["total"] = total
    return out
