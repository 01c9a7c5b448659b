"""The SFT recipes' config: its keys (:data:`SFT_SCHEMA`), the keys a resume may not change, and
:func:`validate_sft_config`, which checks a whole config before anything is built.

Used by every SFT recipe (``recipes/full_sft_single_device.py`` holds their loop).
"""

from __future__ import annotations

from typing import Dict

import torch
from omegaconf import DictConfig

from logitless.training.checkpoint import ON_SAVE_ERROR_KEY
from logitless.training.config import ConfigError, Key, validate_config
from logitless.training.data_fingerprint import FINGERPRINT_KEY
from logitless.training.distributed import FSDP_KEYS
from logitless.losses import StepLoss
from logitless.training.preflight import ON_TOO_LONG, check_components
from logitless.training.resume import RESUME_KEYS, validate_resume_config
from logitless.training.threads import CPU_THREADS_KEY, check_cpu_threads

SFT_SCHEMA: Dict[str, Key] = {
    "output_dir": Key(str, doc="folder for checkpoints and logs"),
    "model": Key(component=True, doc="model builder"),
    "tokenizer": Key(component=True, doc="tokenizer builder"),
    "dataset": Key(component=True, positional=1, doc="dataset builder, called with the tokenizer"),
    "loss": Key(component=True, doc="a logitless.losses component"),
    "optimizer": Key(component=True, positional=1, doc="optimizer, called with the parameters"),
    "lr_scheduler": Key((None,), default=None, component=True, positional=1, supplied=("num_training_steps",),
                        doc="called with the optimizer (and num_training_steps unless set)"),
    "checkpointer": Key((None,), default=None, component=True),
    "metric_logger": Key((None,), default=None, component=True),
    "model_init": Key(str, default="checkpoint", choices=("checkpoint", "random"),
                      doc="'random' skips loading weights (benchmarks, machines without downloads)"),
    **RESUME_KEYS,
    "seed": Key(int, default=0),
    "shuffle": Key(bool, default=True),
    "batch_size": Key(int, default=2, min=1, doc="micro-batch size per device"),
    "gradient_accumulation_steps": Key(int, default=1, min=1),
    "epochs": Key(int, default=1, min=1),
    "max_steps_per_epoch": Key((int, None), default=None, min=1),
    "max_steps": Key((int, None), default=None, min=1, doc="stop after this many optimizer steps in total"),
    "clip_grad_norm": Key((float, None), default=None),
    "max_consecutive_skipped_steps": Key((int, None), default=3, min=1,
                                         doc="a step with a NaN/inf gradient norm or loss is skipped; stop "
                                             "after this many in a row (null: never)"),
    "dtype": Key(str, default="bf16", choices=("bf16", "fp32")),
    "device": Key(str, default="auto", doc="'auto' (cuda if available), 'cpu', 'cuda'"),
    "cpu_threads": CPU_THREADS_KEY,
    "enable_activation_checkpointing": Key(bool, default=False),
    "enable_activation_offloading": Key(bool, default=False,
                                        doc="torchtune's activation offloading: the checkpointed layer inputs wait in "
                                            "CPU memory (CUDA, with enable_activation_checkpointing)"),
    "compile": Key(bool, default=False),
    "log_every_n_steps": Key(int, default=1, min=1),
    "save_every_n_steps": Key((int, None), default=None, min=1),
    "save_final_checkpoint": Key(bool, default=True),
    "keep_last_n_checkpoints": Key((int, None), default=None, min=1),
    "on_save_error": ON_SAVE_ERROR_KEY,
    "num_workers": Key(int, default=0, min=0),
    "on_too_long": Key(str, default="truncate", choices=ON_TOO_LONG,
                       doc="rows longer than max_seq_len (tokenizer's or model's): cut, drop, or stop with an error; "
                           "counts are logged at start"),
}
# Keys a resume refuses to see changed (they break exact resume) unless named in resume_allow_changes;
# data_fingerprint.dataset: the training data files' sizes and hashes (training.data_fingerprint).
SFT_FIXED_ON_RESUME = ("batch_size", "gradient_accumulation_steps", "seed", "shuffle", "max_steps_per_epoch",
                       "dataset", "tokenizer", "model", "model_init", "dtype", "optimizer._component_",
                       "lr_scheduler._component_", "checkpointer.checkpoint_dir", "checkpointer.checkpoint_files",
                       "checkpointer.model_type", f"{FINGERPRINT_KEY}.dataset")
LORA_KEYS: Dict[str, Key] = {
    "merge_adapters": Key(bool, default=True,
                          doc="save the base weights with the adapters merged (HF format) in every checkpoint, "
                              "so each folder is a complete model; False: adapters only (docs/export.md)"),
}


def validate_sft_config(cfg: DictConfig, *, lora: bool = False, distributed: bool = False) -> DictConfig:
    """Validates an SFT config (see :data:`SFT_SCHEMA`) before anything is built.

    Args:
        cfg (DictConfig): the config.
        lora (bool): LoRA recipe (adds ``merge_adapters``; the model must be a ``lora_*`` builder).
        distributed (bool): FSDP2 recipe (adds ``fsdp_*`` keys).

    Returns:
        DictConfig: ``cfg`` with defaults filled in.

    Raises:
        ConfigError: naming the key.

    Example:
        >>> validate_sft_config(OmegaConf.load("configs/tiny_full.yaml"))
    """
    schema = dict(SFT_SCHEMA)
    if lora:
        schema.update(LORA_KEYS)
    if distributed:
        schema.update(FSDP_KEYS)
    init = cfg.get("model_init", "checkpoint")
    skip = ("checkpointer",) if init == "random" else ()
    validate_config(cfg, schema, skip_file_checks=skip)
    validate_resume_config(cfg, SFT_FIXED_ON_RESUME)
    if cfg.model_init == "checkpoint" and cfg.checkpointer is None:
        raise ConfigError("config key 'checkpointer': required when model_init='checkpoint' "
                          "(or set model_init=random)")
    if lora:
        for k in ("lora_rank", "lora_alpha", "lora_attn_modules"):
            if k not in cfg.model:
                raise ConfigError(f"config key 'model.{k}': the LoRA recipe needs a lora_* model builder "
                                  f"(got {cfg.model._component_!r} without {k})")
    check_components(cfg, loss_class=StepLoss, loss_inputs=(), num_training_steps=cfg.max_steps)
    if cfg.clip_grad_norm is not None and not cfg.clip_grad_norm > 0:
        raise ConfigError(f"config key 'clip_grad_norm': expected a value > 0 or null, got {cfg.clip_grad_norm!r}")
    check_cpu_threads(cfg.cpu_threads)
    if cfg.enable_activation_offloading:
        if not cfg.enable_activation_checkpointing:
            raise ConfigError("config key 'enable_activation_offloading': True needs enable_activation_checkpointing: "
                              "True (it offloads the inputs the checkpointed layers keep)")
        if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
            raise ConfigError(f"config key 'enable_activation_offloading': True needs a CUDA device, got device "
                              f"{cfg.device!r}{' on a machine without CUDA' if cfg.device == 'auto' else ''}")
    return cfg


__all__ = ["LORA_KEYS", "SFT_FIXED_ON_RESUME", "SFT_SCHEMA", "validate_sft_config"]
