"""Model set-up: build from config in a dtype, load weights with named mismatches, LoRA, AC, compile."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config as tt_config
from torchtune import modules as tt_modules
from torchtune import training as tt_training
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
)

from logitless.first_start import note_compile


class CheckpointMismatchError(ValueError):
    """The weights on disk do not fit the model built from the config."""


# HF's Qwen2/Llama initializer_range: torchtune's builders draw token embeddings from N(0, 1), which
# through a tied head makes a random model's logits ~sqrt(H) wide (Qwen2.5-0.5B starts at loss ~780).
RANDOM_INIT_EMBEDDING_STD = 0.02


def build_model(model_cfg: DictConfig, *, device: torch.device, dtype: torch.dtype,
                seed: Optional[int] = None, embedding_std: Optional[float] = None) -> nn.Module:
    """Instantiates ``model`` from config directly in ``dtype`` on ``device``.

    Args:
        model_cfg (DictConfig): ``_component_`` node of a model builder.
        device (torch.device): where the parameters live (``meta`` for FSDP2 deferred init).
        dtype (torch.dtype): parameter dtype.
        seed (Optional[int]): seeds the random initialisation (the global RNG is restored after), so
            that every data-parallel rank builds the same weights: torchtune seeds each rank with
            ``seed + rank``, and FSDP2 keeps each rank's shard of ITS OWN initial weights.
        embedding_std (Optional[float]): re-draw the token embeddings from ``N(0, embedding_std)``
            (for ``model_init: random``: :data:`RANDOM_INIT_EMBEDDING_STD`); None keeps torchtune's.

    Returns:
        nn.Module: the model (randomly initialised; DoRA magnitudes set from these weights).

    Example:
        >>> build_model(OmegaConf.create({"_component_": "logitless.models.qwen2_5_tiny"}),
        ...             device=torch.device("cpu"), dtype=torch.float32, seed=0)
    """
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        with tt_training.set_default_dtype(dtype), device:
            model = tt_config.instantiate(model_cfg)
        embeddings = getattr(model, "tok_embeddings", None)
        if embedding_std is not None and embeddings is not None:
            with torch.no_grad():
                embeddings.weight.normal_(0.0, embedding_std)
        if device.type != "meta":
            initialize_dora_magnitudes(model)
        return model


def random_init_std(model_init: str) -> Optional[float]:
    """The embedding std for :func:`build_model`: HF's for ``model_init: random``, None when a
    checkpoint overwrites the weights anyway."""
    return RANDOM_INIT_EMBEDDING_STD if model_init == "random" else None


def check_state_dict(model: nn.Module, state_dict: Dict[str, torch.Tensor], *,
                     allow_missing: Optional[Iterable[str]] = None, source: str = "checkpoint") -> None:
    """Raises naming the first tensor whose name or shape does not match the model.

    Args:
        model (nn.Module): the model.
        state_dict (Dict[str, torch.Tensor]): weights to load.
        allow_missing (Optional[Iterable[str]]): model keys that may be absent (LoRA adapters).
        source (str): where the weights come from, for the message.

    Raises:
        CheckpointMismatchError: naming the tensor, the expected and the found shape.

    Example:
        >>> check_state_dict(model, ckpt_sd, allow_missing=adapter_keys)
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    allowed = set(allow_missing or ())
    for k, v in state_dict.items():
        if k not in expected:
            raise CheckpointMismatchError(
                f"{source}: tensor {k!r} (shape {tuple(v.shape)}) is not in the model built from the config; "
                f"the config's model does not match the checkpoint"
            )
        if tuple(v.shape) != expected[k]:
            raise CheckpointMismatchError(
                f"{source}: tensor {k!r} has shape {tuple(v.shape)}, the model expects {expected[k]}; "
                f"the config's model does not match the checkpoint"
            )
    for k in expected:
        if k not in state_dict and k not in allowed:
            raise CheckpointMismatchError(f"{source}: the model's tensor {k!r} is missing from the checkpoint")


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names a LoRA/DoRA adapter tensor (torchtune's names: ``lora_a``,
    ``lora_b``, DoRA's ``magnitude``): the tensors a LoRA recipe trains and saves as the adapter.

    Example:
        >>> is_adapter_key("layers.0.attn.q_proj.magnitude"), is_adapter_key("layers.0.attn.q_proj.weight")
        (True, False)
    """
    return "lora_" in key or key.endswith("magnitude")


def adapter_keys(model: nn.Module) -> List[str]:
    """The adapter keys of ``model``'s state dict (:func:`is_adapter_key`), in state-dict order."""
    return [k for k in model.state_dict() if is_adapter_key(k)]


def load_weights(model: nn.Module, state_dict: Dict[str, torch.Tensor], *,
                 allow_missing: Optional[Iterable[str]] = None, source: str = "checkpoint") -> None:
    """:func:`check_state_dict` then ``load_state_dict`` (``strict`` unless adapters may be missing).

    DoRA magnitudes that ``state_dict`` does not hold (a base checkpoint) are set from the loaded
    weights as DoRA initialises them (the row norms of ``W + B A``), so that the adapted model
    starts equal to the base; magnitudes it holds (an adapter checkpoint) are loaded as they are.
    """
    check_state_dict(model, state_dict, allow_missing=allow_missing, source=source)
    model.load_state_dict(state_dict, strict=not allow_missing)
    initialize_dora_magnitudes(model, skip=state_dict)


def initialize_dora_magnitudes(model: nn.Module, *, skip: Iterable[str] = ()) -> None:
    """Sets each DoRA module's magnitude to the row norms of its current ``W + B A`` (torchtune's
    ``initialize_dora_magnitude``), except the magnitudes named in ``skip``; no-op without DoRA.

    torchtune's DoRA layers allocate the magnitude uninitialised; it must be set after the base
    weights are in place.
    """
    skip = set(skip)
    for name, module in model.named_modules():
        if hasattr(module, "initialize_dora_magnitude"):
            key = (name + "." if name else "") + "magnitude"
            if key.replace("._checkpoint_wrapped_module", "") not in skip:
                module.initialize_dora_magnitude()


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoints every transformer layer (torchtune's ``set_activation_checkpointing``)."""
    tt_training.set_activation_checkpointing(model, auto_wrap_policy={tt_modules.TransformerSelfAttentionLayer})


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` per transformer layer (torchtune's ``compile_model``)."""
    note_compile("each transformer layer (compile: True), at the first forward")
    tt_training.compile_model(model, verbose=False)


def setup_lora(model: nn.Module) -> Dict[str, nn.Parameter]:
    """Freezes everything but the LoRA adapters.

    Args:
        model (nn.Module): a model built by a ``lora_*`` builder.

    Returns:
        Dict[str, nn.Parameter]: the adapter parameters.

    Raises:
        ValueError: if the model has no adapters.
    """
    params = get_adapter_params(model)
    if not params:
        raise ValueError("model: LoRA recipe needs a model with LoRA adapters (a lora_* builder); found none")
    set_trainable_params(model, params)
    return params


def adapter_config(model_cfg: DictConfig) -> Dict[str, Any]:
    """Adapter config (rank, alpha, DoRA, torchtune target modules) from the model's config."""
    return {
        "use_dora": bool(model_cfg.get("use_dora", False)),
        "r": model_cfg.lora_rank,
        "lora_alpha": model_cfg.lora_alpha,
        "target_modules": get_lora_module_names(
            list(model_cfg.lora_attn_modules), model_cfg.get("apply_lora_to_mlp", False),
            model_cfg.get("apply_lora_to_output", False)),
        "peft_type": "LORA",
    }


def lora_states(full_sd: Dict[str, torch.Tensor], model_cfg: DictConfig, merge: bool):
    """Splits a LoRA model's full state dict into (adapter weights, merged weights or None).

    Args:
        full_sd (Dict[str, torch.Tensor]): the LoRA model's full (gathered) state dict on CPU.
        model_cfg (DictConfig): the model node (``lora_rank``, ``lora_alpha``).
        merge (bool): also return the base weights with the adapters merged in (torchtune's
            ``get_merged_lora_ckpt``), loadable by the plain (non-LoRA) model builder.

    Returns:
        tuple: ``(adapter_state, merged_state | None)``.
    """
    adapter = get_adapter_state_dict(full_sd, device=None)
    merged = None
    if merge:
        merged = get_merged_lora_ckpt({k: v.clone() for k, v in full_sd.items()},
                                      rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha)
    return adapter, merged


def count_params(model: nn.Module) -> Dict[str, int]:
    """``{"params": total, "trainable_params": trainable}``."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": total, "trainable_params": trainable}
