"""Hugging Face <-> torchtune weight conversion of every family, by checkpointer ``model_type``.

torchtune 0.6.1 converts Qwen2 (``QWEN2``: key renaming only) and the Llama family (``LLAMA3``,
``LLAMA3_2``, ...: renaming plus the RoPE row permutation of q/k, because torchtune's Llama rotary
embedding pairs elements ``(2i, 2i + 1)`` where Hugging Face's pairs ``(i, i + D/2)``). It has no
Qwen3 (``QWEN3``): Qwen3's weights are Qwen2's names without the q/k/v biases plus the per-head
norms ``self_attn.q_norm`` / ``self_attn.k_norm``, and its rotary embedding is Qwen2's (no
permutation). :func:`qwen3_hf_to_tune` / :func:`qwen3_tune_to_hf` convert those two keys with our
map and everything else with torchtune's Qwen2 conversion.

Example:
    >>> to_hf = tune_to_hf_converter("QWEN3", {"num_heads": 16, "num_kv_heads": 8, "dim": 2048, "head_dim": 128})
    >>> sorted(to_hf({"layers.0.attn.q_norm.scale": torch.ones(128)}))
    ['model.layers.0.self_attn.q_norm.weight']
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping

import torch
from torchtune.models import convert_weights
from torchtune.models.convert_weights import get_mapped_key
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune, qwen2_tune_to_hf

__all__ = ["CONVERTIBLE_MODEL_TYPES", "hf_to_tune_converter", "qwen3_hf_to_tune", "qwen3_tune_to_hf",
           "tune_to_hf_converter"]

StateDict = Dict[str, torch.Tensor]

# The keys torchtune's Qwen2 map lacks: Qwen3's per-head q/k RMSNorm scales.
_QWEN3_NORMS_FROM_HF = {
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.scale",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.scale",
}
_QWEN3_NORMS_TO_HF = {v: k for k, v in _QWEN3_NORMS_FROM_HF.items()}
# torchtune model types whose conversion is renaming + q/k row permutations (convert_weights).
_LLAMA_STYLE = ("LLAMA2", "LLAMA3", "LLAMA3_2", "MISTRAL", "GEMMA")
#: Checkpointer model types this module converts in both directions.
CONVERTIBLE_MODEL_TYPES = ("QWEN2", "QWEN3") + _LLAMA_STYLE


def _is_qwen3_norm(key: str, hf: bool) -> bool:
    return key.endswith((".q_norm.weight", ".k_norm.weight") if hf else (".q_norm.scale", ".k_norm.scale"))


def qwen3_hf_to_tune(state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool = False) -> StateDict:
    """Qwen3 weights in Hugging Face names -> torchtune names (the tensors themselves are unchanged).

    Args:
        state_dict (Mapping[str, Tensor]): ``model.layers.N.self_attn.q_proj.weight``, ... and
            ``model.layers.N.self_attn.q_norm.weight`` / ``k_norm.weight``.
        tie_word_embeddings (bool): drop ``lm_head.weight`` (a tied model has no ``output.weight``).

    Returns:
        Dict[str, Tensor]: ``layers.N.attn.q_proj.weight``, ..., ``layers.N.attn.q_norm.scale``.

    Raises:
        Exception: torchtune's error naming a key that is neither Qwen2's nor a q/k norm.
    """
    norms = {k: v for k, v in state_dict.items() if _is_qwen3_norm(k, hf=True)}
    out = qwen2_hf_to_tune({k: v for k, v in state_dict.items() if k not in norms},
                           tie_word_embeddings=tie_word_embeddings)
    out.update({get_mapped_key(k, _QWEN3_NORMS_FROM_HF): v for k, v in norms.items()})
    return out


def qwen3_tune_to_hf(state_dict: Mapping[str, torch.Tensor]) -> StateDict:
    """Inverse of :func:`qwen3_hf_to_tune` (a tied model's state dict has no head, so HF's has none)."""
    norms = {k: v for k, v in state_dict.items() if _is_qwen3_norm(k, hf=False)}
    out = qwen2_tune_to_hf({k: v for k, v in state_dict.items() if k not in norms})
    out.update({get_mapped_key(k, _QWEN3_NORMS_TO_HF): v for k, v in norms.items()})
    return out


def _check(model_type: str) -> None:
    if model_type not in CONVERTIBLE_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r}: no HF <-> torchtune conversion here; expected one of "
                         f"{list(CONVERTIBLE_MODEL_TYPES)}")


def tune_to_hf_converter(model_type: str, arch: Mapping[str, int]) -> Callable[[Mapping[str, torch.Tensor]], StateDict]:
    """The torchtune -> HF weight conversion of ``model_type`` (what the HF checkpointers write).

    Args:
        model_type (str): ``QWEN2``, ``QWEN3`` or a Llama-style type (``LLAMA3``, ``LLAMA3_2``, ...).
        arch (Mapping[str, int]): ``num_heads``, ``num_kv_heads``, ``dim``, ``head_dim`` of the model.

    Returns:
        Callable: state dict (torchtune names) -> state dict (HF names).

    Raises:
        ValueError: naming the model type when it is not one of :data:`CONVERTIBLE_MODEL_TYPES`.
    """
    _check(model_type)
    kw = dict(num_heads=arch["num_heads"], num_kv_heads=arch["num_kv_heads"], dim=arch["dim"],
              head_dim=arch["head_dim"])
    if model_type == "QWEN2":
        return lambda sd: qwen2_tune_to_hf(dict(sd), **kw)
    if model_type == "QWEN3":
        return qwen3_tune_to_hf
    return lambda sd: convert_weights.tune_to_hf(dict(sd), **kw)


def hf_to_tune_converter(model_type: str, arch: Mapping[str, int], *, tie_word_embeddings: bool
                         ) -> Callable[[Mapping[str, torch.Tensor]], StateDict]:
    """The HF -> torchtune weight conversion of ``model_type`` (inverse of :func:`tune_to_hf_converter`).

    Args:
        model_type (str): as :func:`tune_to_hf_converter`.
        arch (Mapping[str, int]): ``num_heads``, ``num_kv_heads``, ``dim``, ``head_dim``.
        tie_word_embeddings (bool): the model ties its head (an ``lm_head.weight`` on disk is dropped).

    Returns:
        Callable: state dict (HF names) -> state dict (torchtune names).
    """
    _check(model_type)
    kw = dict(num_heads=arch["num_heads"], num_kv_heads=arch["num_kv_heads"], dim=arch["dim"],
              head_dim=arch["head_dim"])
    if model_type == "QWEN2":
        return lambda sd: qwen2_hf_to_tune(dict(sd), tie_word_embeddings=tie_word_embeddings, **kw)
    if model_type == "QWEN3":
        return lambda sd: qwen3_hf_to_tune(sd, tie_word_embeddings=tie_word_embeddings)

    # a tied checkpoint may still store lm_head.weight; the tied model has no output.weight to take it
    return lambda sd: convert_weights.hf_to_tune(
        {k: v for k, v in sd.items() if not (tie_word_embeddings and k == "lm_head.weight")}, **kw)
