"""Set-up steps every recipe (SFT and GRPO) takes, each from the validated config.

A recipe's ``setup()`` reads as a list of these: the process (threads, device, dtype, seed), the
checkpoint manager, the model with its weights (base checkpoint, resumed weights or adapters, LoRA
freeze), the training wrappers (activation checkpointing, compile, FSDP2) and the optimizer with its
LR schedule.

Example:
    >>> runtime, dtype, seed = setup_process(cfg, distributed=False)
    >>> ckpt = build_checkpoint_manager(cfg, runtime, run_id=start.run_id)
    >>> model = build_model_with_weights(cfg, ckpt, device=runtime.device, dtype=dtype, seed=seed,
    ...                                  lora=False, resume_dir=start.checkpoint)
    >>> wrap_model(model, cfg, runtime)
    >>> optimizer, lr_scheduler = build_optimizer(cfg, model, num_training_steps=100)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config as tt_config
from torchtune import training as tt_training

from logitless.training import model as model_utils
from logitless.training.checkpoint import CheckpointManager
from logitless.training.distributed import Runtime
from logitless.training.export import ModelExport
from logitless.training.threads import apply_cpu_threads


def setup_process(cfg: DictConfig, *, distributed: bool) -> Tuple[Runtime, torch.dtype, int]:
    """This process's CPU threads (``cpu_threads``), process group and device (``device``), the
    parameter dtype (``dtype``) and the seeded RNGs (``seed``; torchtune's ``set_seed``).

    Args:
        cfg (DictConfig): the validated recipe config.
        distributed (bool): join the process group of ``torchrun`` (FSDP2 recipes).

    Returns:
        Tuple: ``(runtime, dtype, seed)``.
    """
    apply_cpu_threads(cfg.cpu_threads, cfg.device)
    runtime = Runtime.setup(cfg.device, distributed=distributed)
    return runtime, tt_training.get_dtype(cfg.dtype, device=runtime.device), tt_training.set_seed(cfg.seed)


def build_checkpoint_manager(cfg: DictConfig, runtime: Runtime, *, run_id: str) -> CheckpointManager:
    """The run's :class:`CheckpointManager`: it loads the base weights (``model_init: checkpoint``)
    and writes ``output_dir/step_*`` under ``run_id`` (from :func:`~logitless.training.resume.start_run`).

    Args:
        cfg (DictConfig): the recipe config (``checkpointer``, ``model_init``, ``output_dir``,
            ``keep_last_n_checkpoints``, ``on_save_error``).
        runtime (Runtime): only rank 0 writes.
        run_id (str): the lineage this session writes under.

    Returns:
        CheckpointManager: the manager (its ``export`` is set by :func:`build_model_with_weights`).
    """
    return CheckpointManager(cfg.checkpointer if cfg.model_init == "checkpoint" else None, cfg.output_dir,
                             is_rank_zero=runtime.is_rank_zero, keep_last_n=cfg.keep_last_n_checkpoints,
                             run_id=run_id, on_save_error=cfg.on_save_error)


def build_model_with_weights(cfg: DictConfig, ckpt: CheckpointManager, *, device: torch.device, dtype: torch.dtype,
                             seed: int, lora: bool, resume_dir: Optional[Path] = None) -> nn.Module:
    """Builds ``cfg.model`` and loads its weights; a LoRA model is frozen but for its adapters.

    The weights: the base checkpoint (``model_init: checkpoint``; random weights seeded by ``seed``
    otherwise), then with ``resume_dir`` the resumed run's weights (full) or adapters (LoRA). A full
    resume skips the base checkpoint, which the resumed weights replace. Also sets ``ckpt.export``
    (what completes each saved folder) from the model as built.

    Args:
        cfg (DictConfig): the recipe config (``model``, ``model_init``, ``checkpointer``, ``tokenizer``).
        ckpt (CheckpointManager): reads the base and resumed weights.
        device (torch.device): where the model is built.
        dtype (torch.dtype): parameter dtype.
        seed (int): seeds the random initialisation (the same weights on every rank).
        lora (bool): a LoRA model (adapters may be missing from the base checkpoint).
        resume_dir (Optional[Path]): the verified checkpoint to resume from.

    Returns:
        nn.Module: the model, unsharded, on ``device``.

    Raises:
        CheckpointMismatchError: naming a tensor the checkpoint and the model disagree on.
    """
    model = model_utils.build_model(cfg.model, device=device, dtype=dtype, seed=seed,
                                    embedding_std=model_utils.random_init_std(cfg.model_init))
    ckpt.export = ModelExport.for_run(cfg, model, lora=lora)
    if cfg.model_init == "checkpoint" and (resume_dir is None or lora):
        model_utils.load_weights(model, ckpt.load_model_state(), allow_missing=model_utils.adapter_keys(model) if lora else None,
                                 source=str(cfg.checkpointer.checkpoint_dir))
    if resume_dir is not None:
        load_resumed_weights(model, ckpt, resume_dir, lora=lora)
    if lora:
        model_utils.setup_lora(model)
    return model


def load_resumed_weights(model: nn.Module, ckpt: CheckpointManager, resume_dir: Path, *, lora: bool) -> None:
    """Loads a checkpoint's trained weights into ``model``: every weight, or only the adapters (LoRA).

    Args:
        model (nn.Module): the model, unsharded.
        ckpt (CheckpointManager): reads the checkpoint.
        resume_dir (Path): a verified checkpoint folder.
        lora (bool): load ``adapter_model.pt`` only (the frozen base is the configured checkpoint's).
    """
    if lora:
        adapters = set(model_utils.adapter_keys(model))
        model_utils.load_weights(model, ckpt.load_adapter_state(resume_dir),
                                 allow_missing=[k for k in model.state_dict() if k not in adapters],
                                 source=str(resume_dir))
    else:
        model_utils.load_weights(model, ckpt.load_model_state(resume_dir), source=str(resume_dir))


def fsdp_options(cfg: DictConfig) -> Dict[str, Any]:
    """``Runtime.shard``'s keyword arguments from the config's ``fsdp_*`` keys (their defaults on one device)."""
    return {"cpu_offload": cfg.get("fsdp_cpu_offload", False),
            "reshard_after_forward": cfg.get("fsdp_reshard_after_forward", True)}


def wrap_model(model: nn.Module, cfg: DictConfig, runtime: Runtime) -> None:
    """Activation checkpointing (``enable_activation_checkpointing``), per-layer ``torch.compile``
    (``compile``) and FSDP2 over the ranks (a no-op on one device), in that order.

    Call it after the loss has configured the model's output (``loss_fn.set_model_output``).

    Args:
        model (nn.Module): the model with its weights.
        cfg (DictConfig): the recipe config.
        runtime (Runtime): shards the model when distributed.
    """
    if cfg.enable_activation_checkpointing:
        model_utils.apply_activation_checkpointing(model)
    if cfg.get("compile", False):
        model_utils.compile_layers(model)
    runtime.shard(model, **fsdp_options(cfg))


def build_optimizer(cfg: DictConfig, model: nn.Module, *, num_training_steps: Optional[int] = None
                    ) -> Tuple[torch.optim.Optimizer, Optional[Any]]:
    """The optimizer over the trainable parameters and the optional LR schedule.

    Args:
        cfg (DictConfig): the recipe config (``optimizer``, ``lr_scheduler``).
        model (nn.Module): the model (sharded or not).
        num_training_steps (Optional[int]): given to the schedule unless its config sets it.

    Returns:
        Tuple: ``(optimizer, lr_scheduler)`` (the schedule is None when ``lr_scheduler`` is null).
    """
    optimizer = tt_config.instantiate(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    if cfg.lr_scheduler is None:
        return optimizer, None
    kw = {} if num_training_steps is None or "num_training_steps" in cfg.lr_scheduler else {
        "num_training_steps": num_training_steps}
    return optimizer, tt_config.instantiate(cfg.lr_scheduler, optimizer, **kw)


__all__ = ["build_checkpoint_manager", "build_model_with_weights", "build_optimizer", "fsdp_options",
           "load_resumed_weights", "setup_process", "wrap_model"]
