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

A reward function returns one real number per completion: a list (or a 1-D tensor / array) of
``int`` / ``float`` values, each finite with ``|r| <= MAX_ABS_REWARD`` (1e15), as is the weighted
total. A string, a numeric string, a bool, ``None``, a wrong count, NaN, inf or a value past the bound
stops the run with a :class:`RewardError` naming the function, the step and the completion. The bound
keeps every statistic of a step finite in float32: a group's or batch's standard deviation sums squared
deviations of up to (2e15)^2 each, and over a million completions that is still below float32's
largest value (3.4e38); rewards of +-3e38 would make them inf, the advantages NaN.
"""

import difflib
import inspect
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from logitless.rl.math_answers import answers_match, extract_answer, reference_answer
from logitless.training.config import ConfigError

__all__ = [
    "COMPLETION_IDS",
    "MAX_ABS_REWARD",
    "REWARD_KEYS",
    "RewardError",
    "RewardSpec",
    "build_reward_specs",
    "compute_rewards",
    "extract_final_number",
    "gsm8k_correctness",
    "gsm8k_format",
    "math_correctness",
    "parse_gsm8k_answer",
    "reward_columns",
]

#: The largest |reward| (and |weighted total|) accepted: group and batch statistics stay finite in float32.
MAX_ABS_REWARD = 1e15
#: The keys of one ``rewards:`` entry.
REWARD_KEYS = ("function", "weight", "name")

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_BOXED_RE = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*\$?\s*(" + _NUMBER + r")", re.IGNORECASE)
_FORMAT_RE = re.compile(r"####\s*\$?\s*(?:" + _NUMBER + r")\s*\.?\s*$")


#: The keyword under which every reward function receives the completions' token ids.
COMPLETION_IDS = "completion_ids"


class RewardError(RuntimeError):
    """A reward function failed, or returned something other than one finite real number per completion."""


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
            ``weight`` (a number, default 1.0); ``name`` (default: the function's last path component).
            Any other key is an error (a misspelt ``wieght`` would otherwise leave the weight at 1.0).

    Returns:
        List[RewardSpec]: one per entry.

    Raises:
        ConfigError: naming ``rewards[i].<key>``: an empty list, an unknown key, a missing or
            non-importable function, one that cannot take ``(prompts, completions, **columns)``, a
            component that cannot be built, a weight that is not a finite number (a bool or a string
            is not one), duplicate names.

    Example:
        >>> [s.name for s in build_reward_specs([{"function": "logitless.rl.rewards.gsm8k_format"}])]
        ['gsm8k_format']
    """
    from torchtune.config._utils import _get_component_from_path

    if not entries:
        raise ConfigError("config key 'rewards': expected at least one reward function, got none")
    specs = []
    for i, entry in enumerate(entries):
        key = f"config key 'rewards[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{key}': expected a mapping {{function, weight, name}}, got {entry!r}")
        for k in entry:
            if k not in REWARD_KEYS:
                close = difflib.get_close_matches(str(k), REWARD_KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{key}.{k}': unknown; a reward entry takes {list(REWARD_KEYS)}{hint}")
        if "function" not in entry:
            raise ConfigError(f"{key}.function': required (a dotted path to a callable), got keys {list(entry)}")
        fn = entry["function"]
        if isinstance(fn, Mapping):  # a component with arguments, e.g. a reward model
            if "_component_" not in fn:
                raise ConfigError(f"{key}.function': a mapping needs '_component_' (a dotted path to a class or "
                                  f"factory), got keys {list(fn)}")
            from omegaconf import OmegaConf
            from torchtune import config as tt_config

            try:
                fn = tt_config.instantiate(OmegaConf.create(dict(fn)))
            except Exception as e:
                raise ConfigError(f"{key}.function': {fn['_component_']!r} cannot be built: "
                                  f"{type(e).__name__}: {e}") from e
        elif isinstance(fn, str):
            try:
                fn = _get_component_from_path(fn)
            except Exception as e:  # torchtune raises InstantiationError
                raise ConfigError(f"{key}.function': {entry['function']!r} cannot be imported: {e}") from e
        if not callable(fn):
            raise ConfigError(f"{key}.function': expected a callable, got {type(fn).__name__} {fn!r}")
        _check_reward_signature(fn, f"{key}.function'")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{key}.weight': expected a finite number, got {weight!r} ({type(weight).__name__})")
        name = entry.get("name") or getattr(fn, "__name__", type(fn).__name__)
        if not isinstance(name, str):
            raise ConfigError(f"{key}.name': expected a string, got {name!r}")
        specs.append(RewardSpec(name=name, function=fn, weight=float(weight)))
    names = [s.name for s in specs]
    if "total" in names:
        raise ConfigError("config key 'rewards': the name 'total' is reserved for the weighted sum; set another "
                          "'name:'")
    if len(set(names)) != len(names):
        raise ConfigError(f"config key 'rewards': reward names must be unique (set 'name:' to disambiguate), "
                          f"got {names}")
    return specs


def _signature(fn: Callable) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None


def _check_reward_signature(fn: Callable, where: str) -> None:
    sig = _signature(fn)
    if sig is None:
        return
    try:
        sig.bind_partial([], [])
    except TypeError:
        raise ConfigError(f"{where}: {getattr(fn, '__name__', fn)!r} cannot take (prompts, completions, **columns): "
                          f"its signature is {sig}") from None


def reward_columns(fn: Callable) -> Tuple[Tuple[str, ...], Optional[Tuple[str, ...]]]:
    """The dataset columns a reward function reads, from its signature.

    Args:
        fn (Callable): a reward function ``f(prompts, completions, <columns>, **kwargs)``.

    Returns:
        Tuple: ``(required, accepted)``: the columns it needs (arguments after the first two without a
        default), and every column it can take (None: any, through ``**kwargs``).

    Example:
        >>> reward_columns(math_correctness)
        (('answer',), None)
    """
    sig = _signature(fn)
    if sig is None:
        return (), None
    params = list(sig.parameters.values())
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    columns = [p for p in named if p not in positional]
    required = tuple(p.name for p in columns if p.default is p.empty)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    return required, None if takes_any else tuple(p.name for p in columns)


def _real(v: Any) -> Optional[float]:
    """``v`` as a float when it is one real number (int, float, numpy or one-element tensor; not a
    bool, not a string), else None."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype == torch.bool or v.is_complex():
            return None
        return float(v.item())
    if isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy numbers are Real, numpy bools not
        return None
    return float(v)


def _check_values(spec: RewardSpec, values: Any, n: int, where: str, prompts: Sequence[str],
                  completions: Sequence[str]) -> List[float]:
    """The function's values as floats, or a RewardError naming what is wrong with them."""
    what = f"reward function {spec.name!r}"
    if isinstance(values, torch.Tensor) or type(values).__module__ == "numpy":
        values = values.tolist() if getattr(values, "ndim", 1) == 1 else values
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"{what} returned a {type(values).__name__} on {where}; expected a list of {n} real "
                          f"numbers, one per completion (a string would be read one character at a time)")
    if len(values) != n:
        raise RewardError(f"{what} returned {len(values)} rewards on {where}, expected {n} (one per completion)")
    out = []
    for i, v in enumerate(values):
        x = _real(v)
        if x is None or not math.isfinite(x) or abs(x) > MAX_ABS_REWARD:
            why = ("a real number (int or float; not a string, a bool or None)" if x is None else
                   f"a finite number with |r| <= {MAX_ABS_REWARD:g}")
            raise RewardError(f"{what} returned {v!r} ({type(v).__name__}) on {where} for completion {i}; expected "
                              f"{why}. Prompt: {prompts[i]!r}; completion: {completions[i]!r}")
        out.append(x)
    return out


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
        RewardError: naming the function and batch when a function raises, returns something other
            than a list of N real numbers (a string, a bool, None...), or a value that is not finite or
            exceeds :data:`MAX_ABS_REWARD` (naming the completion, its prompt and text), or when the
            weighted total does.

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
    total = torch.zeros(n, dtype=torch.float64)
    where = f"batch {batch_id}" if batch_id is not None else "this batch"
    for spec in specs:
        try:
            values = spec.function(list(prompts), list(completions), **row_fields)
        except Exception as e:
            raise RewardError(f"reward function {spec.name!r} raised on {where} ({n} completions): "
                              f"{type(e).__name__}: {e}") from e
        t = torch.tensor(_check_values(spec, values, n, where, prompts, completions), dtype=torch.float64)
        out[spec.name] = t.float()
        total += spec.weight * t
    big = (total.abs() > MAX_ABS_REWARD).nonzero()
    if len(big):
        i = int(big[0])
        raise RewardError(f"the weighted total of the rewards is {float(total[i]):g} on {where} for completion {i}; "
                          f"expected |total| <= {MAX_ABS_REWARD:g} (weights {[s.weight for s in specs]})")
    out["total"] = total.float()
    return out
