"""What a checkpoint holds besides the weights, and how a recipe writes and restores it.

:func:`training_state` is the part every recipe saves (optimizer and LR schedule state, every
rank's RNG, seed, world size, the skipped-step counters, the config); a recipe adds its position
(step, epoch, ...). :func:`restore_training_state` puts it back after the optimizer is built, so a
resumed run continues bit for bit. :func:`save_checkpoint` checks the weights, gathers them and
writes one complete checkpoint folder (HF weights, LoRA adapters and merged weights).

Example:
    >>> state = {"step": step, **training_state(runtime, model, optimizer, lr_scheduler, guard, seed=seed, cfg=cfg)}
    >>> save_checkpoint(ckpt, runtime, model, step=step, epoch=0, recipe_state=state)
    >>> restore_training_state(start.recipe_state, runtime=runtime, model=model, optimizer=optimizer,
    ...                        lr_scheduler=lr_scheduler, guard=guard, changes=start.changes)
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch import nn

from logitless.training import model as model_utils
from logitless.training.checkpoint import CheckpointManager, CheckpointSaveError, set_rng_state
from logitless.training.config import config_summary
from logitless.training.data_fingerprint import with_data_fingerprints
from logitless.training.distributed import Runtime
from logitless.training.nonfinite import NonFiniteGuard, check_finite_weights
from logitless.training.resume import apply_optimizer_changes


def training_state(runtime: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Optional[Any],
                   guard: NonFiniteGuard, *, seed: int, cfg: DictConfig) -> Dict[str, Any]:
    """The recipe state every recipe saves (every rank calls it: it gathers the optimizer state and RNGs).

    Args:
        runtime (Runtime): gathers sharded optimizer state and every rank's RNG state.
        model (nn.Module): the (sharded) model the optimizer steps.
        optimizer (torch.optim.Optimizer): the optimizer.
        lr_scheduler (Optional[Any]): the LR schedule, or None.
        guard (NonFiniteGuard): the skipped-step counters.
        seed (int): the run's seed.
        cfg (DictConfig): the config (saved with its data files' fingerprints, so that a resume can name
            what changed).

    Returns:
        Dict[str, Any]: ``optimizer``, ``lr_scheduler``, ``rng``, ``seed``, ``world_size``,
        ``nonfinite``, ``config``.
    """
    return {"optimizer": runtime.optimizer_state_dict(model, optimizer),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "rng": runtime.rng_states(), "seed": seed, "world_size": runtime.world_size,
            "nonfinite": guard.state_dict(), "config": with_data_fingerprints(config_summary(cfg), cfg)}


def restore_training_state(state: Mapping[str, Any], *, runtime: Runtime, model: nn.Module,
                           optimizer: torch.optim.Optimizer, lr_scheduler: Optional[Any], guard: NonFiniteGuard,
                           changes: Mapping[str, Tuple[Any, Any]]) -> None:
    """Restores what :func:`training_state` saved, then applies the config's optimizer changes.

    Call it last in set-up: it sets this rank's RNG state as it was at the save.

    Args:
        state (Mapping[str, Any]): the checkpoint's ``recipe_state``.
        runtime (Runtime): loads a full optimizer state into a sharded optimizer.
        model (nn.Module): the (sharded) model.
        optimizer (torch.optim.Optimizer): built by the recipe, as at the save.
        lr_scheduler (Optional[Any]): the LR schedule, or None.
        guard (NonFiniteGuard): receives the skipped-step counters.
        changes (Mapping): ``RunStart.changes`` (new optimizer hyper-parameters win over the saved ones).
    """
    runtime.load_optimizer_state_dict(model, optimizer, state["optimizer"])
    if lr_scheduler is not None and state.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    apply_optimizer_changes(optimizer, lr_scheduler, changes, log_rank_zero=runtime.is_rank_zero)
    if state.get("nonfinite") is not None:
        guard.load_state_dict(state["nonfinite"])
    set_rng_state(runtime.own_rng_state(state["rng"]))


def save_checkpoint(ckpt: CheckpointManager, runtime: Runtime, model: nn.Module, *, step: int, epoch: int,
                    recipe_state: Dict[str, Any], lora_model_cfg: Optional[DictConfig] = None,
                    merge_adapters: bool = True) -> None:
    """Writes a complete checkpoint of ``step`` (all ranks take part, rank 0 writes).

    Every rank checks its shards first and all raise together: a checkpoint of NaN/inf weights is
    never written. A save that fails with an OS error (a full disk...) is settled on every rank by
    ``ckpt.on_save_error``: all raise the :class:`~logitless.training.checkpoint.CheckpointSaveError`
    together (``stop``), or all log it and go on (``continue``).

    Args:
        ckpt (CheckpointManager): writes ``step_*`` atomically.
        runtime (Runtime): gathers the full weights on rank 0.
        model (nn.Module): the (sharded) model.
        step (int): the optimizer step just taken.
        epoch (int): the data epoch.
        recipe_state (Dict[str, Any]): :func:`training_state` plus the recipe's position.
        lora_model_cfg (Optional[DictConfig]): a LoRA model's config: the adapters are saved
            separately, with the merged weights when ``merge_adapters``.
        merge_adapters (bool): LoRA: also save the base weights with the adapters merged.

    Raises:
        NonFiniteWeightsError: when a weight is NaN/inf.
        CheckpointSaveError: the save failed and ``on_save_error`` is ``stop``.
    """
    check_finite_weights(dict(model.named_parameters()), what=f"checkpoint step_{step:06d}",
                         all_reduce=runtime.all_reduce)
    full_sd = runtime.full_state_dict(model)
    error = None
    if runtime.is_rank_zero:
        try:
            if lora_model_cfg is not None:
                adapter, merged = model_utils.lora_states(full_sd, lora_model_cfg, merge=merge_adapters)
                ckpt.save(step=step, epoch=epoch, recipe_state=recipe_state, model_state=merged,
                          adapter_state=adapter)
            else:
                ckpt.save(step=step, epoch=epoch, recipe_state=recipe_state, model_state=full_sd)
        except CheckpointSaveError as e:
            error = e
    ckpt.record_save_outcome(runtime.broadcast_object(error))  # also the barrier after rank 0's write


__all__ = ["restore_training_state", "save_checkpoint", "training_state"]
