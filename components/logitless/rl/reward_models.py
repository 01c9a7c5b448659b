"""A sequence-classification model as a reward function (TRL's ``reward_funcs="<model id>"``).

The model is a Hugging Face checkpoint folder that ``transformers.AutoModelForSequenceClassification``
loads (e.g. a Bradley-Terry reward model with one output); each completion's reward is the model's
first logit on ``prompt + completion`` (TRL's choice). It is named in YAML like a function, as a
component with its arguments::

    rewards:
      - function:
          _component_: logitless.rl.reward_models.SequenceClassifierReward
          path: /models/my-reward-model
          batch_size: 16
        weight: 1.0
        name: reward_model

The model is loaded on the first call, on the policy's device (``device: auto``; the recipe tells
it which, see :func:`place_reward_models`), in eval mode; scoring runs under ``torch.no_grad`` in
batches of ``batch_size``, right-padded with the reward model's own tokenizer. ``transformers``
is an optional dependency: it is imported only here, with a clear error when missing.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence

import torch

__all__ = ["SequenceClassifierReward", "place_reward_models"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class SequenceClassifierReward:
    """Scores completions with a sequence-classification model (see the module docstring).

    Args:
        path (str): HF checkpoint folder with the model's config, weights and tokenizer.
        batch_size (int): texts per forward.
        max_length (Optional[int]): truncate each text to this many tokens (None: the model's limit).
        device (str): ``"auto"`` (the policy's device, set by the recipe; CPU until then) or a device.
        dtype (str): ``"fp32" | "bf16" | "fp16"``.
        label (int): which logit is the reward (0: TRL's convention for single-output models).
        name (str): the default name of its metrics (``reward/<name>/mean``).

    Raises:
        ValueError: a missing folder, a bad ``batch_size`` / ``dtype`` (named, before anything loads).
        ImportError: ``transformers`` is not installed (at the first call).

    Example:
        >>> rm = SequenceClassifierReward("/models/rm", batch_size=8)  # doctest: +SKIP
        >>> rm(["Q: 1+1?"], [" 2"])   # one float per completion  # doctest: +SKIP
    """

    def __init__(self, path: str, *, batch_size: int = 8, max_length: Optional[int] = None, device: str = "auto",
                 dtype: str = "fp32", label: int = 0, name: str = "reward_model"):
        if not os.path.isdir(path):
            raise ValueError(f"SequenceClassifierReward path={path!r}: expected a Hugging Face checkpoint folder "
                             f"(config.json, weights, tokenizer files), no such folder")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"SequenceClassifierReward batch_size={batch_size!r}: expected an int >= 1")
        if dtype not in _DTYPES:
            raise ValueError(f"SequenceClassifierReward dtype={dtype!r}: expected one of {sorted(_DTYPES)}")
        self.path, self.batch_size, self.max_length = path, batch_size, max_length
        self.device = None if device == "auto" else torch.device(device)
        self.dtype, self.label, self.__name__ = _DTYPES[dtype], label, name
        self.model = self.tokenizer = None

    def to_device(self, device: torch.device) -> None:
        """Puts the model on ``device`` unless a device was given in the config."""
        if self.device is None:
            self.device = torch.device(device)
            if self.model is not None:
                self.model.to(self.device)

    def _load(self) -> None:
        try:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as e:
            raise ImportError("SequenceClassifierReward needs the optional dependency 'transformers' "
                              "(pip install transformers)") from e
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=self.dtype)
        if model.config.pad_token_id is None:  # HF finds each row's last token through the pad id
            model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= self.label < model.config.num_labels:
            raise ValueError(f"SequenceClassifierReward label={self.label}: the model at {self.path!r} has "
                             f"{model.config.num_labels} outputs")
        self.model = model.to(self.device or torch.device("cpu")).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **row_fields: Any) -> List[float]:
        """One reward per completion: logit ``label`` of the model on ``prompt + completion``."""
        if self.model is None:
            self._load()
        device = next(self.model.parameters()).device
        texts = [p + c for p, c in zip(prompts, completions)]
        out: List[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None, max_length=self.max_length)
            logits = self.model(**{k: v.to(device) for k, v in enc.items()}).logits
            out.extend(logits[:, self.label].float().cpu().tolist())
        return out


def place_reward_models(specs: Sequence[Any], device: torch.device) -> None:
    """Tells every reward that holds a model (``to_device``) the policy's device."""
    for spec in specs:
        if hasattr(spec.function, "to_device"):
            spec.function.to_device(device)
