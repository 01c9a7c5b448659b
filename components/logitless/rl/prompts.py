"""Prompt datasets for GRPO: any prompt table with plain or conversational prompts
(:func:`prompt_dataset`), GSM8K (HF hub or local JSON/Parquet), a tiny arithmetic task (plain and
as chat rows), and random-token prompts for random-weight runs.

Every dataset yields rows ``{"prompt_tokens": list[int], "prompt": str, **fields}``: ``prompt`` is
the text the policy is given (its chat-template rendering for conversational prompts) and the
fields are the dataset's other columns, every one handed to the reward functions as a keyword
argument (TRL's convention). A conversational prompt's row also holds its chat messages
(``prompt_messages``: ``[{"role", "content"}, ...]``, the system prompt included), what a tool
rollout renders with the tools (:mod:`logitless.generation.tools`). Prompts longer than ``max_prompt_tokens``
are dropped (``overflow="skip"``), cut from the left keeping the end of the prompt where the
question and the generation header are (``"truncate"``), or rejected (``"error"``): never mangled
silently.
"""

import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from torch.utils.data import Dataset

from logitless.datasets._files import check_encoding, data_files_problem
from logitless.rl.chat import chat_messages, is_conversation, render_chat_prompt

#: Row keys that are not dataset columns, and the reward functions' own argument names: a column
#: may not take them (it would shadow the prompt or a positional argument of every reward).
RESERVED_COLUMNS = ("prompt", "prompt_tokens", "prompt_messages", "prompts", "completions", "conversation",
                    "environment_info")
#: Row keys that are not handed to the reward functions.
PROMPT_KEYS = ("prompt", "prompt_tokens", "prompt_messages")

DEFAULT_GSM8K_SYSTEM_PROMPT = (
    "You are a helpful math assistant. Solve the problem step by step, then give the final "
    "answer on its own last line as '#### <number>'."
)
_OVERFLOW = ("skip", "truncate", "error")
_ASSETS = Path(__file__).resolve().parent / "assets"
#: The tiny conversational arithmetic task (JSON lines, TRL's conversational format) of
#: ``configs/tiny_grpo_chat.yaml``: ``{"prompt": [system, user], "answer", "a", "b"}`` per row.
TINY_CHAT_FILES = {"train": str(_ASSETS / "tiny_chat_arithmetic_train.jsonl"),
                   "eval": str(_ASSETS / "tiny_chat_arithmetic_eval.jsonl")}


class PromptDataset(Dataset):
    """Tokenised prompts with their dataset fields.

    Args:
        prompts (Sequence[str]): prompt texts (for logging and the reward functions).
        prompt_tokens (Sequence[Sequence[int]]): their token ids.
        fields (Dict[str, Sequence]): other columns, each as long as ``prompts``.
        max_prompt_tokens (Optional[int]): length limit.
        overflow (str): ``"skip" | "truncate" | "error"`` for prompts over the limit.
        source (str): where the prompts come from (a file or hub id), named in error messages.
        messages (Optional[Sequence[Optional[list]]]): each prompt's chat messages (None: not a chat),
            kept as the row's ``prompt_messages``.

    Example:
        >>> ds = PromptDataset(["1+1="], [[16, 10, 16, 28]], {"answer": ["2"]})
        >>> ds[0]["answer"]
        '2'
    """

    def __init__(self, prompts: Sequence[str], prompt_tokens: Sequence[Sequence[int]],
                 fields: Optional[Dict[str, Sequence[Any]]] = None, *,
                 max_prompt_tokens: Optional[int] = None, overflow: str = "skip", source: str = "",
                 messages: Optional[Sequence[Optional[list]]] = None):
        if overflow not in _OVERFLOW:
            raise ValueError(f"overflow must be one of {_OVERFLOW}, got {overflow!r}")
        fields = dict(fields or {})
        for key in RESERVED_COLUMNS:
            if key in fields:
                raise ValueError(f"field {key!r} is reserved ({', '.join(RESERVED_COLUMNS)} are the prompt and "
                                 f"the reward functions' own arguments); rename the column")
        for key, values in fields.items():
            if len(values) != len(prompts):
                raise ValueError(f"field {key!r} has {len(values)} values, expected {len(prompts)}")
        if len(prompt_tokens) != len(prompts):
            raise ValueError(f"got {len(prompt_tokens)} token lists for {len(prompts)} prompts")
        if messages is not None and len(messages) != len(prompts):
            raise ValueError(f"got {len(messages)} message lists for {len(prompts)} prompts")
        self.rows: List[Dict[str, Any]] = []
        self.source = source
        self.num_skipped = self.num_truncated = 0
        where = f" of {source!r}" if source else ""
        for i, (text, toks) in enumerate(zip(prompts, prompt_tokens)):
            toks = list(toks)
            if not toks:
                raise ValueError(f"prompt {i}{where} tokenises to nothing: {text!r}; expected a non-empty prompt")
            if max_prompt_tokens is not None and len(toks) > max_prompt_tokens:
                if overflow == "error":
                    raise ValueError(f"prompt {i}{where} has {len(toks)} tokens, more than max_prompt_tokens="
                                     f"{max_prompt_tokens}; raise the limit or set overflow to skip/truncate")
                if overflow == "skip":
                    self.num_skipped += 1
                    continue
                toks = toks[-max_prompt_tokens:]
                self.num_truncated += 1
            row = {"prompt_tokens": toks, "prompt": text, **{k: v[i] for k, v in fields.items()}}
            if messages is not None and messages[i] is not None:
                row["prompt_messages"] = messages[i]
            self.rows.append(row)
        if not self.rows:
            raise ValueError(f"no prompt is left after applying max_prompt_tokens={max_prompt_tokens} "
                             f"(overflow={overflow!r}); all {len(prompts)} were too long")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return self.rows[i]


def _user_turn(text: str, system_prompt: Optional[str]) -> list:
    return chat_messages([{"role": "user", "content": text}], system_prompt=system_prompt)


def _encode(tokenizer: Any, text: str, system_prompt: Optional[str], chat: bool) -> List[int]:
    if not chat:
        return tokenizer.encode(text, add_bos=False, add_eos=False)
    return render_chat_prompt(tokenizer, [{"role": "user", "content": text}], system_prompt=system_prompt)[0]


def _load_table(source: str, name: Optional[str], split: str, data_files: Any):
    """An HF ``datasets`` split: from the hub, or from local JSON / JSON lines / Parquet / CSV files."""
    import datasets

    if source not in ("json", "parquet", "csv"):
        return datasets.load_dataset(source, name, split=split)
    if data_files is None:
        raise ValueError(f"source={source!r} needs data_files (a local path)")
    check_encoding(source, data_files)  # bad bytes would load, and fail at a later read
    try:
        table = datasets.load_dataset(source, data_files=data_files, split=split)
    except Exception as e:  # the loader's message names neither the file nor the row: find them
        problem = data_files_problem(source, data_files)
        if problem is None:
            raise
        raise ValueError(problem) from e
    if len(table) == 0:
        raise ValueError(f"{str(data_files)!r} holds no rows; expected at least one prompt")
    return table


def gsm8k_dataset(
    tokenizer: Any,
    *,
    source: str = "openai/gsm8k",
    name: Optional[str] = "main",
    split: str = "train",
    data_files: Optional[Any] = None,
    question_column: str = "question",
    answer_column: str = "answer",
    system_prompt: Optional[str] = DEFAULT_GSM8K_SYSTEM_PROMPT,
    chat: bool = True,
    max_prompt_tokens: Optional[int] = 512,
    overflow: str = "skip",
    num_samples: Optional[int] = None,
) -> PromptDataset:
    """GSM8K prompts (question as a chat turn) with the ``answer`` field for the rewards.

    Args:
        tokenizer: a torchtune tokenizer (``tokenize_messages`` when ``chat``, else ``encode``).
        source (str): HF dataset id, or ``"json"`` / ``"parquet"`` with ``data_files``.
        name (Optional[str]): HF config name (``"main"``); ignored for local files.
        split (str): ``"train"`` or ``"test"``.
        data_files: local file(s) for ``source="json"|"parquet"``.
        question_column (str): column with the question.
        answer_column (str): column with the reference answer (``"... #### 72"``).
        system_prompt (Optional[str]): system turn (None for none).
        chat (bool): format with the tokenizer's chat template (else raw text).
        max_prompt_tokens (Optional[int]): prompt length limit.
        overflow (str): ``"skip" | "truncate" | "error"``.
        num_samples (Optional[int]): keep the first N rows.

    Returns:
        PromptDataset: rows with ``prompt_tokens``, ``prompt``, ``answer`` and every other column of
        the source (``question``...), all handed to the reward functions.

    Example:
        >>> ds = gsm8k_dataset(tok, source="json", data_files="gsm8k.jsonl")  # doctest: +SKIP
    """
    raw = _load_table(source, name, split, data_files)
    where = str(data_files if data_files is not None else source)
    for col in (question_column, answer_column):
        if col not in raw.column_names:
            raise ValueError(f"GSM8K source {where!r} has no column {col!r}; columns: {raw.column_names}")
    if num_samples is not None:
        raw = raw.select(range(min(num_samples, len(raw))))
    # a missing or empty answer is the recipe's to count (on_missing_answer), with every reward's columns
    for i, q in enumerate(raw[question_column]):
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"GSM8K source {where!r}: row {i} has {question_column!r} = {q!r}; "
                             f"expected a non-empty string")
    questions = list(raw[question_column])
    tokens = [_encode(tokenizer, q, system_prompt, chat) for q in questions]
    # the prompt text (logs, rewards) is what the policy is given: the chat rendering when ``chat``
    texts = [tokenizer.decode(t, skip_special_tokens=False) for t in tokens] if chat else questions
    # every column reaches the reward functions (TRL's convention); the reference is always ``answer``
    fields = {c: list(raw[c]) for c in raw.column_names if c not in RESERVED_COLUMNS}
    fields["answer"] = list(raw[answer_column])
    messages = [_user_turn(q, system_prompt) for q in questions] if chat else None
    return PromptDataset(texts, tokens, fields, max_prompt_tokens=max_prompt_tokens, overflow=overflow,
                         source=where, messages=messages)


def prompt_dataset(
    tokenizer: Any,
    *,
    source: str = "json",
    data_files: Optional[Any] = None,
    name: Optional[str] = None,
    split: str = "train",
    prompt_column: str = "prompt",
    answer_column: Optional[str] = None,
    system_prompt: Optional[str] = None,
    chat: Optional[bool] = None,
    max_prompt_tokens: Optional[int] = None,
    overflow: str = "skip",
    num_samples: Optional[int] = None,
) -> PromptDataset:
    """Any prompt table: plain-text prompts or conversational ones (lists of messages), every other
    column handed to the reward functions as a keyword argument.

    A conversational row (TRL's format) holds its prompt as
    ``[{"role": "system", "content": ...}, {"role": "user", "content": ...}]`` and is rendered with
    the tokenizer's chat template, ending with the open assistant turn
    (:func:`logitless.rl.chat.render_chat_prompt`); its ``prompt`` text (logs, rewards) is that
    rendering. A plain-text prompt is encoded as is, or as one user turn when ``chat`` is true.

    Args:
        tokenizer: a torchtune tokenizer (``tokenize_messages`` for conversational prompts).
        source (str): HF dataset id, or ``"json"`` (JSON / JSON lines) / ``"parquet"`` / ``"csv"`` with
            ``data_files``.
        data_files: local file(s) for a file ``source``.
        name (Optional[str]): HF config name.
        split (str): the split (a local file's rows are ``"train"``).
        prompt_column (str): column with the prompt (a string or a list of messages).
        answer_column (Optional[str]): a column also exposed as ``answer`` (e.g. ``solution`` of MATH),
            the keyword the bundled correctness rewards read.
        system_prompt (Optional[str]): system message put first in every conversation that has none.
        chat (Optional[bool]): render plain-text prompts as a user turn too (None: only lists of
            messages go through the template; a ``system_prompt`` implies true).
        max_prompt_tokens (Optional[int]): prompt length limit.
        overflow (str): ``"skip" | "truncate" | "error"``.
        num_samples (Optional[int]): keep the first N rows.

    Returns:
        PromptDataset: rows with ``prompt_tokens``, ``prompt`` and every other column.

    Raises:
        ValueError: naming the column or row (missing column, a bad message, a reserved column name).

    Example:
        >>> from logitless.datasets import tiny_qwen2_5_tokenizer
        >>> from logitless.rl.prompts import TINY_CHAT_FILES
        >>> ds = prompt_dataset(tiny_qwen2_5_tokenizer(), data_files=TINY_CHAT_FILES["train"])
        >>> sorted(k for k in ds[0] if k != "prompt_tokens")
        ['a', 'answer', 'b', 'prompt']
    """
    raw = _load_table(source, name, split, data_files)
    for key, col in (("prompt_column", prompt_column), ("answer_column", answer_column)):
        if col is not None and col not in raw.column_names:
            raise ValueError(f"prompt_dataset {key}={col!r}: no such column in {source!r} "
                             f"({data_files or name}); columns: {raw.column_names}")
    if num_samples is not None:
        raw = raw.select(range(min(num_samples, len(raw))))
    wrap = bool(system_prompt) if chat is None else chat
    texts, tokens, messages = [], [], []
    for i, prompt in enumerate(raw[prompt_column]):
        row = f"{prompt_column} of row {i} of {str(data_files or source)!r}"
        if is_conversation(prompt):
            toks, text = render_chat_prompt(tokenizer, prompt, system_prompt=system_prompt, where=row)
            messages.append(chat_messages(prompt, system_prompt=system_prompt, where=row))
        elif isinstance(prompt, str):
            toks, text = _encode(tokenizer, prompt, system_prompt, wrap), prompt
            messages.append(_user_turn(prompt, system_prompt) if wrap else None)
            if wrap:
                text = tokenizer.decode(toks, skip_special_tokens=False)
        else:
            raise ValueError(f"{row}: expected a string or a list of {{role, content}} messages, "
                             f"got {type(prompt).__name__}")
        texts.append(text)
        tokens.append(toks)
    fields = {c: list(raw[c]) for c in raw.column_names if c != prompt_column}
    reserved = [c for c in fields if c in RESERVED_COLUMNS]
    if reserved:
        raise ValueError(f"prompt_dataset: column {reserved[0]!r} is a reserved name ({RESERVED_COLUMNS}); "
                         f"rename it in the data")
    if answer_column is not None and answer_column != "answer":
        fields["answer"] = list(raw[answer_column])
    return PromptDataset(texts, tokens, fields, max_prompt_tokens=max_prompt_tokens, overflow=overflow,
                         source=str(data_files or source), messages=messages)


def arithmetic_pairs(max_sum: int = 9, b_values: Optional[Sequence[int]] = None) -> List[tuple]:
    """All ``(a, b)`` with ``a, b >= 0``, ``a + b <= max_sum`` and ``b`` in ``b_values`` (all if None),
    in a fixed order."""
    pairs = [(a, b) for a in range(max_sum + 1) for b in range(max_sum + 1 - a)]
    if b_values is not None:
        pairs = [(a, b) for a, b in pairs if b in set(b_values)]
    if not pairs:
        raise ValueError(f"no pair (a, b) with a + b <= {max_sum} and b in {list(b_values)}")
    return pairs


def arithmetic_dataset(
    tokenizer: Any,
    *,
    split: str = "train",
    max_sum: int = 9,
    b_values: Optional[Sequence[int]] = None,
    eval_fraction: float = 0.2,
    template: str = "{a}+{b}=",
    chat: bool = False,
    system_prompt: Optional[str] = None,
    seed: int = 0,
) -> PromptDataset:
    """The tiny GRPO task: ``"a+b="`` with single-digit sums, answer as ``"#### <a+b>"``.

    All pairs with ``a + b <= max_sum`` are shuffled with ``seed`` and split: the last
    ``eval_fraction`` of them are the held-out ``"eval"`` prompts, the rest ``"train"``.

    Args:
        tokenizer: torchtune tokenizer (``encode``; ``tokenize_messages`` if ``chat``).
        split (str): ``"train" | "eval" | "all"``.
        max_sum (int): largest sum (9 keeps every answer one digit token).
        b_values (Optional[Sequence[int]]): allowed second operands (all if None).
        eval_fraction (float): share of pairs held out.
        template (str): prompt text with ``{a}`` and ``{b}``.
        chat (bool): wrap in the chat template.
        system_prompt (Optional[str]): system turn when ``chat``.
        seed (int): split seed.

    Returns:
        PromptDataset: rows with ``prompt_tokens``, ``prompt``, ``answer``.

    Example:
        >>> from logitless.datasets import tiny_qwen2_5_tokenizer
        >>> ds = arithmetic_dataset(tiny_qwen2_5_tokenizer(), split="all")
        >>> len(ds), ds[0]["answer"]
        (55, '#### 0')
    """
    if split not in ("train", "eval", "all"):
        raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    pairs = arithmetic_pairs(max_sum, b_values)
    if split != "all":
        random.Random(seed).shuffle(pairs)
        n_eval = int(round(len(pairs) * eval_fraction))
        pairs = pairs[len(pairs) - n_eval:] if split == "eval" else pairs[:len(pairs) - n_eval]
    texts = [template.format(a=a, b=b) for a, b in pairs]
    tokens = [_encode(tokenizer, t, system_prompt, chat) for t in texts]
    messages = [_user_turn(t, system_prompt) for t in texts] if chat else None
    return PromptDataset(texts, tokens, {"answer": [f"#### {a + b}" for a, b in pairs]}, messages=messages)


def synthetic_prompt_dataset(
    tokenizer: Any = None,
    *,
    num_samples: int = 64,
    prompt_len: int = 128,
    vocab_size: Optional[int] = None,
    seed: int = 0,
    **real_dataset_args: Any,
) -> PromptDataset:
    """Random-token prompts of exactly ``prompt_len`` tokens (random-weight runs, benchmarks).

    Swaps in for :func:`gsm8k_dataset` with one ``_component_`` override: its file/source
    arguments are accepted and ignored. The ``answer`` field is ``"#### 0"``.

    Args:
        tokenizer: gives ``vocab_size`` (or pass it); ids are drawn below ``vocab_size - 1``... and
            below the smallest special token of a Qwen tokenizer, so prompts hold ordinary tokens.
        num_samples (int): number of prompts.
        prompt_len (int): tokens per prompt.
        vocab_size (Optional[int]): overrides the tokenizer's size.
        seed (int): data seed.
        **real_dataset_args: ignored (``source``, ``split``, ``max_prompt_tokens``...).

    Returns:
        PromptDataset: rows with ``prompt_tokens``, ``prompt`` (ids as text), ``answer``.

    Example:
        >>> ds = synthetic_prompt_dataset(vocab_size=1000, num_samples=2, prompt_len=8)
        >>> len(ds[1]["prompt_tokens"])
        8
    """
    import torch

    if vocab_size is None:
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if vocab_size is None and hasattr(tokenizer, "encoder"):
            vocab_size = len(tokenizer.encoder)  # ordinary BPE tokens only
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"synthetic_prompt_dataset needs vocab_size >= 2 (or a tokenizer that has it), "
                         f"got {vocab_size!r}")
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab_size - 1, (num_samples, prompt_len), generator=g).tolist()
    texts = [" ".join(map(str, t[:8])) + " ..." for t in toks]
    return PromptDataset(texts, toks, {"answer": ["#### 0"] * num_samples})


def arithmetic_warmstart_dataset(
    tokenizer: Any,
    *,
    num_samples: int = 2000,
    max_sum: int = 9,
    b_values: Optional[Sequence[int]] = None,
    template: str = "{a}+{b}=",
    answers: str = "random",
    seed: int = 0,
    **real_dataset_args: Any,
) -> List[Dict[str, List[int]]]:
    """SFT rows that teach the *format* of the arithmetic task: prompt, one digit, end of turn.

    With ``answers="random"`` the digit is uniform and unrelated to the question, so a policy
    trained on it answers in the right format with ~10% accuracy: the arithmetic itself is left
    for GRPO to learn from the reward. ``"correct"`` gives the true sums (a supervised baseline).

    Args:
        tokenizer: torchtune tokenizer (``encode``, ``eos_id``).
        num_samples (int): rows (pairs are cycled).
        max_sum (int): largest sum, as in :func:`arithmetic_dataset`.
        b_values (Optional[Sequence[int]]): allowed second operands, as in :func:`arithmetic_dataset`.
        template (str): prompt text.
        answers (str): ``"random" | "correct"``.
        seed (int): seed of the random digits.
        **real_dataset_args: ignored.

    Returns:
        List[Dict[str, List[int]]]: rows ``{"tokens", "labels"}`` (prompt labels ignored),
        usable as the ``dataset`` of the SFT recipes.

    Example:
        >>> from logitless.datasets import tiny_qwen2_5_tokenizer
        >>> row = arithmetic_warmstart_dataset(tiny_qwen2_5_tokenizer(), num_samples=1)[0]
        >>> row["labels"][:4]
        [-100, -100, -100, -100]
    """
    if answers not in ("random", "correct"):
        raise ValueError(f"answers must be 'random' or 'correct', got {answers!r}")
    rng = random.Random(seed)
    pairs = arithmetic_pairs(max_sum, b_values)
    rows = []
    for i in range(num_samples):
        a, b = pairs[i % len(pairs)]
        digit = rng.randint(0, max_sum) if answers == "random" else a + b
        prompt = tokenizer.encode(template.format(a=a, b=b), add_bos=False, add_eos=False)
        answer = tokenizer.encode(str(digit), add_bos=False, add_eos=False) + [tokenizer.eos_id]
        rows.append({"tokens": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return rows
